"""Malformed input at every listening port of a running job (issue 18).

A job of 3 ranks under ``ringflow-run`` (``fuzz_worker.py``) runs exact collectives while a
fuzzer in this test sends malformed input to every port the job listens on, found in ``/proc``
(the sockets in LISTEN state owned by the launcher or one of its descendants):

* the launcher's rendezvous store, before ``init()`` (the ranks wait for a go-file), during it,
  while the job runs, and between and after its two rounds;
* each rank's data listener, which exists only during ``init()``: in round 1 rank 1 starts late,
  so ranks 0 and 2 listen for it meanwhile; in round 2 rank 0 starts late (ranks 1 and 2).

Kinds of input: random bytes, truncated frames and handshakes, huge length fields, HTTP
requests, handshakes and frames built with :mod:`ringflow.wire`'s own code with a wrong or an
empty secret (store requests, the transport's rank and control frames), replayed and bit-mutated
copies of those, and pickles whose ``__reduce__`` would create a marker file. Several frames go
over one connection until the server closes it; idle connections are held open meanwhile.

Asserted: every process exits 0, nothing hangs (deadlines), every result is exact, the marker
never appears, the launcher's and every rank's RSS grow by less than 20 MB, and the late rank's
``init()`` is not held up by idle or garbage connections (a loose bound: below the 10 s a
connection that never speaks may hold a handshake). Figures are printed, with a run of the same
job without fuzzing for comparison.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import pickle
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from faults_harness import alive, env

from ringflow import wire
from ringflow.errors import RingflowError

pytestmark = [pytest.mark.timeout(420),
              pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc")]

WORKER = str(Path(__file__).resolve().parent / "fuzz_worker.py")
FRAMES = 10_000
ROUNDS, ITERATIONS, N = 2, 40, 3
LATE = {1: 1, 2: 0}  # round -> the rank that starts late (the others' listeners wait for it)
# Of FRAMES: the share sent before the first init() and to the data listeners of each round.
BEFORE_INIT, PER_LISTENER_WINDOW = 0.25, 0.1
LISTENER_WINDOW_S = 8.0  # under timeout_s (30 s): the early ranks wait this long for the late one
MB = 1 << 20
HELLO = 4 + 32
HEAD = struct.Struct("!BdqI")  # a store request's head (ringflow.rendezvous.tcp)
CTRL_HDR = struct.Struct("!BQ")  # the TCP transport's frame header (tag, length)


# -- finding the job's listening ports --------------------------------------------------------

def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def listening(pids: list[int]) -> dict[int, int]:
    """port -> pid for the IPv4 sockets in LISTEN state that ``pids`` hold."""
    inodes: dict[str, int] = {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                inodes[fields[9]] = int(fields[1].split(":")[1], 16)
    ports = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        ports[inodes[link[8:-1]]] = pid
    return ports


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# -- the input ----------------------------------------------------------------------------------

class Marker:
    """Unpickled, it would create the marker file."""

    def __init__(self, path: Path, how: str) -> None:
        self.path, self.how = path, how

    def __reduce__(self) -> tuple[Any, ...]:
        if self.how == "open":
            return (builtins.open, (str(self.path), "w"))
        return (os.system, (f"touch {self.path}",))


class Recorder:
    """A socket that keeps a copy of what is sent through it (for replays)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sent = sock, bytearray()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)

    def sendall(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)

    def sendmsg(self, bufs: list[memoryview]) -> int:
        data = b"".join(bytes(b) for b in bufs)
        self.sent += data
        self.sock.sendall(data)
        return len(data)


def store_request(rng: random.Random) -> bytes:
    op = rng.choice([1, 2, 3, 4, 5, 99])
    key = rng.choice([b"init1/tcp/0", b"init1/layout/1", b"user/x", b"failure/0"])
    value = rng.randbytes(rng.randrange(0, 64)) if op == 1 else b""
    return HEAD.pack(op, 1.0, 1, 1) + struct.pack("!I", len(key)) + key + value


