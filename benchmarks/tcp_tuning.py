"""Sweep of the TCP ring's knobs on loopback: pipeline chunk, socket buffers, send path.

    python benchmarks/tcp_tuning.py                        # every sweep, 2 and 4 ranks, 3 repeats
    python benchmarks/tcp_tuning.py --sweep chunk --chunk-kib 1024 2048 4096 --max-mib 256

Each variant runs the engine path of ``benchmarks/allreduce_peers.py`` (``ringflow-run``, float32
SUM, median per size) with ``RINGFLOW_TRANSPORT=tcp``, so that every byte goes through
``ringflow.transport.tcp`` even on one host. A variant changes one knob from the defaults by
patching the module in the worker before ``ringflow.init()``:

- ``chunk``: ``ringflow.algorithms.buffers.CHUNK_BYTES`` (the ring's pipeline message size);
- ``buf``: ``SO_SNDBUF``/``SO_RCVBUF`` set in ``tcp._tune`` (0: the kernel's autotuning; an
  explicit size turns autotuning off and is capped by ``net.core.wmem_max``/``rmem_max``);
- ``send``: ``dontwait`` (the shipped path: a non-blocking ``sendmsg`` from the caller, the rest on
  the peer's sender thread), ``thread`` (every send handed to the sender thread, blocking
  ``sendmsg``), ``sendall`` (sender thread, ``sendall`` of the header then of the payload).

``--transport auto`` runs the same sweep on the shared-memory path instead (the chunk is also the
block of its reduce loop). A run that fails is reported on stderr and left out of the medians.

Repeats are interleaved (every variant once, then again) so that load from other processes on a
shared machine spreads over all variants; the table gives the median of the per-run medians and
the spread (min-max) across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
DEFAULT = {"chunk": 1 << 20, "buf": 0, "send": "dontwait"}
SWEEPS = {
    "chunk": [{"chunk": c} for c in (256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)],
    "buf": [{"buf": b} for b in (0, 256 << 10, 1 << 20, 4 << 20)],
    "send": [{"send": s} for s in ("dontwait", "thread", "sendall")],
}


def _patch(variant: dict[str, object]) -> None:
    """Apply ``variant`` to the ringflow modules of this (worker) process."""
    from ringflow.algorithms import buffers
    from ringflow.transport import tcp

    buffers.CHUNK_BYTES = int(variant["chunk"])
    size = int(variant["buf"])
    if size:
        def tune(sock: socket.socket, _orig=tcp._tune) -> None:
            _orig(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)

        tcp._tune = tune
    if variant["send"] == "dontwait":
        return
    peer = tcp._Peer

    def send(self, tag, payload, work):  # every send on the sender thread
        bufs = [memoryview(tcp._HDR.pack(tag, payload.nbytes)), payload]
        with self._send_ready:
            if self.error is not None:
                raise self.error
            self._sends.append((bufs, work))
            self._send_ready.notify()

    peer.send = send
    if variant["send"] == "sendall":
        def push(self, bufs, flags):
            for b in bufs:
                self.sock.sendall(b)
            return []

        peer._push = push


def _run(variant: dict[str, object], n: int, sizes: list[int], timeout: float,
         transport: str = "tcp"):
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(n), sys.executable,
               os.path.abspath(__file__), "--worker", json.dumps(variant), "--result", result,
               "--sizes", ",".join(map(str, sizes))]
        env = dict(os.environ, OMP_NUM_THREADS="1", RINGFLOW_TRANSPORT=transport)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=timeout, check=False)
        if proc.returncode or not os.path.exists(result):
            print(f"  {variant} np={n} failed ({proc.returncode}): {proc.stderr[:1500]}",
                  file=sys.stderr)
            return None
        with open(result) as f:
            return json.load(f)


def _label(variant: dict[str, object], sweep: str) -> str:
    v = variant[sweep]
    if sweep == "send":
        return str(v)
    if sweep == "buf" and not v:
        return "auto"
    return f"{int(v) >> 10} KiB" if int(v) < 1 << 20 else f"{int(v) >> 20} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--sweep", nargs="+", default=list(SWEEPS), choices=list(SWEEPS))
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-mib", type=int, default=64, help="largest buffer, MiB (up to 256)")
    ap.add_argument("--chunk-kib", type=int, nargs="+", default=[],
                    help="the chunk sweep's values in KiB (default 256 .. 8192)")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "auto"],
                    help="RINGFLOW_TRANSPORT of the runs (auto: shared memory on one host)")
    ap.add_argument("--raw", default="", help="append every run's figures to this JSONL file")
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    import allreduce_peers

    if args.worker:
        _patch(json.loads(args.worker))
        allreduce_peers.worker("ringflow", [int(s) for s in args.sizes.split(",")], args.result)
        return
    sizes = [s for s in SIZES if s <= args.max_mib << 20]
    if args.chunk_kib:
        SWEEPS["chunk"] = [{"chunk": k << 10} for k in args.chunk_kib]
    runs: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for rep in range(args.repeats):
        for sweep in args.sweep:
            for change in SWEEPS[sweep]:
                variant = {**DEFAULT, **change}
                for n in args.np:
                    print(f"rep {rep + 1}/{args.repeats}: {sweep}={_label(variant, sweep)} "
                          f"np={n}", file=sys.stderr, flush=True)
                    got = _run(variant, n, sizes, 600, args.transport)
                    if got is None:
                        continue
                    runs.setdefault((sweep, _label(variant, sweep), n), []).append(got)
                    if args.raw:
                        with open(args.raw, "a") as f:
                            f.write(json.dumps({"variant": variant, "np": n, "rep": rep,
                                                "transport": args.transport, "times": got})
                                    + "\n")
    for sweep in args.sweep:
        for n in args.np:
            head = ["value"] + [allreduce_peers._fmt_size(s) + " ms (min-max)" for s in sizes]
            print(f"\n### {sweep}, {n} ranks, RINGFLOW_TRANSPORT={args.transport}, median of "
                  f"{args.repeats} runs\n")
            print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
            for change in SWEEPS[sweep]:
                label = _label({**DEFAULT, **change}, sweep)
                got = runs.get((sweep, label, n), [])
                row = [label]
                for s in sizes:
                    ts = [g[str(s)] * 1e3 for g in got]
                    row.append(f"{statistics.median(ts):.1f} ({min(ts):.1f}-{max(ts):.1f})"
                               if ts else "-")
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
