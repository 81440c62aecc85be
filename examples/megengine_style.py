"""MegEngine-style model parallelism: a two-stage net split over two processes with
``remote_send`` / ``remote_recv``, started by ``@ringflow.launcher``, on scikit-learn's digits.

    python examples/megengine_style.py                      # the launcher starts 2 processes
    ringflow-run -np 2 python examples/megengine_style.py   # or another launcher starts them
    python examples/megengine_style.py --single             # the same net in one process

    # two machines, the same program on each (a shared secret: RINGFLOW_SECRET_FILE)
    python examples/megengine_style.py --world-size 2 --n-gpus 1 --rank-start 0 \\
        --master-ip 10.0.0.1 --port 29500                                  # on 10.0.0.1
    python examples/megengine_style.py --world-size 2 --n-gpus 1 --rank-start 1 \\
        --master-ip 10.0.0.1 --port 29500                                  # on the other

MegEngine's guide, in ringflow:

- ``@dist.launcher(n_gpus=2)``               -> ``@ringflow.launcher(n_gpus=2)``
- ``dist.get_rank()`` / ``dist.get_client()`` -> ``ringflow.rank()`` / ``ringflow.get_client()``
- ``dist.bcast_list_(net.parameters())``     -> ``hvd.broadcast_parameters(net.parameters())``
- ``F.distributed.remote_send(feat, 1)``     -> ``token = hvd.remote_send(feat, 1)``
- ``gm.backward([])`` after a send           -> ``token.backward()``
- ``F.distributed.remote_recv(0, shape, dtype)`` -> ``hvd.remote_recv(0, shape, dtype)``

Rank 0 holds the features (a convolution), rank 1 the classifier and the loss. Both stages are
built on both ranks from one seed, so the run equals ``--single`` (one process, both stages)
to the last bit: the script prints the loss of every tenth step and the test accuracy, and a test
compares the two outputs.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import ringflow
import ringflow.torch as hvd

import digits  # examples/digits.py: scikit-learn's digits, read with numpy


def stages() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten())
    classifier = nn.Sequential(nn.Linear(8 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 10))
    return features, classifier


def data() -> tuple[torch.Tensor, ...]:
    images, labels = digits.load()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(labels)
    train, test = digits.split(len(y), 0.25)
    return x[train], x[test], y[train], y[test]


def batches(n: int, batch: int, epoch: int) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
    return [order[i:i + batch] for i in range(0, n - batch + 1, batch)]


def train(epochs: int, batch: int) -> list[str]:
    """The launched function: this rank's stage. Returns the lines the script prints."""
    torch.set_num_threads(1)
    rank, client = ringflow.rank(), ringflow.get_client()
    if ringflow.size() != 2:
        raise SystemExit(f"this example splits the net over 2 processes, not {ringflow.size()}")
    features, classifier = stages()
    # MegEngine's dist.bcast_list_: every rank starts from rank 0's parameters (they already
    # agree here, being seeded; a checkpoint loaded on rank 0 alone is where it matters).
    hvd.broadcast_parameters(p for stage in (features, classifier) for p in stage.parameters())
    mine = features if rank == 0 else classifier
    opt = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    x_train, x_test, y_train, y_test = data()
    lines, step = [], 0
    for epoch in range(epochs):
        for idx in batches(len(x_train), batch, epoch):
            opt.zero_grad()
            if rank == 0:
                feat = features(x_train[idx])
                if step == 0:  # MegEngine's example sends shape and dtype through the client
                    client.user_set("shape", tuple(feat.shape))
                    client.user_set("dtype", np.dtype("float32").name)
                token = hvd.remote_send(feat, dest_rank=1)
                token.backward()  # MegEngine's gm.backward([]): receives feat's gradient
            else:
                if step == 0:
                    feat = hvd.remote_recv(0, shape=client.user_get("shape"),
                                           dtype=client.user_get("dtype"))
                else:  # or leave them out: they travel with the message
                    feat = hvd.remote_recv(0)
                loss = F.cross_entropy(classifier(feat), y_train[idx])
                loss.backward()  # sends feat's gradient back to rank 0
                if step % 10 == 0:
                    lines.append(f"step {step} loss {loss.item()!r}")
            opt.step()
            step += 1
    with torch.no_grad():  # evaluation: the same pipeline, no gradients
        if rank == 0:
            hvd.remote_send(features(x_test), dest_rank=1)
        else:
            logits = classifier(hvd.remote_recv(0))
            correct = int((logits.argmax(1) == y_test).sum())
            client.user_set("accuracy", f"test accuracy {correct}/{len(y_test)}")
    lines.append(client.user_get("accuracy"))
    return lines


def single(epochs: int, batch: int) -> list[str]:
    """Both stages in one process: what the two processes must reproduce."""
    torch.set_num_threads(1)
    features, classifier = stages()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            for m in (features, classifier)]
    x_train, x_test, y_train, y_test = data()
    lines, step = [], 0
    for epoch in range(epochs):
        for idx in batches(len(x_train), batch, epoch):
            for opt in opts:
                opt.zero_grad()
            loss = F.cross_entropy(classifier(features(x_train[idx])), y_train[idx])
            loss.backward()
            if step % 10 == 0:
                lines.append(f"step {step} loss {loss.item()!r}")
            for opt in opts:
                opt.step()
            step += 1
    with torch.no_grad():
        correct = int((classifier(features(x_test)).argmax(1) == y_test).sum())
    lines.append(f"test accuracy {correct}/{len(y_test)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--single", action="store_true", help="both stages in this process")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--n-gpus", type=int, default=2, help="processes on this machine")
    parser.add_argument("--rank-start", type=int, default=0)
    parser.add_argument("--master-ip", default="localhost")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.single:
        lines = single(args.epochs, args.batch_size)
    else:
        launch = ringflow.launcher(world_size=args.world_size, n_gpus=args.n_gpus,
                                   rank_start=args.rank_start, master_ip=args.master_ip,
                                   port=args.port)
        results = launch(train)(args.epochs, args.batch_size)
        lines = results[-1]  # this machine's last rank: rank 1 where it runs here
    print("\n".join(lines))


if __name__ == "__main__":
    main()
