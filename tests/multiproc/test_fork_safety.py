"""A child forked from a rank (os.fork, a fork-started DataLoader worker) is no rank: exiting it
normally, atexit handlers included, must not say goodbye on the parent's connections, close the
store the parent serves, or touch its shared memory (issue 18, defect 4)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import free_port, run_commands

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
]

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT,
                                                                  os.environ.get("PYTHONPATH")]))}

# Each rank forks a child after init; the child exits through sys.exit(0), so its atexit
# handlers run. The parent then needs its engine (an allreduce, shared memory or TCP) and the
# job's store (get_client) again.
FORKING = """
    import os, sys, time
    import numpy as np
    import ringflow as rf
    from ringflow.errors import NotInitializedError

    rf.init()
    rf.allreduce(np.ones(4), name="before")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        # rank() answers from the launcher's environment even before init() (as jt.rank does);
        # what the child must not have is the parent's engine.
        try:
            rf.barrier()
            seen = b"a rank"
        except NotInitializedError:
            seen = b"no rank"
        seen = seen if not rf.is_initialized() else b"a rank"
        os.write(write, seen)
        sys.exit(0)  # atexit handlers run now
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    time.sleep(0.5)  # a goodbye sent by the child would have arrived by now
    total = rf.allreduce(np.full(1001, rf.rank() + 1.0), name="after", op=rf.Sum)
    n = rf.size()
    assert np.all(total == n * (n + 1) / 2), total[:3]
    rf.get_client().user_set(f"k{rf.rank()}", rf.rank())
    assert [rf.get_client().user_get(f"k{r}") for r in range(n)] == list(range(n))
    rf.barrier()  # a store that rank 0 serves ends with rank 0: every rank has read it first
    print(f"rank {rf.rank()} ok; the child was {os.read(read, 100).decode()}", flush=True)
    rf.shutdown()
"""


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_forked_child_that_exits_normally_leaves_the_job_alone(tmp_path, transport):
    script = tmp_path / "forking.py"
    script.write_text(textwrap.dedent(FORKING))
    (proc,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", "2", "--transport", transport,
          sys.executable, str(script)]], env=ENV, timeout=90, merge_stderr=False)
    for rank in range(2):
        assert f"[{rank}]:rank {rank} ok; the child was no rank" in proc.stdout.splitlines()


def test_forked_child_does_not_close_the_store_rank_0_serves(tmp_path):
    """Under a foreign launcher rank 0 serves ringflow's store itself (RINGFLOW_RENDEZVOUS_PORT
    with a secret file): a child's exit must not close that server's shared connections."""
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    port = free_port()
    script = tmp_path / "forking.py"
    script.write_text(textwrap.dedent(FORKING))
    base = {k: v for k, v in ENV.items() if not k.startswith(("RINGFLOW_", "TORCHELASTIC"))}
    results = run_commands(
        [[sys.executable, str(script)]] * 2,
        env=[{**base, "RANK": str(rank), "WORLD_SIZE": "2", "RINGFLOW_RENDEZVOUS_ADDR": "127.0.0.1",
              "RINGFLOW_RENDEZVOUS_PORT": str(port), "RINGFLOW_SECRET_FILE": str(secret)}
             for rank in range(2)],
        timeout=90, merge_stderr=False)
    for rank, result in enumerate(results):
        assert result.stdout.strip() == f"rank {rank} ok; the child was no rank"
