"""A userspace ``netem``: delay, jitter, reordering and loss of one host's outgoing packets.

    ip netns exec NS python netem.py --queue Q [--delay-ms D] [--jitter-ms J] [--reorder P]
                                      [--loss P] [--seed S]

Linux's ``tc qdisc ... netem`` is the usual tool, but kernels built without
``CONFIG_NET_SCH_NETEM`` (this project's machines) have no such qdisc. The same effects come
from netfilter's queue instead: an ``iptables -j NFQUEUE --queue-num Q`` rule hands every
matching packet to this process, which gives each one its verdict -- accept after a delay, or
drop -- over a netlink socket (``nfnetlink_queue``, ``CONFIG_NETFILTER_NETLINK_QUEUE``). The
protocol is small enough to speak directly (``linux/netfilter/nfnetlink_queue.h``): bind the
queue, ask for metadata only (the packet's id; no payload is copied), then send one verdict per
id. Run it in the namespace whose packets are queued (netlink is per network namespace).

Per packet, as netem does on an interface's egress:

* with probability ``--loss``: dropped;
* else with probability ``--reorder``: sent at once (ahead of the packets still held);
* else held ``--delay-ms`` plus a uniform draw in ``[-J, +J]`` (``--jitter-ms``, floored at 0),
  so that with jitter packets also leave out of order, as under netem's ``delay D J``.

The kernel segments TCP's large (GSO) packets before they are queued, so every decision is per
wire packet. Throughput is bounded by Python (about 10 MiB/s here): this is for correctness
under delay and reordering, not for rates; random loss at line rate uses the kernel's own
``-m statistic`` match instead (:func:`netns_cluster.lossy`). On SIGTERM it exits 0 after
writing ``queued=N dropped=N`` to stderr; the queue rule must be removed first (without a
listener, queued packets are dropped).
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
_SUBSYS_QUEUE = 3 << 8
_MSG_PACKET, _MSG_VERDICT, _MSG_CONFIG = 0, 1, 2
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_ERROR = 2
_CFG_CMD, _CFG_PARAMS, _CFG_QUEUE_MAXLEN = 1, 2, 3
_CMD_BIND = 1
_COPY_META = 1
_PACKET_HDR, _VERDICT_HDR = 1, 2
_NF_DROP, _NF_ACCEPT = 0, 1
_HDR = struct.Struct("=IHHII")  # struct nlmsghdr
_ATTR = struct.Struct("=HH")  # struct nlattr


def _attr(kind: int, payload: bytes) -> bytes:
    size = _ATTR.size + len(payload)
    return _ATTR.pack(size, kind) + payload + b"\0" * (-size % 4)


def _message(kind: int, queue: int, attrs: list[bytes], flags: int = _NLM_F_REQUEST) -> bytes:
    # struct nfgenmsg: family, version (NFNETLINK_V0), the queue number in network order
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue) + b"".join(attrs)
    return _HDR.pack(_HDR.size + len(body), _SUBSYS_QUEUE | kind, flags, 0, 0) + body


class Queue:
    """One bound ``nfnetlink_queue``: the ids of queued packets in, verdicts out."""

    def __init__(self, number: int, maxlen: int = 100_000) -> None:
        self.number = number
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self._config(_attr(_CFG_CMD, struct.pack("!BBH", _CMD_BIND, 0, 0)))
        self._config(_attr(_CFG_PARAMS, struct.pack("!IB", 0, _COPY_META)))
        self._config(_attr(_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen)))

    def _config(self, attr: bytes) -> None:
        self.sock.send(_message(_MSG_CONFIG, self.number, [attr], _NLM_F_REQUEST | _NLM_F_ACK))
        while True:
            data = self.sock.recv(65536)
            _, kind, _, _, _ = _HDR.unpack_from(data)
            if kind == _NLMSG_ERROR:
                (err,) = struct.unpack_from("=i", data, _HDR.size)
                if err:
                    raise OSError(-err, f"nfnetlink_queue configuration: {os.strerror(-err)}")
                return

    def ids(self) -> list[int]:
        """The ids of the packets queued since the last call (never blocks)."""
        out = []
        while True:
            try:
                data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return out
            off = 0
            while off + _HDR.size <= len(data):
                size, kind, _, _, _ = _HDR.unpack_from(data, off)
                if kind == _SUBSYS_QUEUE | _MSG_PACKET:
                    at = off + _HDR.size + 4  # after struct nfgenmsg
                    while at + _ATTR.size <= off + size:
                        alen, akind = _ATTR.unpack_from(data, at)
                        if akind & 0x7FFF == _PACKET_HDR:
                            out.append(struct.unpack_from("!I", data, at + _ATTR.size)[0])
                        at += max(4, (alen + 3) & ~3)
                off += max(_HDR.size, (size + 3) & ~3)

    def verdict(self, packet_id: int, accept: bool) -> None:
        hdr = struct.pack("!II", _NF_ACCEPT if accept else _NF_DROP, packet_id)
        self.sock.send(_message(_MSG_VERDICT, self.number, [_attr(_VERDICT_HDR, hdr)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--reorder", type=float, default=0.0)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    queue = Queue(args.queue)
    counts = {"queued": 0, "dropped": 0}

    def stop(_signum: int, _frame: object) -> None:
        sys.stderr.write(" ".join(f"{k}={v}" for k, v in counts.items()) + "\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    held: list[tuple[float, int, int]] = []  # (due, arrival order, id)
    order = 0
    delay, jitter = args.delay_ms / 1e3, args.jitter_ms / 1e3
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else 1.0
        ready, _, _ = select.select([queue.sock], [], [], wait)
        now = time.monotonic()
        for packet in queue.ids() if ready else ():
            counts["queued"] += 1
            if rng.random() < args.loss:
                counts["dropped"] += 1
                queue.verdict(packet, False)
            elif rng.random() < args.reorder:
                queue.verdict(packet, True)
            else:
                order += 1
                due = now + max(0.0, delay + rng.uniform(-jitter, jitter))
                heapq.heappush(held, (due, order, packet))
        while held and held[0][0] <= now:
            queue.verdict(heapq.heappop(held)[2], True)


if __name__ == "__main__":
    sys.exit(main())
