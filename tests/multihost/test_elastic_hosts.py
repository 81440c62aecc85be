"""Elastic jobs across hosts (issue 30): the driver in this namespace starts workers over ssh on
network-namespace hosts running sshd (netns_cluster.py), from the discovery script's list.

The worker is tests/multiproc/elastic_workers/steps.py (exact integer arithmetic): each run's
model is compared on every rank, bit for bit, with a replay that follows the run's own schedule of
sizes, and every sample of every epoch is counted once (tests/multiproc/elastic_checks.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ringflow

pytestmark = pytest.mark.timeout(150)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "multiproc"))
import netns_cluster  # noqa: E402
from elastic_checks import (  # noqa: E402
    finals,
    finished,
    no_workers_left,
    replay,
    schedule,
    went_on_without,
)

REASON = netns_cluster.unavailable()
if REASON is not None:
    pytest.skip(f"multi-host tests need network namespaces: {REASON}", allow_module_level=True)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
WORKER = str(HERE.parent / "multiproc" / "elastic_workers" / "steps.py")
#: What the worker reads, sent to the remote hosts (``-x``).
EXPORTS = ("OUT", "LENGTH", "EPOCHS", "HOSTS", "SLEEP", "KILL", "EDIT")


@pytest.fixture(scope="module")
def hosts():
    with netns_cluster.cluster(3) as c:
        yield c


def elastic_run(c: netns_cluster.Cluster, tmp_path: Path, listed: list[str], *flags: str,
                **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "hosts").write_text("".join(h + "\n" for h in listed))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    full = {**os.environ, "OUT": str(tmp_path), "LENGTH": "12", "EPOCHS": "2",
            "HOSTS": str(tmp_path / "hosts"), "SLEEP": "0.05", "KILL": "", "EDIT": "",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
            **env}
    exports = [arg for name in EXPORTS for arg in ("-x", name)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringflow.runner", "--host-discovery-script", str(script),
         "--ssh-config-file", c.ssh_config, "-i", c.identity, "-p", "22",
         "--network-interface", c.interface, *exports, "--elastic-timeout", "60", *flags,
         sys.executable, WORKER],
        env=full, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    return finished(proc)  # the remote bootstraps stop their workers when ssh is gone


def test_a_worker_killed_on_another_host_the_survivors_go_on(hosts, tmp_path):
    """Three hosts, one worker each; the worker on the second SIGKILLs itself in the middle of
    step 5: its ssh ends, its host is blacklisted, the workers on the other two roll back to
    the last commit and finish at size 2 with the replay's model."""
    victim = hosts.hosts[1]
    proc = elastic_run(hosts, tmp_path, list(hosts.hosts), "--min-np", "2", "--max-np", "3",
                       KILL=f"{victim}:5")
    went_on_without(tmp_path, proc, victim)
    no_workers_left(tmp_path)


def test_a_host_added_to_the_list_joins_over_ssh(hosts, tmp_path):
    """Two hosts listed; after step 3 rank 0 adds the third: a worker starts there over ssh,
    joins at the next commit and receives the model from its peers (it started from -5)."""
    first, second, third = hosts.hosts
    proc = elastic_run(hosts, tmp_path, [first, second], "--min-np", "2", "--max-np", "3",
                       EDIT=f"3:+{third}", EPOCHS="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = schedule(tmp_path)
    sizes = [size for _, _, size in plan]
    assert sizes[:3] == [2] * 3 and set(sizes[3:]) == {3}, sizes
    ends = finals(tmp_path)
    assert len(ends) == 3 and {e["size"] for e in ends} == {3}
    assert {e["w"] for e in ends} == {replay(plan, epochs=3)}
    no_workers_left(tmp_path)
