"""A rank killed while its shared-memory segments grow leaves no name in /dev/shm (issue 18).

The fault hook (``RINGFLOW_FAULT``, point ``shm_growth``) kills a rank right after it created its
new segment and before the other ranks mapped it -- the one moment its name must exist. The
survivors unlink every rank's names of a growth that failed and of the current and next
generation when they close; each worker's supervisor removes the job's names that are left when
its worker exits (which also covers a survivor killed before it could close). Each job runs with
a /dev/shm of its own (a tmpfs in a mount namespace), so only its names are counted.
"""

from __future__ import annotations

import shutil

import pytest
from faults_harness import launch, small_shm_wrapper

pytestmark = pytest.mark.timeout(400)

RUNS = int(__import__("os").environ.get("RF_RUNS", "20"))


def test_kill_during_growth_leaves_no_name(tmp_path):
    if shutil.which("taskset") is None:
        pytest.skip("needs taskset(1)")
    leftovers: list[str] = []
    killed_named = 0
    for i in range(RUNS):
        # 2 ranks on one CPU: the copy path, through segments. Alternate the victim and the
        # growth it dies in (the 1st to the 4th generation).
        victim, after = i % 2, (i // 2) % 4
        fault = f"rank={victim},point=shm_growth,action=kill,after={after}"
        listing = tmp_path / f"left-{i}"
        wrapper = (*small_shm_wrapper("256m", listing), "taskset", "-c", "0")
        job = launch("growing", 2, tmp_path / str(i), "4", wrapper=wrapper,
                     extra_env={"RINGFLOW_FAULT": fault, "RINGFLOW_TRANSPORT": "shm"})
        assert job.returncode != 0
        survivor = job.results.get(1 - victim)
        assert survivor is not None and survivor["error"]["type"] == "PeerError", job.stderr
        assert f"rank {victim}" in survivor["error"]["text"], survivor
        killed_named += f"rank {victim}" in job.stderr
        leftovers += listing.read_text().split()
    print(f"{RUNS} ranks killed while growing shared memory: {len(leftovers)} names left in "
          f"/dev/shm, the launcher named the killed rank {killed_named} times")
    assert leftovers == []
    assert killed_named == RUNS