class Fuzzer:
    """Connections to the job's ports, each carrying one kind of malformed input."""

    KINDS = ("random", "truncated", "huge_length", "http", "wrong_secret", "no_secret",
             "replay", "mutated", "pickle")

    def __init__(self, marker: Path, seed: int = 18) -> None:
        self.rng = random.Random(seed)
        self.marker = marker
        self.frames: Counter[str] = Counter()
        self.targets: Counter[str] = Counter()  # frames per port: "store", "rank 0", ...
        self.connections = 0
        self.closed_by_server = 0
        self.refused = 0
        self.captured: list[bytes] = []  # well-formed (wrong-secret) conversations, for replays
        self.idle: list[socket.socket] = []
        self.lock = threading.Lock()  # the store's fuzzing thread and the test's share this

    def count(self, kind: str = "", connections: int = 0, closed: int = 0,
              refused: int = 0, target: str = "") -> None:
        with self.lock:
            if kind:
                self.frames[kind] += 1
                self.targets[target] += 1
            self.connections += connections
            self.closed_by_server += closed
            self.refused += refused

    @property
    def total(self) -> int:
        return sum(self.frames.values())

    @property
    def data_frames(self) -> int:
        """Frames sent to the ranks' data listeners."""
        return self.total - self.targets["store"]

    def pickles(self) -> list[bytes]:
        return [pickle.dumps(Marker(self.marker, how), protocol=p)
                for how in ("open", "system") for p in (2, pickle.HIGHEST_PROTOCOL)]

    def frames_for(self, kind: str, sock: socket.socket, target: str) -> list[bytes]:
        """The frames of one connection (``sock`` is connected; the hello may be unread)."""
        rng = self.rng
        count = rng.randrange(2, 9)
        if kind == "random":
            return [rng.randbytes(rng.randrange(1, 2048)) for _ in range(count)]
        if kind == "truncated":
            size = rng.randrange(64, 4096)
            return [struct.pack("!Q", size) + rng.randbytes(rng.randrange(0, size // 2)),
                    rng.randbytes(rng.randrange(1, 63))]  # a handshake cut short
        if kind == "huge_length":
            return [rng.choice([struct.pack("!Q", 2**63 - 1), struct.pack("!Q", 2**62),
                                CTRL_HDR.pack(2, 2**62), CTRL_HDR.pack(1, 2**40),
                                struct.pack("!Q", 2**32 + 7)]) for _ in range(count)]
        if kind == "http":
            return [b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                    b"POST /store HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"][: count]
        if kind in ("wrong_secret", "no_secret"):
            secret = wire.new_secret() if kind == "wrong_secret" else b""
            rec = Recorder(sock)
            with contextlib.suppress(OSError, RingflowError):
                wire.client_handshake(rec, secret, 2.0)  # type: ignore[arg-type]
            self.count(kind, target=target)  # the handshake itself
            frames = []
            for _ in range(count - 1):
                choice = rng.randrange(4)
                if choice == 0:
                    body = store_request(rng)
                elif choice == 1:
                    body = struct.pack("!Q", rng.randrange(0, N + 3))  # a rank, as a dialer sends
                    frames.append(body)
                    continue
                elif choice == 2:
                    body = rng.randbytes(rng.randrange(0, 256))
                else:
                    frames.append(CTRL_HDR.pack(2, 40) + rng.randbytes(40))
                    continue
                frames.append(struct.pack("!Q", len(body)) + body)  # wire.send_frame's framing
            self.captured.append(bytes(rec.sent) + b"".join(frames))
            del self.captured[:-64]
            return frames
        if kind in ("replay", "mutated"):
            data = bytearray(rng.choice(self.captured)) if self.captured else bytearray(64)
            if kind == "mutated":
                for _ in range(rng.randrange(1, 9)):
                    i = rng.randrange(len(data))
                    data[i] ^= 1 << rng.randrange(8)
            return [bytes(data[i:i + 64]) for i in range(0, len(data), 64)]
        # pickle: raw, framed as a store frame, and as a transport control frame
        frames = []
        for blob in self.pickles():
            frames += [blob, struct.pack("!Q", len(blob)) + blob,
                       CTRL_HDR.pack(2, len(blob)) + blob]
        return frames[:count]

    def one(self, port: int, target: str) -> None:
        kind = self.rng.choice(self.KINDS)
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=2.0)
        except OSError:
            self.count(refused=1)  # the listener closed (a data listener after init)
            return
        self.count(connections=1)
        try:
            sock.settimeout(2.0)
            if self.rng.random() < 0.5 and kind not in ("wrong_secret", "no_secret"):
                sock.recv(HELLO, socket.MSG_WAITALL)
            for frame in self.frames_for(kind, sock, target):
                if self.server_closed(sock):
                    break
                sock.sendall(frame)
                self.count(kind, target=target)
            if self.server_closed(sock, wait=0.05):
                self.count(closed=1)
        except OSError:
            self.count(closed=1)  # reset by the server mid-frame
        finally:
            sock.close()

    @staticmethod
    def server_closed(sock: socket.socket, wait: float = 0.0) -> bool:
        sock.settimeout(wait or None)
        try:
            if wait == 0.0:
                sock.setblocking(False)
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    return True
        except (BlockingIOError, TimeoutError):
            return False
        except OSError:
            return True
        finally:
            sock.settimeout(2.0)

    def hold_idle(self, port: int, count: int) -> None:
        """Connections that never speak (one stops half-way through its handshake)."""
        for i in range(count):
            with contextlib.suppress(OSError):
                sock = socket.create_connection(("127.0.0.1", port), timeout=2.0)
                if i == 0:
                    sock.sendall(b"\x01" * 20)
                self.idle.append(sock)
                self.count(connections=1)

    def close_idle(self) -> None:
        for sock in self.idle:
            sock.close()
        self.idle.clear()


# -- the job ------------------------------------------------------------------------------------

class Job:
    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True)
        self.out = out
        self.log = open(out / "launcher.log", "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(N), "--transport", "shm",
               sys.executable, WORKER, str(out), str(ROUNDS), str(ITERATIONS)]
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env(RINGFLOW_TIMEOUT_S="30"), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pids: set[int] = {self.proc.pid}
        self.workers = {r: int(self.wait_for(f"pid.{r}").read_text()) for r in range(N)}
        self.pids.update(descendants(self.proc.pid))
        self.store = self.ports()
        assert list(self.store.values()) == [self.proc.pid], self.store

    def wait_for(self, name: str, deadline: float = 120.0) -> Path:
        path = self.out / name
        end = time.monotonic() + deadline
        while not path.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended early ({self.proc.returncode}):\n{self.output()}")
            if time.monotonic() > end:
                pytest.fail(f"{name} did not appear within {deadline} s:\n{self.output()}")
            time.sleep(0.005)
        return path

    def ports(self) -> dict[int, int]:
        tree = descendants(self.proc.pid)
        self.pids.update(tree)
        return listening(tree)

    def go(self, k: int, ranks: list[int]) -> None:
        for r in ranks:
            (self.out / f"go.{k}.{r}").write_text("")

    def output(self) -> str:
        self.log.flush()
        return (self.out / "launcher.log").read_text()[-5000:]

    def finish(self, timeout: float = 120.0) -> tuple[int, dict[int, dict[str, Any]], float]:
        (self.out / "exit").write_text("")
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {timeout} s:\n{self.output()}")
        wall = time.monotonic() - self.start
        results = {}
        for r in range(N):
            path = self.out / f"{r}.json"
            if path.exists():
                results[r] = json.loads(path.read_text())
        return rc, results, wall

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the supervisors then stop the ranks
            self.proc.wait(30)
        self.log.close()


