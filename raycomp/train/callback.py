"""The driver side: a Ray Train callback that starts (or finds) the controller service.

The one module of ``raycomp`` that imports ``controllers`` — lazily, on the driver, when the
callback is built — so that workers only ever hold an actor handle.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.train import UserCallback

from raycomp.config import ControllerSection

__all__ = ["ControllerCallback"]

log = logging.getLogger("raycomp.train")


class ControllerCallback(UserCallback):
    """Put it in ``RunConfig(callbacks=[...])``; built on the driver before ``fit()``.

    Args:
        controller: which service (``name``, ``namespace``), its snapshots, restarts and
            metrics endpoint; the workers' :class:`~raycomp.train.TrainOptions` must name the
            same service (both default to ``raycomp-controller`` in ``raycomp``).
        snapshot_dir: where the service keeps its state across restarts (default: the
            section's ``snapshot_dir``; None: in memory only).
    """

    def __init__(self, controller: ControllerSection | None = None, snapshot_dir: str | None = None) -> None:
        from raycomp.controllers.service import get_or_create
        from raycomp.metrics import SD_DIR

        c = controller or ControllerSection()
        metrics = {"host": c.metrics_host, "port": c.metrics_port,
                   "sd_file": c.metrics_sd_file or f"{SD_DIR}/{c.name}.json"} if c.metrics_enabled else None
        self.name, self.namespace = c.name, c.namespace
        self.actor = get_or_create(c.name, c.namespace, snapshot_dir or c.snapshot_dir, c.max_restarts,
                                   c.finished_run_grace_s, metrics)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        for rank, error in sorted(worker_exceptions.items()):
            log.warning("rank %d failed: %s", rank, error)
