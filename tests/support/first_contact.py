"""A new user's two silent mistakes in one small Ray Train run (tests/test_first_contact.py):
``ray.train.report(..., checkpoint=...)`` where ``raycomp.train.report`` was meant, and a
training function that returns without ``raycomp.train.finish()``.

Both warnings are written where the test reads them after ``fit()``: the worker's
(``raycomp.train`` logger, in the training function) to ``<output>/rank<r>.warnings``, the
Ray Train controller's (:class:`RecordingCallback`, the real callback with a file handler
added where it runs) to its ``log_file``.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

import raycomp.train

__all__ = ["RecordingCallback", "forgetful_train_func", "warnings_in"]

STEPS = 4


class RecordingCallback(raycomp.train.ControllerCallback):
    """:class:`raycomp.train.ControllerCallback` whose ``raycomp.train`` warnings, on the
    Ray Train controller that runs it, also go to ``log_file``."""

    def __init__(self, controller: Any, log_file: str) -> None:
        super().__init__(controller)
        self.log_file = log_file

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        _log_to(self.log_file)
        super().after_report(run_context, metrics, checkpoint)


def _log_to(path: str) -> None:
    logger = logging.getLogger("raycomp.train")
    if not any(getattr(h, "baseFilename", None) == str(Path(path).resolve()) for h in logger.handlers):
        logger.addHandler(logging.FileHandler(path))


def warnings_in(path: Path) -> list[str]:
    """The lines a :func:`_log_to` file holds (none if it was never written)."""
    return path.read_text().splitlines() if path.exists() else []


def forgetful_train_func(config: dict) -> dict:
    """A few steps; raycomp's own checkpoint, a report without one, then twice a checkpoint
    of rank 0's own files through ``ray.train.report``; returns without ``finish()``."""
    import ray.train

    from raycomp.config import ControllerSection

    rank = ray.train.get_context().get_world_rank()
    _log_to(f"{config['output_dir']}-rank{rank}.warnings")
    options = raycomp.train.TrainOptions(controller=ControllerSection(name=config["controller"], interval_steps=2),
                                         output_dir=config["output_dir"])
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
        loss.backward()
        raycomp.train.step(loss, samples=8)
    raycomp.train.report({"report": 0}, checkpoint=True)  # raycomp's own: no warning
    ray.train.report({"report": 1})  # no checkpoint: no warning
    for report in (2, 3):  # the mistake, twice: warned once
        with tempfile.TemporaryDirectory() as mine:
            (Path(mine) / "user.txt").write_text(f"report {report}")
            ray.train.report({"report": report},
                             checkpoint=ray.train.Checkpoint.from_directory(mine) if rank == 0 else None)
    return {"rank": rank}  # the mistake: no raycomp.train.finish()
