"""ringflow under Spark: ``TorchDistributor`` runs the Horovod recipe on scikit-learn's digits.

    python examples/spark_torch_distributor.py [--num-processes 2] [--epochs 5]

``TorchDistributor(local_mode=True)`` pickles ``train`` and starts it in ``num_processes``
processes on the driver's host with torchrun (``--standalone``), which sets torch's environment
contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of its agent
store, ``TORCHELASTIC_RUN_ID``). ``hvd.init()`` needs nothing more: it joins through torchrun's
store (detector ``torchrun``, ringflow/topology.py). On a Spark cluster, ``local_mode=False``
runs one barrier task per process, each a torchrun node of one process; ``train`` stays as it is
(tests/engines/test_spark.py runs that mode on ``local[2]``). Data, model and optimizer as in
examples/ray_train_torch.py.

This starts a local Spark session on 127.0.0.1 without its web UI, or uses the active session
when there is one. torchrun's agent store listens on every interface (torch's choice), as it
does for any torchrun job.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import digits  # examples/digits.py: scikit-learn's digits, read with numpy


def train(data: tuple[Any, ...], epochs: int, batch_size: int, lr: float, seed: int) -> float:
    """One process of the job; returns the test accuracy averaged over the ranks.

    TorchDistributor returns what this returns; in local mode every rank writes it to the same
    file, so it must be a value all ranks agree on (an allreduced metric is)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ringflow.torch as hvd

    hvd.init()
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # one core per rank; the ranks share the machine

    x_tr, y_tr, x_te, y_te = (torch.from_numpy(a) for a in data)
    train_set, test_set = TensorDataset(x_tr, y_tr), TensorDataset(x_te, y_te)
    train_sampler = hvd.DistributedSampler(train_set, shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256,
                             sampler=hvd.DistributedSampler(test_set, shuffle=False))

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    accuracy = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
        model.eval()
        correct, seen = 0, 0
        with torch.no_grad():
            for data, target in test_loader:
                correct += int((model(data).argmax(1) == target).sum())
                seen += len(target)
        accuracy = float(hvd.allreduce(torch.tensor(correct / max(seen, 1)), name="accuracy"))
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()
    return accuracy


def main(argv: list[str] | None = None) -> float:
    """Train; returns the final test accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)

    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    owned = spark is None
    if owned:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # read when the JVM starts
        spark = (SparkSession.builder.master(f"local[{args.num_processes}]")
                 .appName("ringflow-digits")
                 .config("spark.driver.host", "127.0.0.1")
                 .config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.ui.enabled", "false")
                 .getOrCreate())
    try:
        distributor = TorchDistributor(num_processes=args.num_processes, local_mode=True,
                                       use_gpu=False)
        # The digits travel with the call: the processes need no scikit-learn.
        accuracy = distributor.run(train, digits.train_test(), args.epochs, args.batch_size,
                                   args.lr, args.seed)
    finally:
        if owned:
            spark.stop()
    print(f"final test accuracy {accuracy:.4f} on {args.num_processes} processes", flush=True)
    return float(accuracy)


if __name__ == "__main__":
    main()