def run(out: Path, fuzzer: Fuzzer | None) -> dict[str, Any]:
    """The job, fuzzed (``fuzzer``) or not; its figures."""
    job = Job(out)
    figures: dict[str, Any] = {"window_frames": {}}
    try:
        store = next(iter(job.store))
        rss0 = rss_kb(job.proc.pid)
        stop = threading.Event()
        fuzz_store = None
        if fuzzer is not None:
            fuzzer.hold_idle(store, 40)
            while fuzzer.total < FRAMES * BEFORE_INIT:  # before any init(): only the store
                fuzzer.one(store, "store")

            def background() -> None:  # the store, all the time the job runs
                while not stop.is_set():
                    fuzzer.one(store, "store")

            fuzz_store = threading.Thread(target=background, daemon=True)
            fuzz_store.start()  # before the first init(): the ranks connect to it under fire
        for k in range(1, ROUNDS + 1):
            late = LATE[k]
            early = [r for r in range(N) if r != late]
            job.go(k, early)
            # The early ranks' data listeners appear and wait for the late rank.
            data: dict[int, int] = {}
            end = time.monotonic() + 30
            while len(data) < len(early) and time.monotonic() < end:
                data = {p: pid for p, pid in job.ports().items() if pid != job.proc.pid}
                time.sleep(0.002)
            assert len(data) == len(early), f"round {k}: data listeners {data}"
            if fuzzer is not None:
                before = fuzzer.data_frames
                rank_of = {pid: r for r, pid in job.workers.items()}
                for port in data:
                    fuzzer.hold_idle(port, 10)
                end = time.monotonic() + LISTENER_WINDOW_S
                while (fuzzer.data_frames - before < FRAMES * PER_LISTENER_WINDOW
                       and time.monotonic() < end):
                    for port, pid in data.items():
                        fuzzer.one(port, f"rank {rank_of[pid]}")
                figures["window_frames"][k] = fuzzer.data_frames - before
            else:
                time.sleep(0.2)
            job.go(k, [late])
            # The late rank's own listener: fuzzed while it is there (it may be gone at once);
            # done once no rank listens any more (every data connection is made).
            end = time.monotonic() + 5
            while fuzzer is not None and time.monotonic() < end:
                ports = job.ports()
                for port in [p for p, pid in ports.items() if pid == job.workers[late]]:
                    fuzzer.one(port, f"rank {late} (late)")
                if all(pid == job.proc.pid for pid in ports.values()):
                    break
        job.wait_for(f"{N - 1}.json", 240)
        for r in range(N):
            job.wait_for(f"{r}.json", 60)
        stop.set()
        if fuzz_store is not None:
            fuzz_store.join(30)
            while fuzzer.total < FRAMES:  # top up, on the store the job still holds
                fuzzer.one(store, "store")
            fuzzer.close_idle()
        figures["launcher_rss_kb"] = (rss0, rss_kb(job.proc.pid))
        figures["rc"], figures["results"], figures["wall"] = job.finish()
        figures["output"] = job.output()
    finally:
        job.kill()
    figures["left"] = alive(sorted(job.pids))
    return figures


