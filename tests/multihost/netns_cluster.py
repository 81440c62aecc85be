"""A throwaway cluster of hosts on this machine: network namespaces running sshd.

:func:`cluster` (a context manager) builds, for ``n`` hosts ``h1 .. hn``:

* a bridge ``<tag>`` in the root namespace with address ``10.77.S.254/24`` (``S`` the first subnet
  from one derived from the pid that no interface of the root namespace has, claimed under a
  file lock, so that concurrent clusters on one kernel -- pytest-xdist's workers, other
  checkouts' runs -- use different subnets; names derive from the pid);
* per host a namespace ``<tag>h<i>`` joined to the bridge by a veth pair, whose inner end is also
  named ``<tag>`` (so ``--network-interface <tag>`` names the right interface on every host) with
  ``10.77.S.i/24``, plus its loopback;
* in a private temporary directory: an ed25519 host key and user key, ``authorized_keys``, an
  ``sshd_config`` per host (port 22 on the host's address only; root login with a key only; no
  passwords, no PAM), a ``known_hosts`` holding the host key under every host's name and address,
  and an ssh client config mapping ``h<i>`` to its address with ``StrictHostKeyChecking yes``
  -- host-key checking stays on;
* ``sshd -D`` in each namespace, and ``/etc/netns/<ns>/hosts`` naming every host (``ip netns
  exec`` shows it as the namespace's /etc/hosts).

Traffic only ever goes to those namespace addresses or loopback. Everything is removed on exit,
failure included: processes in the namespaces, the namespaces, the bridge, the directory.
:func:`unavailable` says why namespaces cannot be made here (then the tests skip).
:func:`on_host` runs a command as one of the hosts, :func:`ringflow_run` builds the launcher's
command line for a cluster, :func:`shaped` limits every
host's link with ``tc``, and :func:`link_bytes` reads a host's link counters from outside.

Faults (issue 32, tests/multihost/test_link_faults.py): :func:`set_link` takes a host's switch
port down or up (a cable pulled), :func:`vanish` removes it (the host is gone without a word, as
on a power loss: its sockets are never closed), :func:`impaired` loses, delays and reorders what
a host receives, and :func:`one_way` drops what one host sends to another. The kernels here are
built without ``tc``'s netem (``CONFIG_NET_SCH_NETEM``), so :func:`impaired` uses netfilter:
the ``statistic`` match for loss and a queue to userspace (``netem.py``) for delay and order;
both need ``iptables-legacy`` (:data:`IMPAIR_HINT`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
INSTALL_HINT = "apt-get update && apt-get install -y openssh-server openssh-client"
#: The legacy tables: this kernel's nf_tables lacks the queue expression that iptables-nft would
#: translate ``-j NFQUEUE`` into (``CONFIG_NFT_QUEUE``), while the xtables target is built in.
IPTABLES = shutil.which("iptables-legacy")
IMPAIR_HINT = "apt-get install -y iptables"
NETEM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netem.py")


@dataclasses.dataclass(frozen=True)
class Cluster:
    hosts: tuple[str, ...]
    addresses: tuple[str, ...]
    interface: str
    ssh_config: str
    identity: str
    known_hosts: str
    workdir: str
    #: ``namespaces[i]`` holds host ``hosts[i]``; ``links[i]`` is the root-namespace end of its
    #: veth pair (a bridge port). The host's own end is named ``interface`` in its namespace.
    namespaces: tuple[str, ...] = ()
    links: tuple[str, ...] = ()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def unavailable() -> str | None:
    """Why no namespace can be created here, or None."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"rfprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


#: Held while a cluster picks its subnet and gives it to its bridge: the pick reads the root
#: namespace's addresses, so two clusters starting at once must not both see a subnet free.
SUBNET_LOCK = os.path.join(tempfile.gettempdir(), "ringflow-netns-subnets.lock")


