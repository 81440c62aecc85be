"""Driver of tests/engines/test_spark.py: one local Spark session on 127.0.0.1 (``local[2]``, no
web UI) and ``TorchDistributor(num_processes=2, use_gpu=False)`` runs in it.

    python spark_driver.py PHASE...

Phases (workers/phases.py):

- ``function``: ``run(checks_fn, 2)``: each process calls ``ringflow.init()`` unchanged, then
  job.checks (exact collectives, the key-value client, training equal to one process on the
  global batch) and returns every rank's PASS line (gathered through the key-value client: in
  local mode every rank writes its result to the same file); the driver prints them.
- ``file``: ``run(job.py, "--size", "2", "--train")``, torchrun on job.py itself.
- ``barrier``: ``run(checks_fn, 2)`` with ``local_mode=False``, as on a cluster: two barrier
  tasks each run torchrun as one node of one process (``--nnodes 2``, c10d rendezvous at task
  0's address); the session's ``local[2]`` master gives the two slots.
- ``example``: examples/spark_torch_distributor.py for 2 epochs, in this session.

Run it inside a network namespace that has only a loopback interface: torchrun's stores and, in
barrier mode, TorchDistributor's log streaming server (0.0.0.0, hard-coded in pyspark 4.3)
listen on every interface.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from phases import run_phases

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
EXAMPLES = ROOT / "examples"
PROCESSES = 2


def checks_fn(size: int) -> list[str]:
    import job

    import ringflow

    ringflow.init()
    line = job.checks(ringflow, size=size, train=True)
    client = ringflow.get_client()
    client.user_set(f"pass.{ringflow.rank()}", line)
    lines = [client.user_get(f"pass.{r}") for r in range(ringflow.size())]
    ringflow.shutdown()
    return lines


def main() -> int:
    # torchrun and its workers inherit this process's environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [
        str(ROOT), str(HERE), str(EXAMPLES), os.environ.get("PYTHONPATH")]))
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{PROCESSES}]").appName("ringflow-test")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false")
             # A short-lived JVM: C1 alone and one GC thread halve its CPU (15 -> 7 s a session).
             .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
             .getOrCreate())

    def distributor(local_mode: bool = True) -> TorchDistributor:
        return TorchDistributor(num_processes=PROCESSES, local_mode=local_mode, use_gpu=False)

    def function() -> None:
        for line in distributor().run(checks_fn, PROCESSES):
            print(line, flush=True)

    def file() -> None:
        distributor().run(str(HERE / "job.py"), "--size", str(PROCESSES), "--train")

    def barrier() -> None:
        for line in distributor(local_mode=False).run(checks_fn, PROCESSES):
            print(line, flush=True)

    def example() -> None:
        sys.path.insert(0, str(EXAMPLES))
        import spark_torch_distributor

        accuracy = spark_torch_distributor.main(["--num-processes", str(PROCESSES),
                                                 "--epochs", "2"])
        print(f"EXAMPLE accuracy {accuracy:.4f}", flush=True)

    try:
        return run_phases({"function": function, "file": file, "barrier": barrier,
                           "example": example},
                          sys.argv[1:])
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
