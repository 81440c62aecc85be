"""ringflow across rate-limited namespace hosts: time against the ring bound and gloo, link bytes.

    sudo python benchmarks/multihost.py                   # 1 Gbit/s links, 256 MiB, 3 repeats
    sudo python benchmarks/multihost.py --rate 500mbit --mib 64 --repeats 5
    sudo python benchmarks/multihost.py --hosts 2 3 4 5 6 7 8 --plot docs/benchmarks/hosts.png

Builds 4 hosts on this machine (network namespaces on a bridge running sshd:
``tests/multihost/netns_cluster.py``) and limits every host's link with a token-bucket qdisc
(``tc ... tbf rate R``) in both directions, like a full-duplex switch port of rate ``R``. Every
job starts through ``ringflow-run -H h1:k,h2:k,...`` over ssh. Traffic only goes to the
namespace addresses created here; everything (processes, qdiscs, namespaces, bridge) is removed on
exit, failure included. Without root or ``ip netns`` the script says why and exits 0.

Measured, float32 SUM allreduce of ``S`` bytes, ``--repeats`` jobs of ``--warmup`` + ``--iters``
allreduces each; an allreduce's time is the slowest rank's, after a barrier:

1. ``n`` hosts (``--hosts``, 2 and 4 by default), one rank each: ringflow (engine path; one
   rank per host means the TCP ring) against the ring bound ``2 (n-1)/n * S / R``, reported as
   ``bound / time`` (1.0 = the link is never idle), and ``torch.distributed`` gloo started by the
   same launcher in the same namespaces on the same links; ``--plot`` draws it.
2. 2 hosts x 2 ranks: the hierarchical path (the default for this layout) against
   ``RINGFLOW_TRANSPORT=tcp`` (one ring over all 4 ranks): the bytes each host sent on its link
   per allreduce (its veth's ``tx_bytes``, read by the host's local rank 0 around the timed
   allreduces) against the host-level ring bound ``2 (H-1)/H * S`` and the rank-level
   ``2 (N-1)/N * S``.

3. ``--loss P [P ...]`` (instead of 1 and 2): 2 hosts, one rank each, every host losing the
   fraction ``P`` of what it receives (``netns_cluster.impaired``: the kernel's ``statistic``
   match, per packet as the stack holds it, as netem's loss; needs ``iptables-legacy``);
   ringflow and gloo alternate, job by job, at each ``P`` in turn, within one repeat:

       sudo python benchmarks/multihost.py --loss 0 0.01 --mib 64 --repeats 5

Ceiling: with the default MTU of 1500 a TCP segment carries 1448 payload bytes in 1514 bytes on
the wire (Ethernet, IP and TCP headers with timestamps), so no TCP peer can exceed
1448/1514 = 0.956 of the bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "multihost"))
import netns_cluster  # noqa: E402
import records  # noqa: E402  (this directory's: a script's first path)

WORKER = os.path.join(ROOT, "tests", "multihost", "allreduce_worker.py")
CEILING = 1448 / 1514


def plot(path: str, runs: dict, hosts: list[int], nbytes: int, bps: float, rate: str) -> None:
    """``bound / time`` (1.0: the link never idle) against the number of hosts, per peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for peer in ("ringflow", "gloo"):
        xs = [n for n in hosts if runs.get(f"{peer}/{n}")]
        ys = [2 * (n - 1) / n * nbytes * 8 / bps
              / statistics.median(t for t, _ in runs[f"{peer}/{n}"]) for n in xs]
        if xs:
            ax.plot(xs, ys, marker="o", label=peer)
    ax.axhline(CEILING, linestyle="--", color="gray", label="TCP ceiling (MTU 1500)")
    ax.set_xlabel("namespace hosts (one rank each)")
    ax.set_ylabel("ring bound / time")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{nbytes >> 20} MiB allreduce, {rate} links")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def gloo_worker(args: argparse.Namespace) -> None:
    """One gloo rank: ringflow-run only launches it; rendezvous is gloo's own TCPStore."""
    os.environ.update(
        RANK=os.environ["RINGFLOW_RANK"], WORLD_SIZE=os.environ["RINGFLOW_SIZE"],
        MASTER_ADDR=args.master, MASTER_PORT=str(args.port), GLOO_SOCKET_IFNAME=args.interface,
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    buf = torch.empty(args.bytes // 4, dtype=torch.float32)
    times = []
    for i in range(args.warmup + args.iters):
        buf.fill_(rank + 1)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    ok = bool(torch.all(buf == n * (n + 1) / 2))
    dist.destroy_process_group()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "times": times, "ok": ok, "tx": None}, f)