def _claim_subnet(tag: str) -> str:
    """Create bridge ``tag`` on a subnet ``10.77.S`` that no root-namespace interface has; its
    prefix ``10.77.S``. Concurrent clusters (pytest-xdist workers, other runs) each get their own
    subnet and bridge MAC address."""
    with open(SUBNET_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        used = set(re.findall(r"\binet 10\.77\.(\d+)\.", _ip("-4", "-o", "addr", "show").stdout))
        first = os.getpid() % 250
        free = [s for k in range(250) if str(s := (first + k) % 250 + 1) not in used]
        if not free:
            raise RuntimeError("every subnet 10.77.1.0/24 .. 10.77.250.0/24 is in use: clusters "
                               "left from killed runs? `ip -4 addr show` lists their bridges")
        _ip("link", "add", tag, "type", "bridge")
        # A bridge takes the lowest MAC address of its ports unless given one: removing a host's
        # port (a host that vanishes) would change it, and the other hosts' ARP entries for the
        # bridge's address (the launcher's store) would point nowhere for ~30 s.
        _ip("link", "set", tag, "address", f"02:00:00:77:{free[0]:02x}:fe")
        _ip("addr", "add", f"10.77.{free[0]}.254/24", "dev", tag)
        return f"10.77.{free[0]}"


def _wait_port(addr: str, port: int, deadline: float, proc: subprocess.Popen[bytes]) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd for {addr} exited with code {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((addr, port), timeout=0.5):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd on {addr}:{port} did not start within the deadline")
        time.sleep(0.05)


def _keygen(path: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True,
                   timeout=20, stdin=subprocess.DEVNULL)
    with open(path + ".pub") as f:
        return f.read().strip()


@contextlib.contextmanager
def cluster(n: int = 2) -> Iterator[Cluster]:
    """Build an ``n``-host cluster (2 to 4); tear everything down on exit."""
    if not os.path.exists(SSHD):
        raise RuntimeError(f"sshd is not installed; CI installs it with: {INSTALL_HINT}")
    tag = f"rf{os.getpid() % 100000}"
    namespaces = [f"{tag}h{i}" for i in range(1, n + 1)]
    names = tuple(f"h{i}" for i in range(1, n + 1))
    undo: list[tuple[str, ...]] = [("link", "del", tag)]  # harmless if never made
    sshds: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.mkdtemp(prefix="ringflow-multihost-")
    try:
        subnet = _claim_subnet(tag)
        addresses = tuple(f"{subnet}.{i}" for i in range(1, n + 1))
        _ip("link", "set", tag, "up")
        for i, (ns, addr) in enumerate(zip(namespaces, addresses, strict=True), start=1):
            _ip("netns", "add", ns)
            undo.append(("netns", "del", ns))
            outer, inner = f"{tag}v{i}", f"{tag}p{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            undo.append(("link", "del", outer))  # gone with the namespace too; harmless then
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "link", "set", inner, "name", tag)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", tag)
            _ip("-n", ns, "link", "set", tag, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", outer, "master", tag)
            _ip("link", "set", outer, "up")

        # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: host names resolve
        # inside the namespaces (as a cluster's DNS would; Slurm's node lists name hosts).
        for ns in namespaces:
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            undo.append(("rmtree", f"/etc/netns/{ns}"))
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n")
                for name, addr in zip(names, addresses, strict=True):
                    f.write(f"{addr} {name}\n")
        host_pub = _keygen(os.path.join(tmp, "host_key"))
        user_pub = _keygen(os.path.join(tmp, "id"))
        with open(os.path.join(tmp, "authorized_keys"), "w") as f:
            f.write(user_pub + "\n")
        known = os.path.join(tmp, "known_hosts")
        with open(known, "w") as f:
            for name, addr in zip(names, addresses, strict=True):
                f.write(f"{name},{addr} {host_pub}\n")
        config = os.path.join(tmp, "ssh_config")
        with open(config, "w") as f:
            for name, addr in zip(names, addresses, strict=True):
                f.write(f"Host {name}\n  HostName {addr}\n")
            f.write(
                "Host *\n  User root\n  Port 22\n"
                f"  IdentityFile {tmp}/id\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {known}\n  GlobalKnownHostsFile /dev/null\n"
                "  StrictHostKeyChecking yes\n  CheckHostIP no\n  ConnectTimeout 5\n"
                "  LogLevel ERROR\n"
            )
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        for ns, addr in zip(namespaces, addresses, strict=True):
            cfg = os.path.join(tmp, f"sshd_config.{ns}")
            with open(cfg, "w") as f:
                f.write(
                    f"Port 22\nListenAddress {addr}\nHostKey {tmp}/host_key\n"
                    f"PidFile {tmp}/sshd.{ns}.pid\nAuthorizedKeysFile {tmp}/authorized_keys\n"
                    "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                    "UsePAM no\nStrictModes no\nPrintMotd no\nSubsystem sftp internal-sftp\n"
                )
            log = open(os.path.join(tmp, f"sshd.{ns}.log"), "wb")  # noqa: SIM115
            sshds.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", cfg],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            ))
            log.close()
        deadline = time.monotonic() + 15
        for addr, proc in zip(addresses, sshds, strict=True):
            _wait_port(addr, 22, deadline, proc)
        yield Cluster(names, addresses, tag, config, os.path.join(tmp, "id"), known, tmp,
                      tuple(namespaces), tuple(f"{tag}v{i}" for i in range(1, n + 1)))
    finally:
        for proc in sshds:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for ns in namespaces:  # sessions and workers that outlived their sshd
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for proc in sshds:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for args in reversed(undo):
            if args[0] == "rmtree":
                shutil.rmtree(args[1], ignore_errors=True)
            else:
                _ip(*args, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def on_host(namespace: str, name: str) -> list[str]:
    """A command prefix that runs a command on a namespace host as that host: in its network
    namespace, with its own host name (a UTS namespace), as a program on a real host would."""
    return ["ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', name]


def ringflow_run(c: Cluster, slots: dict[int, int], *command: str) -> list[str]:
    """The ``ringflow-run`` command line for ``slots[i]`` ranks on host ``c.hosts[i]``."""
    spec = ",".join(f"{c.hosts[i]}:{k}" for i, k in sorted(slots.items()))
    return [
        sys.executable, "-m", "ringflow.runner", "-np", str(sum(slots.values())),
        "-H", spec, "--ssh-config-file", c.ssh_config, "-i", c.identity, "-p", "22",
        "--network-interface", c.interface, *command,
    ]


def link_bytes(c: Cluster, i: int) -> tuple[int, int]:
    """(bytes sent, bytes received) so far by host ``i`` on its link to the bridge.

    Read from the root-namespace end of the veth pair: what that end received is what the host
    sent, and the other way round.
    """
    base = f"/sys/class/net/{c.links[i]}/statistics/"
    with open(base + "rx_bytes") as rx, open(base + "tx_bytes") as tx:
        return int(rx.read()), int(tx.read())


@contextlib.contextmanager
def shaped(c: Cluster, rate: str = "1gbit", burst: str = "256kb",
           latency: str = "25ms") -> Iterator[None]:
    """Limit every host's link to ``rate`` in each direction with a token-bucket qdisc (``tc``).

    The host's own veth end shapes what it sends, the bridge's end what it receives: a
    full-duplex link of ``rate`` per host, like a switch port. Removed on exit, failure included.
    """
    if shutil.which("tc") is None:
        raise RuntimeError("the `tc` command (iproute2) is missing: apt-get install -y iproute2")
    tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
    done: list[list[str]] = []
    try:
        for ns, outer in zip(c.namespaces, c.links, strict=True):
            for where in (["-n", ns], []):
                dev = c.interface if where else outer
                subprocess.run(["tc", *where, "qdisc", "add", "dev", dev, *tbf], check=True,
                               capture_output=True, text=True, timeout=20)
                done.append(["tc", *where, "qdisc", "del", "dev", dev, "root"])
        yield
    finally:
        for cmd in reversed(done):
            subprocess.run(cmd, check=False, capture_output=True, timeout=20)


def _run(cmd: list[str], check: bool = True) -> None:
    subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=20)


def set_link(c: Cluster, i: int, up: bool) -> None:
    """Take host ``i``'s switch port down (as if its cable were pulled) or up again. The host
    keeps its address and routes; its packets go nowhere meanwhile."""
    _ip("link", "set", c.links[i], "up" if up else "down")


def vanish(c: Cluster, i: int) -> None:
    """Host ``i`` leaves the network without a word, as on a power loss: its veth pair is
    deleted, so nothing it had open is ever closed or reset, and nothing reaches it. Its
    processes live on, cut off (they are the namespace's, removed by :func:`cluster`)."""
    _ip("link", "del", c.links[i])


def impair_unavailable() -> str | None:
    """Why :func:`impaired` and :func:`one_way` cannot run here, or None."""
    if IPTABLES is None:
        return f"iptables-legacy is missing ({IMPAIR_HINT})"
    return None


@contextlib.contextmanager
def impaired(c: Cluster, hosts: tuple[int, ...], *, loss: float = 0.0, delay_ms: float = 0.0,
             jitter_ms: float = 0.0, reorder: float = 0.0, seed: int = 1) -> Iterator[dict]:
    """Impair what each of ``hosts`` receives on its link, as ``tc netem`` would on the
    sender's side: every packet between two impaired hosts is impaired once.

    * ``loss``: the kernel's ``-m statistic --mode random`` drop. Like netem, it acts per
      packet as the stack holds it, and a TCP burst of up to 64 KiB (GSO) is one packet there:
      the fraction of bytes lost is ``loss``, in bursts.
    * ``delay_ms`` ± ``jitter_ms`` (uniform), ``reorder`` (that fraction goes at once, ahead of
      the delayed ones): ``netem.py`` behind an NFQUEUE rule, per wire packet, at up to about
      10 MiB/s. On the receiving side, because a packet held on the sender's side still counts
      against its socket (TCP small queues), which slows TCP to a crawl under a 50 ms hold.

    Yields ``{host: "lost=N lost_bytes=B queued=N dropped=N"}``, filled in on exit: what the
    loss rule dropped, what the queue program saw.
    Removed on exit, failure included.
    """
    if IPTABLES is None:
        raise RuntimeError(f"impairing links needs iptables-legacy: {IMPAIR_HINT}")
    rules: list[tuple[str, list[str]]] = []  # (namespace, match and target in raw PREROUTING)
    queues: dict[int, subprocess.Popen[str]] = {}
    counts: dict[int, str] = {}

    def iptables(ns: str, op: str, rule: list[str], check: bool = True) -> None:
        _run(["ip", "netns", "exec", ns, IPTABLES, "-t", "raw", op, "PREROUTING", "-i",
              c.interface, *rule], check=check)

    try:
        for i in hosts:
            ns = c.namespaces[i]
            if delay_ms or reorder:
                proc = subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, NETEM, "--queue", "0",
                     "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms),
                     "--reorder", str(reorder), "--seed", str(seed + i)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                queues[i] = proc
                if proc.stdout is None or proc.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"netem.py did not start: {proc.communicate()[1]}")
            if loss:  # first: a packet lost is never queued
                rule = ["-m", "statistic", "--mode", "random", "--probability", f"{loss:g}",
                        "-j", "DROP"]
                iptables(ns, "-A", rule)
                rules.append((ns, rule))
            if i in queues:
                rule = ["-j", "NFQUEUE", "--queue-num", "0"]
                iptables(ns, "-A", rule)
                rules.append((ns, rule))
        yield counts
    finally:
        for i in hosts if loss else ():
            listed = subprocess.run(
                ["ip", "netns", "exec", c.namespaces[i], IPTABLES, "-t", "raw", "-vxnL",
                 "PREROUTING"], capture_output=True, text=True, timeout=20).stdout
            for line in listed.splitlines():
                if "DROP" in line and "statistic" in line:
                    pkts, size = line.split()[:2]
                    counts[i] = f"lost={pkts} lost_bytes={size}"
        for ns, rule in reversed(rules):  # before the queue's reader goes: it drops the rest
            iptables(ns, "-D", rule, check=False)
        for i, proc in queues.items():
            proc.terminate()
            try:
                counts[i] = " ".join(filter(None, [counts.get(i, ""),
                                                   proc.communicate(timeout=10)[1].strip()]))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


@contextlib.contextmanager
def one_way(c: Cluster, src: int, dst: int) -> Iterator[None]:
    """Everything host ``src`` sends to host ``dst`` is dropped, silently (as by a broken
    link in one direction); ``dst`` to ``src`` still flows. Removed on exit."""
    if IPTABLES is None:
        raise RuntimeError(f"a one-way partition needs iptables-legacy: {IMPAIR_HINT}")
    rule = ["OUTPUT", "-o", c.interface, "-d", c.addresses[dst], "-j", "DROP"]
    _run(["ip", "netns", "exec", c.namespaces[src], IPTABLES, "-A", *rule])
    try:
        yield
    finally:
        _run(["ip", "netns", "exec", c.namespaces[src], IPTABLES, "-D", *rule], check=False)
