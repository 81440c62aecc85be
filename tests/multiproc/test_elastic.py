"""Elastic jobs on real processes (issue 30): ``ringflow-run --host-discovery-script`` on this
machine under three names (localhost, 127.0.0.1, its host name), each with its own slots.

Each run checks the model on every rank bit for bit against a replay that follows the run's own
schedule of sizes (worker elastic_workers/steps.py: exact integer arithmetic, so the replay
needs no tolerance), and that every sample of every epoch went into exactly one committed step.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic_checks import (
    finals,
    finished,
    no_workers_left,
    nothing_leaked,
    replay,
    samples_per_epoch,
    schedule,
    went_on_without,
)
from framework_jobs import installed

import ringflow

pytestmark = pytest.mark.timeout(150)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
WORKER = str(Path(__file__).parent / "elastic_workers" / "steps.py")
TORCH_WORKER = str(Path(__file__).parent / "elastic_workers" / "torch_steps.py")
TF_WORKER = str(Path(__file__).parent / "elastic_workers" / "tf_steps.py")
KERAS_WORKER = str(Path(__file__).parent / "elastic_workers" / "keras_fit.py")


def elastic_run(tmp_path: Path, hosts: list[str], *flags: str, worker: str = WORKER,
                **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "hosts").write_text("".join(h + "\n" for h in hosts))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    full = {**os.environ, "OUT": str(tmp_path), "LENGTH": "12", "EPOCHS": "2",
            "HOSTS": str(tmp_path / "hosts"),
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
            **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringflow.runner", "--host-discovery-script", str(script),
         "--elastic-timeout", "60", *flags, sys.executable, worker],
        env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    return finished(proc)


NAMES = ["localhost", "127.0.0.1", socket.gethostname()]


@pytest.mark.parametrize(("hosts", "victim"),
                         [(NAMES, 1), (NAMES, 0), (["localhost:3"], 1)],
                         ids=["rank1", "rank0", "shm-rank1"])
def test_killed_worker_survivors_go_on_at_the_smaller_size(tmp_path, hosts, victim):
    start = time.monotonic()
    name = hosts[victim] if len(hosts) > 1 else "localhost"
    # One host of three slots (the shared-memory transport): KILL_SLOT picks the victim.
    slot = {"KILL_SLOT": str(victim)} if len(hosts) == 1 else {}
    proc = elastic_run(tmp_path, hosts, "--min-np", "2", "--max-np", "3",
                       KILL=f"{name}:5", SLEEP="0.02", **slot)
    went_on_without(tmp_path, proc, name)
    assert time.monotonic() - start < 120
    no_workers_left(tmp_path)


def test_added_host_joins_and_receives_the_state_from_its_peers(tmp_path):
    proc = elastic_run(tmp_path, NAMES[:2], "--min-np", "2", "--max-np", "3",
                       EDIT=f"3:+{NAMES[2]}", SLEEP="0.1", EPOCHS="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = schedule(tmp_path)
    sizes = [size for _, _, size in plan]
    assert sizes[:3] == [2] * 3 and set(sizes[3:]) == {3}, sizes
    ends = finals(tmp_path)
    assert len(ends) == 3 and {e["size"] for e in ends} == {3}
    # The newcomer started with w = -5 (steps.py); it has rank 2 and the others' model.
    assert {e["w"] for e in ends} == {replay(plan, epochs=3)}
    nothing_leaked(ends)  # two generations (the first workers) or one (the newcomer) alike
    no_workers_left(tmp_path)


def test_a_newcomer_waits_for_the_next_commit_of_a_long_step(tmp_path):
    """Steps longer than --elastic-timeout: a newcomer waits for the members' next commit, and
    no member is stopped for not leaving its generation sooner (none had left it)."""
    proc = elastic_run(tmp_path, NAMES[:2], "--min-np", "2", "--max-np", "3",
                       "--elastic-timeout", "2", EDIT=f"1:+{NAMES[2]}", SLEEP="3.5",
                       LENGTH="6", EPOCHS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopping workers" not in proc.stderr
    plan = schedule(tmp_path)
    assert [size for _, _, size in plan] == [2, 3, 3], plan
    ends = finals(tmp_path)
    assert len(ends) == 3 and {e["w"] for e in ends} == {replay(plan, length=6, epochs=1)}
    no_workers_left(tmp_path)


def test_below_min_np_the_survivor_waits_for_a_newcomer(tmp_path):
    """min-np 2 of 2: a worker dies (its host name blacklisted) and lists another name first;
    the survivor waits below min-np until the newcomer joins and receives the state."""
    proc = elastic_run(tmp_path, NAMES[:2], "--min-np", "2", "--max-np", "2",
                       KILL=f"{NAMES[1]}:5", KILL_ADDS=NAMES[2], SLEEP="0.02")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = schedule(tmp_path)
    assert {size for _, _, size in plan} == {2}
    ends = finals(tmp_path)
    assert len(ends) == 2 and {e["w"] for e in ends} == {replay(plan)}
    assert {e["gen"] for e in ends} == {1}
    no_workers_left(tmp_path)


def test_a_host_removed_from_the_list_leaves_gracefully(tmp_path):
    proc = elastic_run(tmp_path, NAMES, "--min-np", "2", "--max-np", "3",
                       EDIT=f"3:-{NAMES[2]}", SLEEP="0.05")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "blacklisted" not in proc.stderr
    plan = schedule(tmp_path)
    sizes = [size for _, _, size in plan]
    assert sizes[:3] == [3] * 3 and set(sizes[3:]) == {2}, sizes
    ends = finals(tmp_path)  # the removed worker exits 0 without finishing
    assert len(ends) == 2 and {e["w"] for e in ends} == {replay(plan)}
    no_workers_left(tmp_path)


def test_a_worker_killed_during_the_sync_of_the_next_generation(tmp_path):
    """Four workers; one dies at step 5, another as the next generation syncs: the third
    generation (two workers) goes on from the last commit."""
    hosts = ["localhost:2", NAMES[1], NAMES[2]]
    proc = elastic_run(tmp_path, hosts, "--min-np", "2", "--max-np", "4",
                       KILL=f"{NAMES[1]}:5", SYNC_KILL=f"{NAMES[2]}:1", SLEEP="0.02",
                       LENGTH="32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = schedule(tmp_path)
    sizes = [size for _, _, size in plan]
    assert sizes[:5] == [4] * 5 and sizes[5] in (2, 4) and set(sizes[6:]) == {2}, sizes
    ends = finals(tmp_path)
    assert len(ends) == 2 and {e["w"] for e in ends} == {replay(plan, length=32)}
    assert {e["gen"] for e in ends} == {2}
    no_workers_left(tmp_path)


def test_a_worker_killed_as_the_next_generation_connects(tmp_path):
    """One dies at step 3; another as it receives its place in the next generation, before it
    connects: the others stop waiting for it when the driver sees it exit (not after
    RINGFLOW_TIMEOUT_S) and form a third generation."""
    hosts = ["localhost:2", NAMES[1], NAMES[2]]
    proc = elastic_run(tmp_path, hosts, "--min-np", "2", "--max-np", "4", KILL=f"{NAMES[1]}:3",
                       JOIN_KILL=f"{NAMES[2]}:1", SLEEP="0.02", LENGTH="32",
                       RINGFLOW_TIMEOUT_S="100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generation 1 of the elastic job lost a worker (the driver saw it exit)" in proc.stderr
    plan = schedule(tmp_path)
    ends = finals(tmp_path)
    assert len(ends) == 2 and {e["w"] for e in ends} == {replay(plan, length=32)}
    assert {e["gen"] for e in ends} == {2}
    no_workers_left(tmp_path)


def test_a_frozen_worker_is_left_behind(tmp_path):
    """A worker SIGSTOPs itself: its peers find it silent (RINGFLOW_TIMEOUT_S) and ask for a new
    generation; the driver stops it after --elastic-timeout and the survivors go on."""
    proc = elastic_run(tmp_path, NAMES, "--min-np", "2", "--max-np", "3", "--elastic-timeout",
                       "3", STOP=f"{NAMES[1]}:4", SLEEP="0.02", RINGFLOW_TIMEOUT_S="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopping workers [1]: they did not leave generation 0 within --elastic-timeout" \
        in proc.stderr
    plan = schedule(tmp_path)
    ends = finals(tmp_path)
    assert len(ends) == 2 and {e["w"] for e in ends} == {replay(plan)}
    no_workers_left(tmp_path)


def test_no_usable_host_fails_after_the_elastic_timeout(tmp_path):
    proc = elastic_run(tmp_path, ["far-away-host:2"], "--elastic-timeout", "1")
    assert proc.returncode == 1
    assert "ignoring host 'far-away-host' of the discovery script" in proc.stderr
    assert ("ringflow-run: no first generation of at least --min-np 1 workers within "
            "--elastic-timeout 1 s (workers started: 0)") in proc.stderr


def test_below_min_np_for_the_elastic_timeout_the_job_fails(tmp_path):
    proc = elastic_run(tmp_path, NAMES, "--min-np", "3", "--elastic-timeout", "2",
                       KILL=f"{NAMES[1]}:3", SLEEP="0.02")
    assert proc.returncode == 128 + 9  # the first failure's: the SIGKILL
    assert ("ringflow-run: only 2 workers for at least --min-np 3 within --elastic-timeout "
            "2 s") in proc.stderr
    no_workers_left(tmp_path)


def test_when_every_worker_of_a_generation_dies_the_job_fails_and_says_why(tmp_path):
    proc = elastic_run(tmp_path, NAMES[:2], "--min-np", "1", KILL=f"{NAMES[0]}:3,{NAMES[1]}:3",
                       SLEEP="0.02")
    assert proc.returncode == 128 + 9
    # Both kill themselves in step 3; when the second is late, it first re-forms alone as
    # generation 1 (the first's loss interrupts its step 3) and dies in step 3 again.
    assert re.search(r"ringflow-run: every worker of generation [01] is gone, and the training "
                     r"state with them", proc.stderr), proc.stderr
    no_workers_left(tmp_path)


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path):
    (tmp_path / "hosts").write_text("".join(h + "\n" for h in NAMES))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path), "LENGTH": "600", "EPOCHS": "1", "SLEEP": "0.05",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringflow.runner", "--host-discovery-script", str(script),
         "--min-np", "3", sys.executable, WORKER], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        end = time.monotonic() + 60
        while not list(tmp_path.glob("steps-*.jsonl")) and time.monotonic() < end:
            time.sleep(0.1)
        proc.send_signal(15)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 128 + 15, err[-3000:]
    assert "blacklisted" not in err  # workers it stopped are not failures
    no_workers_left(tmp_path)


def test_past_the_reset_limit_the_job_fails_and_says_why(tmp_path):
    proc = elastic_run(tmp_path, NAMES, "--min-np", "2", "--max-np", "3", "--reset-limit", "0",
                       KILL=f"{NAMES[1]}:5", SLEEP="0.02")
    assert proc.returncode != 0
    assert "ringflow-run: the job re-formed more than --reset-limit 0 times" in proc.stderr
    assert not finals(tmp_path)
    no_workers_left(tmp_path)


def test_fifty_resets_leak_no_memory(tmp_path):
    """The third name leaves and comes back every two steps: 50 generations (25 removals, 25
    newcomers). The worker that lives through all of them grows by at most 5 MB of resident
    memory after the first ten, and ends like the others (no thread, descriptor or name of an
    old generation left)."""
    toggles = ",".join(f"{s}:{'-' if k % 2 == 0 else '+'}{NAMES[2]}"
                       for k, s in enumerate(range(2, 2 + 2 * 49, 2)))
    proc = elastic_run(tmp_path, NAMES, "--min-np", "2", "--max-np", "3", EDIT=toggles,
                       LENGTH="150", EPOCHS="2", SLEEP="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = schedule(tmp_path)
    ends = finals(tmp_path)
    assert {e["w"] for e in ends} == {replay(plan, length=150)}
    first = [json.loads(line) for line in (tmp_path / "rss-0.jsonl").read_text().splitlines()]
    assert first[-1]["gen"] >= 49, first[-1]
    by_gen = {r["gen"]: r["rss_kb"] for r in first}
    assert by_gen[max(by_gen)] - by_gen[10] <= 5 * 1024, by_gen
    nothing_leaked(ends)
    no_workers_left(tmp_path)


#: Seeded chaos schedules (issue 30): ``ELASTIC_CHAOS_RUNS`` of them (a few in the suite; the
#: issue's run is 200, benchmarks/RESULTS.md has its figures).
CHAOS_RUNS = int(os.environ.get("ELASTIC_CHAOS_RUNS", "4"))
FAULTS = ("kill", "commit", "stop", "sync", "join", "add", "remove")


def chaos(seed: int) -> tuple[list[str], dict[str, str], list[str], str | None]:
    """Seed's schedule: the discovery list (2-4 workers on the three names; ``localhost:2`` is
    two workers that die together), one to three faults (a SIGKILL in the middle of a step or
    in ``commit()``, a SIGSTOP, a SIGKILL as a generation syncs or as a worker receives its
    place in one, a name added to the list or removed from it and, without a spare name, put
    back later), the driver's flags, and the name no fault touches (so that the state survives;
    none in one schedule of ten, which may then end the job)."""
    rng = random.Random(seed)
    hosts = rng.choice([NAMES[:2], NAMES, ["localhost:2", *NAMES[1:]]])
    names = [h.split(":")[0] for h in hosts]
    safe = rng.choice(names) if rng.random() < 0.9 else None
    targets = [n for n in names if n != safe]
    faults: dict[str, list[str]] = {k: [] for k in ("KILL", "STOP", "SYNC_KILL", "JOIN_KILL",
                                                    "EDIT")}
    for _ in range(rng.randint(1, 3)):
        kind, step = rng.choice(FAULTS), rng.randint(1, 16)
        if kind == "stop" and faults["STOP"]:
            kind = "kill"  # one frozen worker a run: each costs the timeouts
        victim = rng.choice(targets) if targets else None
        if kind == "add":
            spare = [n for n in NAMES if n not in names]
            line = spare[0] if spare else rng.choice(targets or names)
            if not spare:  # out first, back later
                faults["EDIT"].append(f"{step}:-{line}")
                step += rng.randint(2, 8)
            faults["EDIT"].append(f"{step}:+{line}")
        elif victim is None:
            continue
        elif kind == "remove":
            faults["EDIT"].append(f"{step}:-{victim}")
        elif kind in ("sync", "join"):
            faults["SYNC_KILL" if kind == "sync" else "JOIN_KILL"].append(
                f"{victim}:{rng.randint(1, 2)}")
        else:
            faults["STOP" if kind == "stop" else "KILL"].append(
                f"{victim}:{step}" + (":commit" if kind == "commit" else ""))
    env = {k: ",".join(v) for k, v in faults.items() if v}
    flags = ["--min-np", "1", "--max-np", "4", "--blacklist-cooldown-range", "1", "1"]
    if "STOP" in env:  # the peers find it silent after RINGFLOW_TIMEOUT_S; the driver stops it
        env["RINGFLOW_TIMEOUT_S"] = "3"
        flags += ["--elastic-timeout", "4"]
    return hosts, env, flags, safe


@pytest.mark.parametrize("seed", range(CHAOS_RUNS))
def test_chaos_schedule(tmp_path, seed):
    """Each schedule ends with the replay's model on every rank (each sample once per epoch) or,
    where every worker holding the state died, non-zero within 30 s of the last death, saying
    so; either way no process and no shared-memory name of the job is left."""
    hosts, faults, flags, safe = chaos(seed)
    spec = f"hosts {hosts}, {faults}"
    proc = elastic_run(tmp_path, hosts, *flags, SLEEP="0.05", LENGTH="24", EPOCHS="3",
                       EDIT_WAIT="5", **faults)
    ended = time.time()
    no_workers_left(tmp_path)
    jobs = [json.loads(p.read_text())["job"] for p in tmp_path.glob("start-*.json")]
    assert jobs and not [n for n in os.listdir("/dev/shm")
                         if any(n.startswith(f"rfj{j}_") for j in jobs)], spec
    if proc.returncode and safe is None:
        deaths = [json.loads(p.read_text())["t"] for p in tmp_path.glob("kill-*.json")]
        assert deaths and ended - max(deaths) < 30, spec
        assert "ringflow-run: every worker of generation" in proc.stderr, proc.stderr[-3000:]
        return
    assert proc.returncode == 0, f"{spec}\n{proc.stderr[-3000:]}"
    plan = schedule(tmp_path)
    ends = finals(tmp_path)
    assert ends and {e["w"] for e in ends} == {replay(plan, length=24, epochs=3)}, spec
    nothing_leaked(ends)


def _needs(module: str) -> None:
    """Skip where ``module`` is not installed; found, not imported: the workers import it."""
    if not installed(module):
        pytest.skip(f"{module} is not installed")


@pytest.mark.parametrize(("grow", "framework"), [
    (False, "torch"), (True, "torch"), (True, "tensorflow-powersgd"),
], ids=["kill-torch", "add-torch", "add-tensorflow-powersgd"])
def test_framework_state_moves_between_generations(tmp_path, grow, framework):
    """TorchState (model, DistributedOptimizer with momentum, ElasticSampler) and
    TensorFlowKerasState (Keras model, Keras SGD with momentum: a newcomer's optimizer has no
    variables before it is built); with PowerSGD, the state carries the tape's compressor (a
    hidden layer of 16 makes a kernel it compresses). TensorFlow's job (20-28 CPU-seconds) is
    the addition, with compression; its kill is test_keras_fit_rolls_back_the_interrupted_epoch
    (KerasState is a TensorFlowKerasState: the same restore, after a failure that comes out of
    a compiled step)."""
    _needs(framework.split("-")[0])
    worker = TORCH_WORKER if framework == "torch" else TF_WORKER
    extra = ({"HIDDEN": "16", "RINGFLOW_COMPRESSION": "powersgd:rank=1:min_elements=16"}
             if framework.endswith("powersgd") else {})
    if grow:
        proc = elastic_run(tmp_path, NAMES[:2], "--min-np", "2", "--max-np", "3",
                           worker=worker, GROW=f"{tmp_path / 'hosts'}:3:{NAMES[2]}",
                           EDIT=f"3:+{NAMES[2]}", SLEEP="0.1", EPOCHS="3", **extra)
    else:
        proc = elastic_run(tmp_path, NAMES, "--min-np", "2", "--max-np", "3",
                           worker=worker, KILL=f"{NAMES[1]}:5", SLEEP="0.02", **extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ends = finals(tmp_path)
    assert len(ends) == (3 if grow else 2)
    assert {e["size"] for e in ends} == {len(ends)}
    # Parameters and momentum equal on every rank, bit for bit (the newcomer's included).
    assert len({(tuple(e["params"]), tuple(e["momentum"])) for e in ends}) == 1
    if extra:  # every rank compressed the kernel, and kept its own error feedback
        assert all(e["compressed"] for e in ends), ends
    seen = samples_per_epoch(tmp_path)
    epochs = 3 if grow else 2
    assert {e: sorted(v) for e, v in seen.items()} == {e: list(range(12)) for e in range(epochs)}
    sizes = [rec[2] for rec in schedule(tmp_path)]
    if framework.startswith("tensorflow"):  # tf.functions traced in the first generation
        steps = [json.loads(line) for path in tmp_path.glob("steps-*.jsonl")
                 for line in path.read_text().splitlines()]
        assert all(s["size_op"] == s["size"] and s["local_scale"] == 1 / s["size"]
                   for s in steps), steps
    if grow:
        assert sizes[:3] == [2] * 3 and set(sizes[3:]) == {3}, sizes
    else:  # step 5 may complete at size 3 (see the numpy test)
        assert sizes[:5] == [3] * 5 and sizes[5] in (2, 3) and set(sizes[6:]) == {2}, sizes
    no_workers_left(tmp_path)


def test_keras_fit_rolls_back_the_interrupted_epoch(tmp_path):
    """model.fit under hvd.elastic.run: a worker dies in the third batch of epoch 1; the
    collective's failure comes out of the compiled step as a TensorFlow UnknownError, which
    run() turns into HorovodInternalError; KerasState rolls back to the end of epoch 0, and
    epochs 1 to 3 run at size 2, with the same weights and optimizer variables on both ranks."""
    _needs("tensorflow")
    proc = elastic_run(tmp_path, NAMES, "--min-np", "2", worker=KERAS_WORKER,
                       KILL=f"{NAMES[1]}:1:2", EPOCHS="4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ends = finals(tmp_path)
    assert len(ends) == 2 and {e["size"] for e in ends} == {2}
    assert len({(tuple(e["params"]), tuple(e["momentum"])) for e in ends}) == 1
    assert all(e["ran"] == [[0, 3], [1, 2], [2, 2], [3, 2]] for e in ends), ends
    no_workers_left(tmp_path)


TORCHRUN_WORKER = str(Path(__file__).parent / "elastic_workers" / "torchrun_steps.py")


def test_under_torchrun_a_restart_resumes_from_the_last_commit(tmp_path):
    """torchrun --max-restarts: rank 1 dies at step 5 of the first attempt; torchrun restarts
    both workers, which resume from the commit kept in the agent's store (not from step 0), and
    end with the replay's model."""
    env = {**os.environ, "OUT": str(tmp_path), "LENGTH": "12", "EPOCHS": "2", "KILL_STEP": "5",
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "2", TORCHRUN_WORKER], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc = finished(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    starts = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("start-*.json")}
    # Step 5 itself may have been committed: rank 0 reduces a small tensor itself, and rank 1's
    # contribution can reach it before the SIGKILL.
    assert starts["start-1-0.json"]["step"] == starts["start-1-1.json"]["step"] in (5, 6), starts
    plan = schedule(tmp_path)
    assert [size for _, _, size in plan] == [2] * 12, plan
    ends = finals(tmp_path)
    assert len(ends) == 2 and {e["attempt"] for e in ends} == {1}
    assert {e["w"] for e in ends} == {replay(plan)}
    no_workers_left(tmp_path)


def test_example_runs_elastic(tmp_path):
    """examples/elastic_torch.py, as docs/guides/elastic.md runs it (one host of two slots,
    ``--min-np 2 --max-np 4``; that page's block is only parsed), for two epochs."""
    _needs("torch")
    example = str(Path(ROOT) / "examples" / "elastic_torch.py")
    proc = elastic_run(tmp_path, ["localhost:2"], "--min-np", "2", "--max-np", "4",
                       worker=example, EPOCHS="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split(" on ")[1] for line in proc.stdout.splitlines()
            if "epoch" in line] == ["2 workers"] * 2, proc.stdout
