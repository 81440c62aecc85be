"""A rank killed (SIGKILL) or frozen (SIGSTOP) at a chosen point of the protocol, through the fault
hook (``RINGFLOW_FAULT``, :mod:`ringflow.injection`), in a job of 3 ranks under ``ringflow-run``
(issue 18).

Killed: every survivor raises within 2 s of the kill, with the same text naming the killed rank;
every in-flight handle resolves; the launcher names the killed rank; no process of the job and no
/dev/shm name is left (each job runs with a /dev/shm of its own, a tmpfs in a mount namespace,
where one can be mounted). Rank 0, the coordinator, is among the victims: the survivors then
decide without it, alike. Frozen: detected between ``timeout_s`` T and T + 2 s after the stop,
naming the frozen rank, by both survivors alike; and compute pauses of 0.5 T raise no alarm.
"""

from __future__ import annotations

import os

import pytest
from faults_harness import alive, fault_time, launch, same_text, small_shm_wrapper

from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(600)

MIB = 1 << 20

# (victim, point, bytes per tensor, tensors in flight)
KILLS = [
    (1, "plan", 4, 100),  # inside a fused batch of 100 small tensors
    (0, "plan", 4, 100),
    (2, "submit", 4, 100),
    (0, "negotiate", 4, 100),
    (1, "data_start", MIB, 20),
    (0, "data_mid", MIB, 20),
    (2, "data_mid", 64 * MIB, 1),
    (0, "data_start", 64 * MIB, 1),
]


# How often each point is passed before the batch (a warm-up allreduce and a barrier).
WARM_UP = {"plan": 2, "submit": 2, "negotiate": 4, "data_start": 1, "data_mid": 1}


def _wrapper(tmp_path, name: str) -> tuple[tuple[str, ...], object]:
    try:
        listing = tmp_path / f"left-{name}"
        return small_shm_wrapper("1g", listing), listing
    except pytest.skip.Exception:
        return (), None


@pytest.mark.parametrize(("victim", "point", "nbytes", "count"), KILLS,
                         ids=[f"rank{v}-{p}-{b}B-x{c}" for v, p, b, c in KILLS])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_killed_rank(tmp_path, transport, victim, point, nbytes, count):
    fault = f"rank={victim},point={point},action=kill,after={WARM_UP[point]}"
    wrapper, listing = _wrapper(tmp_path, "kill")
    job = launch("inflight", 3, tmp_path / "out", str(nbytes), str(count), wrapper=wrapper,
                 extra_env={"RINGFLOW_FAULT": fault, "RINGFLOW_TRANSPORT": transport,
                            "RINGFLOW_TIMEOUT_S": "10"})
    struck = fault_time(job.stderr)
    survivors = {r: job.results[r] for r in range(3) if r != victim}
    assert sorted(job.results) == sorted(survivors), job.stderr[-3000:]
    for res in survivors.values():
        assert res["resolved"] == count, res
    errors = {r: res["errors"][0] if res["errors"] else res["after"]
              for r, res in survivors.items()}
    texts = {(e["type"], e["text"]) for e in errors.values()}
    assert len(texts) == 1, f"survivors saw different errors: {texts}"
    kind, text = texts.pop()
    assert kind == "PeerError" and f"rank {victim}" in text, text
    delays = [e["at"] - struck for e in errors.values()]
    named = f"rank {victim} on host" in job.stderr and "SIGKILL" in job.stderr
    orphans = alive([res["pid"] for res in survivors.values()])
    left = listing.read_text().split() if listing is not None else []
    print(f"{transport}: rank {victim} killed at {point} ({nbytes} B x {count}): survivors "
          f"raised after {max(delays):.2f} s: {text!r}; launcher named it: {named}; "
          f"orphans {len(orphans)}; /dev/shm names left {len(left)}")
    assert max(delays) < 2.0
    assert named, job.stderr[-3000:]
    assert orphans == [] and left == []


@pytest.mark.parametrize("victim", [0, 2])
def test_stopped_rank_is_detected_within_timeout(tmp_path, victim):
    timeout_s = 3.0
    job = launch("inflight", 3, tmp_path / "out", "4", "10",
                 extra_env={"RINGFLOW_FAULT": f"rank={victim},point=plan,action=stop,after=2",
                            "RINGFLOW_TIMEOUT_S": str(timeout_s)})
    struck = fault_time(job.stderr)
    survivors = {r: job.results[r] for r in range(3) if r != victim}
    assert sorted(job.results) == sorted(survivors), job.stderr[-3000:]
    errors = {r: res["errors"][0] if res["errors"] else res["after"]
              for r, res in survivors.items()}
    error = same_text({r: {"error": e} for r, e in errors.items()})
    delays = [e["at"] - struck for e in errors.values()]
    print(f"rank {victim} stopped (SIGSTOP), timeout_s {timeout_s}: detected after "
          f"{min(delays):.2f}-{max(delays):.2f} s: {error['text']!r}")
    assert f"rank {victim} has not responded" in error["text"], error
    assert timeout_s <= min(delays) and max(delays) <= timeout_s + 2.0
    # The survivors said they failed because of another rank: the launcher names the stopped one.
    assert f"ringflow-run: rank {victim} on host" in job.stderr, job.stderr[-3000:]
    # The launcher ended the job: the stopped rank too.
    assert alive([res["pid"] for res in survivors.values()]) == []


def test_compute_pauses_of_half_the_timeout_raise_no_alarm(tmp_path):
    timeout_s = 1.0
    count = int(os.environ.get("RINGFLOW_TEST_PAUSES", "24"))
    job = launch("pauses", 3, tmp_path / "out", str(count), str(timeout_s / 2),
                 extra_env={"RINGFLOW_TIMEOUT_S": str(timeout_s)}, timeout=60 + count)
    assert job.returncode == 0, job.stderr[-3000:]
    alarms = [res for res in job.results.values() if "error" in res]
    print(f"{count} compute pauses of {timeout_s / 2} s with timeout_s {timeout_s}: "
          f"{len(alarms)} false alarms")
    assert alarms == [] and all(res["done"] == count for res in job.results.values())


def test_the_hook_costs_nothing_when_unset():
    code = ("import ringflow.injection as f, ringflow.engine, ringflow.algorithms.ring; "
            "print(f.ARMED, f._faults)")
    (out,) = run_commands([["python", "-c", code]], timeout=60, merge_stderr=False,
                          env={k: v for k, v in os.environ.items() if k != "RINGFLOW_FAULT"})
    assert out.stdout.split() == ["False", "[]"], out