def _job(c: netns_cluster.Cluster, slots: dict[int, int], command: list[str],
         env: dict[str, str], timeout: float) -> list[dict]:
    """Run one job; return every rank's result (see allreduce_worker.py)."""
    with tempfile.TemporaryDirectory(prefix="ringflow-bench-") as out:
        os.chmod(out, 0o700)
        cmd = netns_cluster.ringflow_run(c, slots, *command, "--out", out)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:  # timed out or interrupted: the launcher stops its workers
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=15)
                if proc.poll() is None:
                    proc.kill()
        n = sum(slots.values())
        files = [os.path.join(out, f"rank{r}.json") for r in range(n)]
        if proc.returncode or not all(os.path.exists(f) for f in files):
            raise RuntimeError(f"job {' '.join(cmd[5:8])} failed with code {proc.returncode}:\n"
                               f"{err[-3000:]}")
        results = []
        for path in files:
            with open(path) as f:
                results.append(json.load(f))
        bad = [r["rank"] for r in results if not r["ok"]]
        if bad:
            raise RuntimeError(f"wrong allreduce result on ranks {bad}")
        return results


def _summary(results: list[dict]) -> tuple[float, float | None]:
    """(median over iterations of the slowest rank's time, mean bytes sent per host)."""
    per_iter = [max(ts) for ts in zip(*(r["times"] for r in results), strict=True)]
    sent = [r["tx"] for r in results if r.get("tx") is not None]
    return statistics.median(per_iter), (statistics.fmean(sent) if sent else None)


