"""A small /dev/shm (Docker's 64 MiB default): shared-memory jobs run, or fail on every rank
with a clear error naming /dev/shm, the size needed and the fix -- never a signal (issue 18).

Each job runs in a mount namespace of its own with a 64 MiB tmpfs over /dev/shm, so the real
path is what is tested. Three ranks on one host take the copy path (segments in /dev/shm) on a
machine of fewer than three CPUs, and everywhere under ``taskset -c 0`` (the ranks outnumber
the CPUs they may run on); ``-H localhost:2,127.0.0.1:2`` makes two "hosts" of this one, so the
hierarchical allreduce runs with shared memory inside each.
"""

from __future__ import annotations

import shutil
import signal

import pytest
from faults_harness import launch, small_shm_wrapper

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {
    "shm": (3, ()),
    "hierarchical": (4, ("-H", "localhost:2,127.0.0.1:2")),
}


@pytest.mark.parametrize("nbytes", [4, 1 << 20, 64 << 20], ids=["4B", "1MiB", "64MiB"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_small_dev_shm_runs_or_fails_clearly(tmp_path, layout, nbytes):
    if shutil.which("taskset") is None:
        pytest.skip("needs taskset(1)")
    n, flags = LAYOUTS[layout]
    wrapper = (*small_shm_wrapper("64m"), "taskset", "-c", "0")
    job = launch("allreduce", n, tmp_path, str(nbytes), flags=flags, wrapper=wrapper,
                 timeout=150)
    signals = {128 + s for s in (signal.SIGBUS, signal.SIGSEGV, signal.SIGKILL)}
    assert job.returncode not in signals, f"a rank died of a signal:\n{job.stderr[-3000:]}"
    assert sorted(job.results) == list(range(n)), f"missing ranks:\n{job.stderr[-3000:]}"
    outcome = {("ok" if "exact" in res else res["error"]["type"]) for res in job.results.values()}
    print(f"{layout}, {nbytes} B on {n} ranks in a 64 MiB /dev/shm: {outcome}, "
          f"{job.wall:.1f} s")
    if outcome == {"ok"}:
        assert all(res["exact"] for res in job.results.values())
        assert job.returncode == 0
        return
    texts = {res["error"]["text"] for res in job.results.values()}
    assert len(texts) == 1 and outcome == {"SharedMemoryError"}, texts
    text = texts.pop()
    for fragment in ("/dev/shm", "MiB free", "need", "--shm-size", "RINGFLOW_TRANSPORT=tcp"):
        assert fragment in text, text
    print(f"  the error: {text}")
