"""TCP transport behaviour that the collective suite does not pin down on its own."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ringflow import testing
from ringflow.transport import tcp

pytestmark = pytest.mark.timeout(60)


def test_a_send_written_in_full_survives_the_peers_goodbye(monkeypatch):
    """The sender thread has written every byte but not yet marked the send done; the peer, having
    received everything, says goodbye and closes. The send must still succeed."""
    push = tcp._Peer._push

    def slow_push(self, bufs, flags):
        left = push(self, bufs, flags)
        if flags == 0:  # the sender thread: written, not yet marked done; widen that window
            time.sleep(0.5)
        return left

    monkeypatch.setattr(tcp._Peer, "_push", slow_push)

    def body(t):
        buf = np.zeros(16 << 20, np.uint8)  # larger than a socket buffer: the sender thread sends
        if t.rank == 0:
            t.isend(memoryview(buf), 1).wait()
        else:
            t.irecv(memoryview(buf), 0).wait()
        return "ok"

    assert testing.run_ranks(2, body, transport="tcp", deadline=20) == ["ok", "ok"]
