"""Your LightningModule on Ray Train, with adaptive gradient compression from raycomp.

    pip install "./raycomp[lightning]"    # from a checkout, or the wheel (README: Install)
    python examples/lightning_ray_train.py --workers 2 --epochs 3

Ray's recipe for Lightning (``TorchTrainer``, ``RayLightningEnvironment``,
``RayTrainReportCallback``, ``prepare_trainer``, resuming from ``ray.train.get_checkpoint()``)
with the lines marked ``# raycomp`` changed: ``RaycompStrategy`` in place of
``RayDDPStrategy``, and the controller's callback in the ``RunConfig``. Lightning keeps its
loop, its optimizer step, gradient accumulation and mixed precision; raycomp compresses
the gradients as the controller decides, falls back to dense when training goes wrong,
and checkpoints its state beside Lightning's. Copy it and put your model and data in.

The policy is raycomp's default, ``adaptive``: it times the link and compresses only where
that saves time, so on one machine's loopback it rightly stays dense. ``--bandwidth``
(bytes/s per rank, e.g. 12.5e6 for 100 Mbit/s) has it plan for a slower link instead.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import lightning.pytorch as pl
import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback, prepare_trainer
from ray.train.torch import TorchTrainer
from torch import nn

import raycomp.train  # raycomp
from raycomp.config import AdaptiveOptions, CompressionSection, ControllerSection  # raycomp
from raycomp.integrations.lightning import RaycompStrategy  # raycomp


class ConvNet(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def synthetic(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Ten classes of 16x16 images, each a noisy template."""
    templates = torch.randn(10, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=gen)
    return torch.utils.data.TensorDataset(3 * templates[y] + torch.randn(n, 1, 16, 16, generator=gen), y)


def train_func(config: dict) -> dict:
    torch.manual_seed(0)  # the same initial weights on every rank
    train = torch.utils.data.DataLoader(synthetic(config["samples"], seed=1), batch_size=32, shuffle=True)
    val = torch.utils.data.DataLoader(synthetic(512, seed=2), batch_size=128)
    strategy = RaycompStrategy(raycomp.train.TrainOptions(  # raycomp: was RayDDPStrategy()
        compression=CompressionSection(warmup_steps=5, adaptive=AdaptiveOptions(bandwidth=config["bandwidth"])),
        controller=ControllerSection(name=config["controller"], interval_steps=5),
        output_dir=config["output_dir"], progress_every=10), monitor="val_accuracy")
    trainer = pl.Trainer(max_epochs=config["epochs"], accelerator="cpu", devices="auto", strategy=strategy,
                         plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback()],
                         precision=config["precision"], accumulate_grad_batches=config["accumulate"],
                         enable_progress_bar=False, enable_checkpointing=False, logger=False)
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint()  # a restarted worker group resumes from the latest one
    if checkpoint is None:
        trainer.fit(ConvNet(), train, val)
    else:
        with checkpoint.as_directory() as directory:
            trainer.fit(ConvNet(), train, val, ckpt_path=os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME))
    return {**strategy.totals, "val_accuracy": float(trainer.callback_metrics["val_accuracy"])}  # raycomp: totals


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1536, help="training images (all ranks)")
    parser.add_argument("--precision", default="32-true", help="Lightning's: 32-true, bf16-mixed, 16-mixed")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="link bytes/s per rank to plan for (default: measured)")
    parser.add_argument("--storage", default=tempfile.mkdtemp(prefix="raycomp-example-"))
    parser.add_argument("--name", default="lightning-example")
    parser.add_argument("--controller", default="raycomp-controller")
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        ray.init()
    controller = ControllerSection(name=args.controller, metrics_enabled=False)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "samples": args.samples, "precision": args.precision,
                           "accumulate": args.accumulate, "bandwidth": args.bandwidth, "controller": args.controller,
                           "output_dir": f"{args.storage}/{args.name}"},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(name=args.name, storage_path=args.storage,
                             callbacks=[raycomp.train.ControllerCallback(controller)]))  # raycomp
    totals = trainer.fit().return_value
    print(f"accuracy {totals['val_accuracy']:.3f}, {totals['steps']} steps, compression "
          f"{totals['dense_bytes_total'] / max(1.0, totals['wire_bytes_total']):.1f}x, "
          f"plan switches {totals['plan_switches']}")
    return totals


if __name__ == "__main__":
    main()