def parse_rate(rate: str) -> float:
    """``tc``'s rate syntax (``1gbit``, ``500mbit``, ``100kbit``) in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if m is None:
        raise ValueError(f"--rate {rate!r}: use tc's syntax, e.g. 1gbit or 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the clean-up blocks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--interface", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="1gbit", help="link rate per host and direction (tc syntax)")
    ap.add_argument("--mib", type=int, default=256, help="allreduce size in MiB")
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 4], choices=range(2, 9))
    ap.add_argument("--iters", type=int, default=2, help="timed allreduces per job")
    # Two: the shared-memory path alternates between two halves of its segment, and the first
    # use of each half pays its page faults (measured at 256 MiB, 2 hosts x 2 ranks: first timed
    # allreduce 3.4-4.8 s after one warm-up, the next 2.5-2.7 s).
    ap.add_argument("--warmup", type=int, default=2, help="untimed allreduces per job")
    ap.add_argument("--repeats", type=int, default=3, help="jobs per configuration")
    ap.add_argument("--no-gloo", action="store_true", help="skip torch.distributed gloo")
    ap.add_argument("--loss", type=float, nargs="+", default=None,
                    help="fractions of packets each host loses: 2 hosts, ringflow vs gloo")
    ap.add_argument("--cc", default="", help="TCP congestion control of the hosts with --loss: "
                    "one of net.ipv4.tcp_allowed_congestion_control, the only ones a namespace "
                    "may pick (reno, bbr here); default: the kernel's (bbr here)")
    ap.add_argument("--json", default="", help="also write every job's figures here")
    ap.add_argument("--plot", default="", help="also plot bound / time against hosts (PNG)")
    args = ap.parse_args()
    if args.gloo_worker:
        gloo_worker(args)
        return 0

    reason = netns_cluster.unavailable()
    if reason is None and not os.path.exists(netns_cluster.SSHD):
        reason = f"sshd is missing ({netns_cluster.INSTALL_HINT})"
    if reason is None and not shutil.which("tc"):
        reason = "the `tc` command is missing (apt-get install -y iproute2)"
    if reason is not None:
        print(f"multihost benchmark skipped: namespace hosts cannot be built here: {reason}",
              file=sys.stderr)
        return 0
    if args.loss is not None and netns_cluster.impair_unavailable():
        print(f"multihost benchmark skipped: {netns_cluster.impair_unavailable()}",
              file=sys.stderr)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    if args.loss is not None:
        return lossy(args)
    bps = parse_rate(args.rate)
    nbytes = args.mib << 20
    # A job's limit: every allreduce at a quarter of the link rate, plus start-up.
    per_op = 2 * nbytes * 8 / bps
    timeout = 60 + 4 * per_op * (args.warmup + args.iters)
    common = ["--bytes", str(nbytes), "--iters", str(args.iters), "--warmup", str(args.warmup)]
    runs: dict[str, list[tuple[float, float | None]]] = {}
    log = []
    failures: list[str] = []

    def record(key: str, job: Callable[[], list[dict]]) -> None:
        for attempt in (1, 2):  # a failed job is reported and retried once, never averaged in
            try:
                results = job()
                break
            except RuntimeError as exc:
                failures.append(f"{key} (repeat {rep + 1}, attempt {attempt}): {exc}")
                print(f"  {key} failed: {exc}", file=sys.stderr, flush=True)
        else:
            return
        got = _summary(results)
        runs.setdefault(key, []).append(got)
        log.append({"config": key, "rep": rep, "results": results})
        sent = "" if got[1] is None else f", {got[1] / 2**20:.1f} MiB sent per host"
        print(f"  {key}: {got[0]:.3f} s{sent}", file=sys.stderr, flush=True)

    started = time.monotonic()
    with netns_cluster.cluster(max(*args.hosts, 2)) as c, netns_cluster.shaped(c, args.rate):
        env = dict(os.environ, OMP_NUM_THREADS="1", RINGFLOW_TRANSPORT="auto")
        me = [sys.executable, os.path.abspath(__file__), "--gloo-worker", "--master",
              c.addresses[0], "--interface", c.interface]
        ringflow = [sys.executable, WORKER, "--interface", c.interface, *common]
        two_by_two = {0: 2, 1: 2}
        tcp_env = dict(env, RINGFLOW_TRANSPORT="tcp")
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr, flush=True)
            for n in args.hosts:
                slots = dict.fromkeys(range(n), 1)
                record(f"ringflow/{n}", lambda s=slots: _job(c, s, ringflow, env, timeout))
                if not args.no_gloo:
                    record(f"gloo/{n}", lambda s=slots: _job(
                        c, s, [*me, "--port", str(random.randrange(20000, 60000)), *common],
                        env, timeout))
            record("hier", lambda: _job(c, two_by_two, ringflow, env, timeout))
            record("tcp", lambda: _job(c, two_by_two, ringflow, tcp_env, timeout))
    took = time.monotonic() - started

    mib = f"{args.mib} MiB"
    print(f"### {mib} float32 allreduce, namespace hosts, each link {args.rate} per direction "
          f"(tc tbf); median of {args.repeats} jobs x {args.iters} allreduces (min-max of the "
          f"job medians)\n")
    head = ["hosts", "ring bound s", "ringflow s", "ringflow: bound / time",
            "ringflow sent per host / 2(n-1)/n·S"]
    if not args.no_gloo:
        head += ["gloo s", "gloo: bound / time", "gloo time / ringflow time"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    fractions: dict[str, dict[str, float]] = {}
    for n in args.hosts:
        bound = 2 * (n - 1) / n * nbytes * 8 / bps
        if not runs.get(f"ringflow/{n}") or not (args.no_gloo or runs.get(f"gloo/{n}")):
            print(f"| {n} | {bound:.3f} | every job failed (see below) |")
            continue
        rf_t = [t for t, _ in runs[f"ringflow/{n}"]]
        rf_b = [b / (2 * (n - 1) / n * nbytes) for _, b in runs[f"ringflow/{n}"]]
        row = [str(n), f"{bound:.3f}", _med(rf_t), f"{bound / statistics.median(rf_t):.3f}",
               f"{statistics.median(rf_b):.3f}"]
        fractions[str(n)] = {"ringflow": bound / statistics.median(rf_t)}
        if not args.no_gloo:
            gl_t = [t for t, _ in runs[f"gloo/{n}"]]
            row += [_med(gl_t), f"{bound / statistics.median(gl_t):.3f}",
                    f"{statistics.median(gl_t) / statistics.median(rf_t):.2f}"]
            fractions[str(n)]["gloo"] = bound / statistics.median(gl_t)
        print("| " + " | ".join(row) + " |")
    # figures: per host count, the fraction of the ring bound each reached (median of jobs)
    records.append("multihost", {"mib": args.mib, "rate": args.rate, "hosts": fractions},
                   ["--hosts", *map(str, args.hosts), "--mib", str(args.mib), "--repeats",
                    str(args.repeats)])
    print(f"\nCeiling for TCP over MTU 1500: {CEILING:.3f} of the bound.\n")
    if args.plot:
        plot(args.plot, runs, args.hosts, nbytes, bps, args.rate)
    host_bound = 2 * (2 - 1) / 2 * nbytes
    rank_bound = 2 * (4 - 1) / 4 * nbytes
    print(f"### 2 hosts x 2 ranks, {mib}: bytes each host sent on its link per allreduce "
          f"(veth tx_bytes)\n")
    head = ["transport", "time s", "sent per host MiB", "/ host-level 2(H-1)/H·S",
            "/ rank-level 2(N-1)/N·S"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for key, name in (("hier", "hierarchical (auto)"), ("tcp", "RINGFLOW_TRANSPORT=tcp")):
        if not runs.get(key):
            print(f"| {name} | every job failed (see below) |")
            continue
        ts = [t for t, _ in runs[key]]
        sent = statistics.median(b for _, b in runs[key])
        print(f"| {name} | {_med(ts)} | {sent / 2**20:.2f} | {sent / host_bound:.3f} | "
              f"{sent / rank_bound:.3f} |")
    print(f"\nhost-level bound {host_bound / 2**20:.0f} MiB, rank-level bound "
          f"{rank_bound / 2**20:.0f} MiB per rank; whole run {took:.0f} s")
    for line in failures:
        print(f"failed job: {line.splitlines()[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jobs": log, "failures": failures}, f)
    return 0


def lossy(args: argparse.Namespace) -> int:
    """Section 3 of the module doc: ringflow against gloo on 2 hosts at each ``--loss``."""
    bps = parse_rate(args.rate)
    nbytes = args.mib << 20
    bound = nbytes * 8 / bps  # 2 (n-1)/n * S / R at n = 2
    worst = max(args.loss)
    timeout = 60 + 4 * 2 * bound * (args.warmup + args.iters) / max(1e-3, 1 - 20 * worst)
    common = ["--bytes", str(nbytes), "--iters", str(args.iters), "--warmup", str(args.warmup)]
    runs: dict[tuple[str, float], list[float]] = {}
    failures: list[str] = []
    started = time.monotonic()
    slots = {0: 1, 1: 1}
    with netns_cluster.cluster(2) as c, netns_cluster.shaped(c, args.rate):
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            cc = args.cc or f.read().strip()
        for ns in c.namespaces:
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                            f"net.ipv4.tcp_congestion_control={cc}"], check=True, timeout=20)
        env = dict(os.environ, OMP_NUM_THREADS="1", RINGFLOW_TRANSPORT="auto")
        gloo = [sys.executable, os.path.abspath(__file__), "--gloo-worker", "--master",
                c.addresses[0], "--interface", c.interface, *common]
        ringflow = [sys.executable, WORKER, "--interface", c.interface, *common]
        for rep in range(args.repeats):
            for loss in args.loss:
                with netns_cluster.impaired(c, (0, 1), loss=loss) as counts:
                    for peer in ("ringflow", "gloo"):
                        command = ringflow if peer == "ringflow" else [
                            *gloo, "--port", str(random.randrange(20000, 60000))]
                        try:
                            t, _ = _summary(_job(c, slots, command, env, timeout))
                        except RuntimeError as exc:
                            failures.append(f"{peer} loss {loss:g} repeat {rep + 1}: {exc}")
                            print(f"  {peer} at loss {loss:g} failed: {exc}", file=sys.stderr)
                            continue
                        runs.setdefault((peer, loss), []).append(t)
                        print(f"  repeat {rep + 1}, loss {loss:g}, {peer}: {t:.3f} s",
                              file=sys.stderr, flush=True)
                if loss:
                    print(f"  repeat {rep + 1}, loss {loss:g}, both jobs: {counts}",
                          file=sys.stderr, flush=True)
    took = time.monotonic() - started
    print(f"### {args.mib} MiB float32 allreduce, 2 namespace hosts x 1 rank, links {args.rate} "
          f"per direction (tc tbf), TCP congestion control {cc}, each host losing the given "
          "fraction of what it receives; "
          f"median of {args.repeats} jobs x {args.iters} allreduces (min-max of the job "
          "medians), ringflow and gloo alternating\n")
    head = ["loss", "bound s", "ringflow s", "ringflow: bound / time", "gloo s",
            "gloo: bound / time", "gloo time / ringflow time"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for loss in args.loss:
        rf_t, gl_t = runs.get(("ringflow", loss)), runs.get(("gloo", loss))
        if not rf_t or not gl_t:
            print(f"| {loss:g} | {bound:.3f} | every job of a peer failed (see below) |")
            continue
        print(f"| {loss:g} | {bound:.3f} | {_med(rf_t)} | {bound / statistics.median(rf_t):.3f} "
              f"| {_med(gl_t)} | {bound / statistics.median(gl_t):.3f} | "
              f"{statistics.median(gl_t) / statistics.median(rf_t):.2f} |")
    print(f"\nwhole run {took:.0f} s")
    for line in failures:
        print(f"failed job: {line.splitlines()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
