"""A small Lightning classifier on noisy class templates, its data, a Lightning trainer on
Ray Train's environment and raycomp's options, for the tests that run Lightning
(tests/test_lightning.py, tests/test_lightning_local.py, the switched testbed's
tests/support/switch_frameworks.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

FEATURES, CLASSES, BATCH = 32, 8, 16
TRAIN, VAL = 512, 256  # per epoch: 512 / (2 ranks x 16) = 16 steps


class Classifier(pl.LightningModule):
    """A small MLP; rank ``nan_rank``'s loss is NaN at global step ``nan_at`` (a fault)."""

    def __init__(self, lr: float = 0.05, nan_at: int | None = None, nan_rank: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in every fit
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES))
        self.lr, self.nan_at, self.nan_rank = lr, nan_at, nan_rank

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.trainer.global_step == self.nan_at and self.global_rank == self.nan_rank:
            loss = loss * float("nan")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loaders(seed: int = 0, batch: int = BATCH) -> tuple:
    """Noisy class templates; ``seed`` draws the training set (the validation set is fixed)."""
    templates = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(123))

    def draw(n: int, gen: torch.Generator) -> torch.utils.data.TensorDataset:
        y = torch.randint(0, CLASSES, (n,), generator=gen)
        return torch.utils.data.TensorDataset(templates[y] + 1.5 * torch.randn(n, FEATURES, generator=gen), y)

    train = draw(TRAIN, torch.Generator().manual_seed(seed))
    val = draw(VAL, torch.Generator().manual_seed(999))
    return (torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True),
            torch.utils.data.DataLoader(val, batch_size=64))


def lightning_trainer(strategy, epochs: int, callbacks=(), plugins=(), **kwargs) -> pl.Trainer:
    from ray.train.lightning import RayLightningEnvironment, prepare_trainer

    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices="auto", strategy=strategy,
                         plugins=[RayLightningEnvironment(), *plugins], callbacks=list(callbacks),
                         enable_progress_bar=False, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **kwargs)
    return prepare_trainer(trainer)


def options(config: dict, run: str, **compression):
    import raycomp.train
    from raycomp.config import CompressionSection, ControllerSection

    return raycomp.train.TrainOptions(
        compression=CompressionSection(**compression),
        controller=ControllerSection(name=config["controller"], interval_steps=2),
        output_dir=f"{config['output_dir']}/{run}", run_id=f"{run}-{config['controller']}")


def static(name: str, warmup: int = 0, **params) -> dict:
    """``compression`` options: the static policy with one compressor, after ``warmup`` dense steps."""
    from raycomp.config import compressor
    from raycomp.controllers.policies import StaticOptions

    return {"policy": "static", "warmup_steps": warmup, "static": StaticOptions(compressor=compressor(name, **params))}
