"""Your own model on Ray Train, with adaptive gradient compression from raycomp.

    python examples/ray_train_resnet.py --workers 2 --epochs 3

A small ResNet-style CNN with BatchNorm on synthetic 16x16 images (ten classes, each a
noisy template), trained data-parallel by ``TorchTrainer`` under raycomp's default
(adaptive) policy. raycomp adds three lines to an ordinary training function
(``prepare_model``, ``step``, ``report``) and a callback that starts the controller
service. ``report`` records the accuracy as an evaluation (``evals.jsonl``, and the
controller sees it) and checkpoints in the last epoch. Copy it and put your model and data in.
"""

from __future__ import annotations

import argparse
import tempfile

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn

import raycomp.train
from raycomp.config import CompressionSection, ControllerSection


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def resnet(channels: int = 16, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
        Block(channels), nn.MaxPool2d(2), Block(channels),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


def synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    templates = torch.randn(10, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=gen)
    return 3 * templates[y] + torch.randn(n, 1, 16, 16, generator=gen), y


def train_func(config: dict) -> dict:
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = resnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = raycomp.train.TrainOptions(  # the adaptive policy; a short warm-up for a short run
        compression=CompressionSection(warmup_steps=5),
        controller=ControllerSection(name=config["controller"], interval_steps=5),
        output_dir=config["output_dir"], progress_every=10)
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    loop = raycomp.train.current()
    train_x, train_y = synthetic(4096, seed=1)
    test_x, test_y = synthetic(512, seed=2)
    steps, batch = config["steps_per_epoch"], 32
    for epoch in loop.epochs(config["epochs"], steps):  # a restarted worker resumes at its checkpoint
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(epoch))
        for step in range(loop.step_in_epoch, steps):
            idx = order[step * batch * world:(step + 1) * batch * world][rank::world]  # this rank's share
            loss = nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
            loss.backward()
            raycomp.train.step(loss, samples=len(idx))  # guard, optimizer step, control boundary
        model.eval()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        model.train()
        raycomp.train.report({"accuracy": accuracy})  # an evaluation; in the last epoch, a checkpoint
    return {**raycomp.train.finish(), "accuracy": accuracy}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--storage", default=tempfile.mkdtemp(prefix="raycomp-example-"))
    parser.add_argument("--name", default="resnet-example")
    parser.add_argument("--controller", default="raycomp-controller")
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        ray.init()
    controller = ControllerSection(name=args.controller, metrics_enabled=False)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch,
                           "controller": args.controller, "output_dir": f"{args.storage}/{args.name}"},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(name=args.name, storage_path=args.storage,
                             callbacks=[raycomp.train.ControllerCallback(controller)]))
    totals = trainer.fit().return_value
    print(f"accuracy {totals['accuracy']:.3f}, {totals['steps']} steps, compression "
          f"{totals['dense_bytes_total'] / max(1.0, totals['wire_bytes_total']):.1f}x, "
          f"plan switches {totals['plan_switches']}; last plan: {totals['final_plan']['reason']}")
    return totals


if __name__ == "__main__":
    main()
