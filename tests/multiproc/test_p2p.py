"""Point-to-point send/recv through ``ringflow-run``: every dtype and length in a ring, unexpected
messages, FIFO per tag, errors on both ranks, peers that die or leave, and the coordinator that
sees nothing of it.

Each test launches one scenario of ``engine_workers/p2p_worker.py``; every rank checks what it
received in closed form and writes what it saw to ``<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(180)

ROOT = Path(ringflow.__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "engine_workers" / "p2p_worker.py")


def launch(scenario: str, n: int, out: Path, timeout: float = 150, ok: bool = True,
           env: dict[str, str] | None = None) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` on ``n`` ranks (with ``ok``, it must exit 0); return each reporting
    rank's JSON, by rank."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(n), sys.executable, WORKER,
          scenario, str(out)]],
        env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})}, timeout=timeout,
        check=ok, merge_stderr=False)
    return {data["rank"]: data for data in
            (json.loads(p.read_text()) for p in out.glob("*.json"))}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_exchange_of_every_dtype_and_length(tmp_path: Path, n: int) -> None:
    results = launch("ring", n, tmp_path)
    assert sorted(results) == list(range(n))
    for res in results.values():
        assert res["count"] == 11 * 4 * 4, res["count"]  # dtypes x lengths x tags
        # Point to point never goes through the coordinator.
        assert res["stats"]["requests_sent"] == 0 and res["stats"]["collectives"] == 0


def test_messages_sent_before_the_receive_wait_for_it_in_order(tmp_path: Path) -> None:
    results = launch("unexpected", 3, tmp_path)
    assert results[1]["arrived"] == 11  # all of them, before any receive was posted
    assert results[1]["got"] == [2, 1, 12, 22, 11, 21, 31, 32, 42, 41]  # in order per tag


def test_messages_of_one_tag_are_received_in_the_order_sent(tmp_path: Path) -> None:
    results = launch("fifo", 2, tmp_path)
    assert results[1]["got"] == 200


def test_errors_reach_both_ranks_with_one_text(tmp_path: Path) -> None:
    results = launch("errors", 3, tmp_path)
    for case, fragment in [("size_shape", "rank 1 expected 4 elements of any dtype (shape (4,))"),
                           ("size_out", "rank 1 expected 6 elements of float32 (shape (6,))"),
                           ("dtype", "rank 1 expected any number of elements of float64"),
                           ("dtype_out", "rank 1 expected 5 elements of int32")]:
        assert results[0][case] == results[1][case], (case, results[0][case], results[1][case])
        error = results[0][case]
        assert error["type"] == "MismatchError", error
        assert "rank 0 sent 5 elements of float32 (shape (5,))" in error["text"], error
        assert fragment in error["text"], error
        assert "from rank 0 to rank 1" in error["text"] and "out=, shape= and dtype=" in error[
            "text"], error
    assert results[0]["bad_dtype"] == results[1]["bad_dtype"]
    assert results[0]["bad_dtype"]["type"] == "TensorError"
    assert "complex128, which ringflow cannot" in results[0]["bad_dtype"]["text"]
    for r, res in results.items():
        n = len(results)
        assert res["dst_self"]["type"] == "TensorError", res["dst_self"]
        assert res["dst_self"]["text"] == (f"dst rank {r} is not another rank of this job: "
                                           f"expected 0 <= dst < {n} and dst != {r} (this rank)")
        assert f"dst rank {n} is not another rank" in res["dst_range"]["text"]
        assert "dst rank -1 is not another rank" in res["dst_negative"]["text"]
        assert f"src rank {r} is not another rank" in res["src_self"]["text"]
        assert f"src rank {n + 3} is not another rank" in res["src_range"]["text"]
        assert "tag must be an int, got str" in res["tag_type"]["text"]
        assert "out must be a writable, C-contiguous numpy array, got list" in res["out_type"][
            "text"]
        assert "out has 3 elements but shape=(4,) has 4" in res["out_shape"]["text"]


def test_the_coordinator_sees_nothing_of_an_exchange_between_two_ranks(tmp_path: Path) -> None:
    results = launch("quiet", 3, tmp_path)
    assert all(v == 0 for v in results[0]["delta"].values()), results[0]["delta"]
    for r in (1, 2):
        delta, after = results[r]["delta"], results[r]["after"]
        assert after["p2p_sent"] == 20 and after["p2p_received"] == 20, after
        assert delta["requests_sent"] == delta["bits_sent"] == delta["collectives"] == 0, delta


def test_a_dead_peer_fails_pending_sends_and_receives(tmp_path: Path) -> None:
    results = launch("peer_death", 3, tmp_path, ok=False)
    assert sorted(results) == [0, 1, 2] and results[2]["exited"]
    for r in (0, 1):
        pending = results[r]["pending"]
        assert pending["type"] == "PeerError" and "rank 2" in pending["text"], pending
        assert pending["elapsed"] < 5, pending
        later = results[r]["later"]  # the job's error, raised at the call
        assert later["type"] == "PeerError" and "rank 2" in later["text"], later


def test_a_peer_that_shuts_down_fails_pending_receives_from_it(tmp_path: Path) -> None:
    results = launch("shutdown_peer", 2, tmp_path)
    pending = results[0]["pending"]
    assert pending["type"] == "ShutdownError" and "rank 1 has shut down" in pending["text"]


def test_point_to_point_outlives_the_coordinators_shutdown(tmp_path: Path) -> None:
    results = launch("coordinator_leaves", 3, tmp_path, env={"RINGFLOW_TIMEOUT_S": "2"})
    for r in (1, 2):
        assert results[r]["got"] == [10 * (3 - r) + i for i in range(5)]
        collective = results[r]["collective"]
        assert collective["type"] == "ShutdownError", collective
        assert "rank 0 left the job (it called shutdown())" in collective["text"], collective
