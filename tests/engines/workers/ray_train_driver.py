"""Driver of tests/engines/test_ray_train.py: a one-node Ray cluster on 127.0.0.1 (2 logical
CPUs, no dashboard) and ``ray.train.torch.TorchTrainer`` runs of 2 workers in it.

    python ray_train_driver.py OUT_DIR PHASE...

Phases (workers/phases.py):

- ``checks``: the loop is ``import ringflow.torch as hvd; hvd.init()`` with no other setup, then
  job.checks (exact collectives, the key-value client, hvd.DistributedOptimizer training equal to
  one process on the global batch). Each rank writes its PASS line to OUT_DIR/rank<r> (Ray's log
  forwarding prints worker lines late or twice); the driver prints them.
- ``example``: examples/ray_train_torch.py for 2 epochs, in this cluster.

Run it inside a network namespace that has only a loopback interface: the TCPStore of the
process group Ray Train makes listens on every interface.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Read when Ray is imported (see tests/multiproc/test_ray.py).
os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"})

import ray
from phases import run_phases
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
EXAMPLES = ROOT / "examples"
WORKERS = 2


def checks_loop(config: dict) -> None:
    import job
    import ray.train

    import ringflow
    import ringflow.torch as hvd

    hvd.init()
    line = job.checks(ringflow, size=WORKERS, train=True)
    Path(config["out"], f"rank{hvd.rank()}").write_text(line)
    ray.train.report({"rank": hvd.rank()})
    hvd.shutdown()


def main() -> int:
    out = Path(sys.argv[1])
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), str(HERE), str(EXAMPLES),
                                               os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=WORKERS, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {
                 "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1",
                 "RINGFLOW_TIMEOUT_S": os.environ.get("RINGFLOW_TIMEOUT_S", "60"),
                 # gloo binds to the address of the host name, which may name an interface
                 # that the namespace lacks.
                 "GLOO_SOCKET_IFNAME": "lo"}})

    def checks() -> None:
        TorchTrainer(checks_loop, train_loop_config={"out": str(out)},
                     scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
                     run_config=RunConfig(name="checks", storage_path=str(out / "results"))
                     ).fit()
        for rank in range(WORKERS):
            print((out / f"rank{rank}").read_text(), flush=True)

    def example() -> None:
        sys.path.insert(0, str(EXAMPLES))
        import ray_train_torch

        accuracy = ray_train_torch.main(["--num-workers", str(WORKERS), "--epochs", "2",
                                         "--storage-path", str(out / "results")])
        print(f"EXAMPLE accuracy {accuracy:.4f}", flush=True)

    try:
        return run_phases({"checks": checks, "example": example}, sys.argv[2:])
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
