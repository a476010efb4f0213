"""README's quick start, whole: an ordinary Ray Train script with raycomp in six lines.

    python examples/quickstart.py [--workers 2] [--epochs 3] [--storage /tmp/raycomp-runs]
    raycomp inspect /tmp/raycomp-runs/quickstart

The lines marked ``# raycomp:`` are the only ones that differ from the plain Ray Train
script, and each says what it replaced (tests/test_quickstart.py undoes them and checks
that what is left is that script). A synthetic ten-class task (noisy templates) stands in
for your data. The policy is the adaptive default: on this machine's own loopback the link
is fast, so the controller rightly keeps the plan dense and the log says why.
"""

from __future__ import annotations

import argparse

import ray
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import raycomp.train  # raycomp: added


def batches(rank: int, epoch: int, steps: int, batch: int = 64):
    """This rank's batches of one epoch: each class a fixed random template plus noise."""
    templates = torch.randn(10, 256, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1000 * epoch + rank)
    for _ in range(steps):
        y = torch.randint(0, 10, (batch,), generator=gen)
        yield templates[y] + 2.0 * torch.randn(batch, 256, generator=gen), y


def train_func(config: dict) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model = raycomp.train.prepare_model(model, optimizer)  # raycomp: was model = ray.train.torch.prepare_model(model)
    rank = ray.train.get_context().get_world_rank()
    for epoch in range(config["epochs"]):
        for x, y in batches(rank, epoch, config["steps_per_epoch"]):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            raycomp.train.step(loss, samples=len(y))  # raycomp: was optimizer.step()
        raycomp.train.report({"epoch": epoch, "loss": loss.item()})  # raycomp: was ray.train.report({"epoch": epoch, "loss": loss.item()})
    raycomp.train.finish()  # raycomp: added


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=100)
    parser.add_argument("--storage", default="/tmp/raycomp-runs", help="the Ray Train storage path")
    parser.add_argument("--name", default="quickstart", help="the run's name under the storage path")
    args = parser.parse_args(argv)
    ray.init(num_cpus=args.workers, include_dashboard=False)
    run_config = RunConfig(name=args.name, storage_path=args.storage, callbacks=[raycomp.train.ControllerCallback()])  # raycomp: was run_config = RunConfig(name=args.name, storage_path=args.storage)
    TorchTrainer(train_func, train_loop_config={"epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch},
                 scaling_config=ScalingConfig(num_workers=args.workers), run_config=run_config).fit()


if __name__ == "__main__":
    main()
