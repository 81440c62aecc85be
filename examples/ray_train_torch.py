"""ringflow inside Ray Train: ``TorchTrainer`` runs the Horovod recipe on scikit-learn's digits.

    python examples/ray_train_torch.py [--num-workers 2] [--epochs 5] [--address auto]

Ray Train starts the workers and initialises torch.distributed (gloo) in each before the loop
runs. ``hvd.init()`` needs nothing more: it joins the world of that process group and meets the
other ranks in its store (detector ``torch``, ringflow/topology.py). Gradients are averaged by
``hvd.DistributedOptimizer``, not by DDP; the data are loaded and sharded as in
examples/pytorch_mnist.py. Every epoch, the ranks report their averaged metrics and rank 0 a
checkpoint, which Ray Train keeps in ``--storage-path``.

Without ``--address`` this starts a one-node Ray cluster on 127.0.0.1 (no dashboard); with
``--address auto`` it joins a running cluster, whose nodes must have ringflow and torch installed
(the driver reads the digits and hands them to the workers with the loop's config).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import digits  # examples/digits.py: scikit-learn's digits, read with numpy


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: the loop of examples/pytorch_mnist.py with a smaller model."""
    import ray.train
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ringflow.torch as hvd

    hvd.init()
    torch.manual_seed(config["seed"])
    torch.set_num_threads(1)  # one core per rank; the ranks share the machine

    x_tr, y_tr, x_te, y_te = (torch.from_numpy(a) for a in config["data"])
    train_set, test_set = TensorDataset(x_tr, y_tr), TensorDataset(x_te, y_te)
    train_sampler = hvd.DistributedSampler(train_set, shuffle=True, seed=config["seed"])
    train_loader = DataLoader(train_set, batch_size=config["batch_size"], sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256,
                             sampler=hvd.DistributedSampler(test_set, shuffle=False))

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"] * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    for epoch in range(1, config["epochs"] + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        total_loss, batches = 0.0, 0
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
            batches += 1
        model.eval()
        correct, seen = 0, 0
        with torch.no_grad():
            for data, target in test_loader:
                correct += int((model(data).argmax(1) == target).sum())
                seen += len(target)
        # Each rank saw its shard (padded to equal size by the sampler): average over ranks.
        metrics = {
            "epoch": epoch,
            "train_loss": float(hvd.allreduce(torch.tensor(total_loss / max(batches, 1)),
                                              name="train_loss")),
            "accuracy": float(hvd.allreduce(torch.tensor(correct / max(seen, 1)),
                                            name="accuracy")),
        }
        # Every rank reports (Ray Train waits for all); rank 0 alone hands over a checkpoint.
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if hvd.rank() == 0:
                torch.save(model.state_dict(), os.path.join(tmp, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
                print(f"epoch {epoch}: train loss {metrics['train_loss']:.4f}  test accuracy "
                      f"{metrics['accuracy']:.4f}", flush=True)
            ray.train.report(metrics, checkpoint=checkpoint)
    hvd.shutdown()


def main(argv: list[str] | None = None) -> float:
    """Train; returns the final test accuracy (uses the Ray cluster this process is connected
    to, if any)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--address", default=None,
                        help="a running Ray cluster ('auto'); default: start one on 127.0.0.1")
    parser.add_argument("--storage-path", default=None,
                        help="where Ray Train keeps checkpoints (default: ~/ray_results)")
    args = parser.parse_args(argv)

    if args.address is None:
        # Read when Ray is imported: without it Ray 2.60 replaces 127.0.0.1 by the address of
        # the default route's interface and its servers listen on every interface.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        if args.address:
            ray.init(address=args.address)
        else:
            ray.init(num_cpus=args.num_workers, include_dashboard=False,
                     _node_ip_address="127.0.0.1",
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    trainer = TorchTrainer(
        train_loop,
        # The digits travel with the config: the workers read no file and need no scikit-learn.
        train_loop_config={"data": digits.train_test(),
                           **{k: getattr(args, k) for k in ("epochs", "batch_size", "lr", "seed")}},
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False),
        run_config=RunConfig(name="ringflow-digits", storage_path=args.storage_path,
                             checkpoint_config=CheckpointConfig(num_to_keep=1)),
    )
    result = trainer.fit()
    accuracy = float(result.metrics["accuracy"])
    print(f"final test accuracy {accuracy:.4f} on {args.num_workers} Ray Train workers; "
          f"checkpoint in {result.checkpoint.path}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
