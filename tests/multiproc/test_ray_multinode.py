"""RayExecutor across Ray nodes: two raylets on this machine (``ray.cluster_utils.Cluster``),
both on 127.0.0.1, so that ranks are assigned node by node from real Ray node ids and the
store takes the multi-node path (the driver node's Ray address), still on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

# Read by Ray at import (see test_ray.py).
os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")

ray = pytest.importorskip("ray")

import ringflow  # noqa: E402
from ringflow.ray import RayExecutor  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
HERE = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[list[str]]:
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    if ray_constants.ENABLE_RAY_CLUSTER:
        pytest.fail("Ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set; set "
                    "it in the environment of pytest")
    if ray.is_initialized():
        ray.shutdown()
    node = {"num_cpus": 2, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        pythonpath = os.pathsep.join(filter(None, [ROOT, HERE, os.environ.get("PYTHONPATH")]))
        ray.init(address=cluster.address,
                 runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}})
        try:
            yield [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def placement() -> tuple:
    ringflow.init()
    total = ringflow.allreduce(np.full(1000, ringflow.rank() + 1.0), name="t", op=ringflow.Sum)
    return (ringflow.rank(), ringflow.size(), ringflow.local_rank(), ringflow.local_size(),
            ringflow.cross_rank(), ringflow.cross_size(),
            ray.get_runtime_context().get_node_id(), float(total.min()), float(total.max()))


def test_num_hosts_places_workers_per_host_on_each_node(two_nodes: list[str]) -> None:
    assert len(two_nodes) == 2
    with RayExecutor(num_hosts=2, num_workers_per_host=2) as executor:
        executor.start()
        assert executor._job.server.host == "127.0.0.1"  # the driver node's Ray address
        results = executor.run(placement, timeout=90)
    assert [r[:6] for r in results] == [
        (0, 4, 0, 2, 0, 2), (1, 4, 1, 2, 0, 2), (2, 4, 0, 2, 1, 2), (3, 4, 1, 2, 1, 2)]
    nodes = [r[6] for r in results]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert all(r[7] == r[8] == 10.0 for r in results)


def test_num_workers_ranks_unequal_nodes_node_by_node(two_nodes: list[str]) -> None:
    # 3 workers of 1 CPU on two 2-CPU nodes: PACK puts 2 on one node and 1 on the other.
    with RayExecutor(num_workers=3) as executor:
        executor.start()
        results = executor.run(placement, timeout=90)
    by_node: dict[str, list[tuple]] = {}
    for r in results:
        by_node.setdefault(r[6], []).append(r)
    assert sorted(len(v) for v in by_node.values()) == [1, 2]
    for host, ranks in enumerate(by_node.values()):  # nodes in rank order
        assert [r[0] for r in ranks] == list(range(ranks[0][0], ranks[0][0] + len(ranks)))
        assert [(r[2], r[3], r[4], r[5]) for r in ranks] == [
            (i, len(ranks), host, 2) for i in range(len(ranks))]
    assert all(r[7] == r[8] == 6.0 for r in results)