def test_malformed_frames_at_every_port(tmp_path):
    marker = tmp_path / "marker-must-never-appear"
    base = run(tmp_path / "baseline", None)
    assert base["rc"] == 0, base["output"]
    fuzzer = Fuzzer(marker)
    start = time.monotonic()
    fuzzed = run(tmp_path / "fuzzed", fuzzer)
    took = time.monotonic() - start

    print(f"\n{fuzzer.total} malformed frames in {took:.1f} s over {fuzzer.connections} "
          f"connections ({fuzzer.closed_by_server} closed by the server, {fuzzer.refused} "
          f"refused: a data listener gone after init): "
          + ", ".join(f"{k} {v}" for k, v in sorted(fuzzer.frames.items())))
    print("frames per port: " + ", ".join(f"{t} {v}" for t, v in sorted(fuzzer.targets.items()))
          + f"; at the data listeners while they waited for the late rank, by round: "
          f"{fuzzed['window_frames']}")
    for name, figs in (("without fuzzing", base), ("fuzzed", fuzzed)):
        res = figs["results"]
        a, b = figs["launcher_rss_kb"]
        print(f"{name}: job {figs['wall']:.1f} s (paced by the test); late rank's init() "
              + ", ".join(f"round {k} {res[LATE[k]]['init_s'][k - 1]:.2f} s"
                          for k in range(1, ROUNDS + 1))
              + "; loops " + ", ".join(f"{max(res[r]['loop_s'][k] for r in res):.2f} s"
                                       for k in range(ROUNDS))
              + f"; RSS growth: launcher {(b - a) / 1024:+.1f} MiB, ranks "
              + ", ".join(f"{(res[r]['rss_end_kb'] - res[r]['rss_warm_kb']) / 1024:+.1f}"
                          for r in sorted(res)) + " MiB")
    lines = fuzzed["output"].count("\n")
    print(f"launcher output of the fuzzed job: {lines} lines")

    assert fuzzed["rc"] == 0, fuzzed["output"]
    assert fuzzer.total >= FRAMES
    assert all(fuzzer.targets[f"rank {r}"] for r in range(N)), fuzzer.targets
    assert not marker.exists(), "a pickle sent by the fuzzer was unpickled"
    assert sorted(fuzzed["results"]) == list(range(N))
    for r, res in fuzzed["results"].items():
        assert not res["mismatches"], f"rank {r}: {res['mismatches'][:5]}"
        assert res["steps"] == ROUNDS * ITERATIONS
        assert (res["rss_end_kb"] - res["rss_warm_kb"]) * 1024 < 20 * MB, f"rank {r}: {res}"
        for k in range(1, ROUNDS + 1):
            if r == LATE[k]:  # connections that never speak hold no handshake up
                assert res["init_s"][k - 1] < 10.0, f"round {k}: rank {r} {res['init_s']}"
    a, b = fuzzed["launcher_rss_kb"]
    assert (b - a) * 1024 < 20 * MB
    assert not base["left"] and not fuzzed["left"], (base["left"], fuzzed["left"])
