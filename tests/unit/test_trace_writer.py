"""Rank 0's timeline writer on its own: when it may close the file."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ringflow.messages import ClockReply, TraceEvents
from ringflow.timeline import TraceWriter

pytestmark = pytest.mark.timeout(60)


def test_close_waits_for_a_rank_not_heard_from_and_for_a_recording_ranks_last_records(
        tmp_path) -> None:
    # Rank 2 started recording before rank 0 did, so its announcement reached nobody: rank 0
    # learns it only from its answer to the first probe, and must not close the file before.
    sent: list = []
    path = tmp_path / "trace.json"
    writer = TraceWriter(str(path), 3, lambda dst, msg: sent.append((dst, msg)))
    probes = {dst: msg for dst, msg in sent}
    writer.on_message(1, ClockReply(probes[1].t, probes[1].t, False))  # rank 1: not recording
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (writer.close(30.0), closed.set()))
    closer.start()
    assert not closed.wait(0.3), "closed before rank 2 answered"
    writer.on_message(2, ClockReply(probes[2].t, probes[2].t, True))
    assert not closed.wait(0.3), "closed before rank 2's last records"
    now = time.perf_counter()
    record = (0, "traced", "allreduce", now, now, now, now + 1e-4, 1, "")
    writer.on_message(2, TraceEvents([record], True))
    assert closed.wait(10)
    closer.join()
    events = json.loads(path.read_text())
    assert {e["pid"] for e in events if e["name"] == "ALLREDUCE"} == {2}
