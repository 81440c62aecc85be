"""An elastic worker for tests/multiproc/test_elastic.py: numpy only, exact integer arithmetic.

Each step, every rank takes its next sample ``i`` of the epoch (:func:`ringflow.elastic.shard`;
none once its shard is used up) and contributes ``i + 1``; the step's sum ``s`` (an int64
allreduce) updates ``w = (3 w + s) mod P``, so the final ``w`` depends on which samples each step
took, in which order: a replay from the schedule of sizes must reach it bit for bit. The state
(``w``, epoch, processed samples, step) is committed after every step.

Environment: ``OUT`` (a folder), ``LENGTH``, ``EPOCHS``, ``SLEEP`` (seconds a step),
``KILL=HOST:STEP,...`` (the worker on HOST SIGKILLs itself in the middle of that step, or
with ``HOST:STEP:commit`` in ``commit()`` once that step is saved; with
``KILL_SLOT=N`` only the one in slot N of HOST; it records the time first, ``kill-*.json``),
``KILL_ADDS=LINE`` (the victim first appends LINE to the discovery list ``HOSTS``),
``SYNC_KILL=HOST:GEN,...`` (the worker on HOST SIGKILLs itself as generation GEN syncs),
``JOIN_KILL=HOST:GEN,...`` (... as it receives its place in generation GEN, before it
connects), ``STOP=HOST:STEP,...`` (the worker on HOST SIGSTOPs itself in the middle of that
step),
``EDIT=STEP:+LINE,STEP:-LINE,...`` (rank 0 adds LINE to ``HOSTS``, or removes it, after that
step, and holds the job until the driver asks it to re-form, so that the test knows the step;
at most ``EDIT_WAIT`` seconds, default 60), ``HOLD=STEP`` (rank 0 holds the job after that step
in the same way, for a test that adds workers by other means).
Each worker records its resident memory at each generation it joins (``rss-*.jsonl``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

import ringflow as rf
from ringflow import elastic

P = 1_000_003
SEED = 11
OUT = os.environ["OUT"]
LENGTH, EPOCHS = int(os.environ["LENGTH"]), int(os.environ["EPOCHS"])
SLEEP = float(os.environ.get("SLEEP", "0"))
WID = os.environ["RINGFLOW_ELASTIC_ID"]
HOST = os.environ["RINGFLOW_HOSTNAME"]
KILL = os.environ.get("KILL", "").split(",")
KILL_SLOT, SLOT = os.environ.get("KILL_SLOT", ""), os.environ["RINGFLOW_LOCAL_RANK"]
EDIT, HOSTS = os.environ.get("EDIT", ""), os.environ.get("HOSTS", "")
HOLD = os.environ.get("HOLD", "")
KILL_ADDS = os.environ.get("KILL_ADDS", "")
SYNC_KILL = os.environ.get("SYNC_KILL", "").split(",")
JOIN_KILL = os.environ.get("JOIN_KILL", "")
STOP = os.environ.get("STOP", "").split(",")


def edit_hosts(step: int) -> None:
    """Rank 0 at ``EDIT``'s step: change the list, then hold the job (its peers wait in the next
    commit) until the driver asks it to re-form."""
    changes = [e.split(":", 1)[1] for e in EDIT.split(",") if int(e.split(":", 1)[0]) == step]
    lines = Path(HOSTS).read_text().split()
    done = [c for c in changes if (c[1:] in lines) != (c[0] == "+")]  # not done before a redo
    if not done:
        return
    for change in done:
        if change[0] == "+":
            lines.append(change[1:])
        else:
            lines.remove(change[1:])
    Path(HOSTS + ".new").write_text("".join(line + "\n" for line in lines))
    os.replace(HOSTS + ".new", HOSTS)
    hold()


def hold() -> None:
    """Wait until the driver asks this generation to re-form, at most ``EDIT_WAIT`` seconds."""
    end = time.monotonic() + float(os.environ.get("EDIT_WAIT", "60"))
    while not rf.runtime.world().update_pending() and time.monotonic() < end:
        time.sleep(0.05)


def die(**fields: object) -> None:
    """SIGKILL this worker, its time and place recorded first (``kill-*.json``)."""
    with open(os.path.join(OUT, f"kill-{WID}.json"), "w") as f:
        json.dump({"t": time.time(), **fields}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def record(**fields: object) -> None:
    with open(os.path.join(OUT, f"steps-{WID}.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


@elastic.run
def train(state: elastic.ObjectState) -> int:
    g = rf.runtime.world().generation
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(os.path.join(OUT, f"rss-{WID}.jsonl"), "a") as f:
        f.write(json.dumps({"gen": g, "rss_kb": rss}) + "\n")
    while state.epoch < EPOCHS:
        mine = elastic.shard(LENGTH, state.epoch, SEED, True, state.processed, rf.rank(),
                             rf.size())
        k = 0
        while state.processed < LENGTH:
            sample = mine[k] if k < len(mine) else -1
            handle = rf.allreduce_async(np.array([sample + 1], np.int64), name="step",
                                        op=rf.Sum)
            if f"{HOST}:{state.step}" in STOP:
                os.kill(os.getpid(), signal.SIGSTOP)
            if KILL_SLOT in ("", SLOT) and f"{HOST}:{state.step}" in KILL:
                if KILL_ADDS:
                    with open(HOSTS, "a") as f:
                        f.write(KILL_ADDS + "\n")
                die(step=state.step)
            total = int(rf.synchronize(handle)[0])
            state.w = (state.w * 3 + total) % P
            record(gen=g, rank=rf.rank(), size=rf.size(), step=state.step, epoch=state.epoch,
                   t=time.time(),
                   processed=state.processed, sample=sample)
            state.processed = min(LENGTH, state.processed + rf.size())
            state.step += 1
            k += 1
            if EDIT and rf.rank() == 0:
                edit_hosts(state.step)
            if str(state.step) == HOLD and rf.rank() == 0:
                hold()
            time.sleep(SLEEP)
            state.commit()
        state.epoch += 1
        state.processed = 0
        state.commit()
    return int(state.w)


class State(elastic.ObjectState):
    def commit(self) -> None:
        self.save()
        if f"{HOST}:{self.step}:commit" in KILL:  # saved here, its peers in the host check
            die(step=self.step, where="commit")
        self.check_host_updates()

    def sync(self) -> None:
        if f"{HOST}:{rf.runtime.world().generation}" in SYNC_KILL:
            die(where="sync")  # its peers are in the broadcast of sync()
        super().sync()


if JOIN_KILL:  # HOST:GEN,...: die between the answer and the connections
    from ringflow.world import World

    joined = World.join

    def join_then_die(self: World) -> object:
        answer = joined(self)
        if answer is not None and f"{HOST}:{answer[0]}" in JOIN_KILL.split(","):
            die(where="join")
        return answer

    World.join = join_then_die  # type: ignore[method-assign]

with open(os.path.join(OUT, f"start-{WID}.json"), "w") as f:
    json.dump({"t": time.time(), "job": os.environ["RINGFLOW_JOB_ID"]}, f)  # asks now
rf.init()
w = train(State(w=7 if rf.rank() == 0 else -5, epoch=0, processed=0, step=0))
final = {"w": w, "rank": rf.rank(), "size": rf.size(), "gen": rf.runtime.world().generation}
rf.shutdown()
# What the generations left behind once the last one is shut down: threads, descriptors (the
# store connection stays), shared-memory names of this worker.
end = time.monotonic() + 3.0  # a connection's last goodbye may still be on its way out
while len(threading.enumerate()) > 2 and time.monotonic() < end:
    time.sleep(0.01)
final["threads"] = sorted(t.name for t in threading.enumerate())
final["fds"] = len(os.listdir("/proc/self/fd"))
final["fd_kinds"] = {}  # socket, pipe, anon_inode, file: how many of each
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed by now
        continue
    kind = "file" if target.startswith("/") else target.split(":")[0]
    final["fd_kinds"][kind] = final["fd_kinds"].get(kind, 0) + 1
final["shm"] = [n for n in os.listdir("/dev/shm")
                if n.startswith(f"rfj{os.environ['RINGFLOW_JOB_ID']}_")]
with open(os.path.join(OUT, f"final-{WID}.json"), "w") as f:
    json.dump(final, f)
