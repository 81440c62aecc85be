"""A stand-in for Slurm's ``srun`` and ``scontrol show hostnames`` on this machine's network-
namespace hosts (tests/multihost/netns_cluster.py), for tests: no slurmctld, but every task gets
the variables a real ``srun`` step sets (``SLURM_PROCID``, ``SLURM_STEP_*``, node lists, ...),
and runs in the namespace of its node.

The allocation is described by the environment the batch script would have: ``SLURM_JOB_ID``,
``SLURM_JOB_NODELIST`` (a compressed host list), and ``FAKE_SLURM_NAMESPACES``
(``h1=ns1,h2=ns2``: the namespace of each node; a node without one runs here). Tasks run as
their node (:func:`netns_cluster.on_host`: its namespace and its host name).

    srun [-N NODES] [--ntasks-per-node K] COMMAND ...     (block distribution, like Slurm's)
    scontrol show hostnames [LIST]

``scontrol`` writes its names one at a time, 0.2 s apart: a script that stops reading early
(``| head -n 1`` under ``set -o pipefail``) fails here every time, as it does under a real
``scontrol`` whenever the reader exits before the writer is done.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import hostlist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "multihost"))
import netns_cluster


def step_env(job_id: str, step_id: int, nodes: list[str], per_node: int, node: int,
             local: int) -> dict[str, str]:
    """The variables ``srun`` gives task ``local`` of node ``node`` in a step of ``per_node``
    tasks on each of ``nodes`` (a subset of the job's nodes, first ones first)."""
    ntasks = per_node * len(nodes)
    compressed = hostlist.collect_hostlist(nodes)
    tasks = f"{per_node}(x{len(nodes)})" if len(nodes) > 1 else str(per_node)
    return {
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": str(step_id),
        "SLURM_STEPID": str(step_id), "SLURM_PROCID": str(node * per_node + local),
        "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NNODES": str(len(nodes)), "SLURM_STEP_NUM_NODES": str(len(nodes)),
        "SLURM_STEP_NODELIST": compressed, "SLURM_NODELIST": compressed,
        "SLURM_TASKS_PER_NODE": tasks, "SLURM_STEP_TASKS_PER_NODE": tasks,
        "SLURMD_NODENAME": nodes[node], "SLURM_TOPOLOGY_ADDR": nodes[node],
        "SLURM_GTIDS": ",".join(str(node * per_node + t) for t in range(per_node)),
    }


def _namespaces() -> dict[str, str]:
    pairs = filter(None, os.environ.get("FAKE_SLURM_NAMESPACES", "").split(","))
    return dict(pair.split("=", 1) for pair in pairs)


def srun(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="srun")
    p.add_argument("-N", "--nodes", type=int)
    p.add_argument("--ntasks-per-node", type=int, default=1)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    allocated = hostlist.expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
    nodes = allocated[:args.nodes or len(allocated)]
    step = int(os.environ.get("FAKE_SLURM_STEP", "0"))
    where = _namespaces()
    procs = []
    for node, name in enumerate(nodes):
        prefix = netns_cluster.on_host(where[name], name) if name in where else []
        for local in range(args.ntasks_per_node):
            env = {**os.environ, **step_env(os.environ["SLURM_JOB_ID"], step, nodes,
                                           args.ntasks_per_node, node, local)}
            procs.append(subprocess.Popen(prefix + args.command, env=env))
    codes = [proc.wait() for proc in procs]
    return next((c for c in codes if c), 0)


def scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"]:
        sys.stderr.write("fake scontrol: only 'show hostnames [LIST]'\n")
        return 2
    names = hostlist.expand_hostlist(argv[2] if len(argv) > 2
                                     else os.environ["SLURM_JOB_NODELIST"])
    for i, name in enumerate(names):
        if i:
            time.sleep(0.2)
        print(name, flush=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit({"srun": srun, "scontrol": scontrol}[sys.argv[1]](sys.argv[2:]))
