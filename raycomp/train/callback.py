"""The driver side: a Ray Train callback that starts (or finds) the controller service.

The one module of ``raycomp`` that imports ``controllers`` — lazily, on the driver, when the
callback is built — so that workers only ever hold an actor handle.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ray.train import UserCallback

from raycomp.config import ControllerSection

__all__ = ["ControllerCallback"]

log = logging.getLogger("raycomp.train")

#: a rank's own file of raycomp's state in a checkpoint (:mod:`raycomp._internal.train.checkpoint`,
#: :mod:`raycomp.integrations.state_files`): every rank writes one, whoever reports
_RANK_FILE = re.compile(r"^rank\d+\.pt$")


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
        from raycomp._internal.observe.metrics import SD_DIR
        from raycomp.controllers.service import get_or_create

        c = controller or ControllerSection()
        metrics = {"host": c.metrics_host, "port": c.metrics_port,
                   "sd_file": c.metrics_sd_file or f"{SD_DIR}/{c.name}.json"} if c.metrics_enabled else None
        self.name, self.namespace = c.name, c.namespace
        self._warned_plain_report = False
        self.actor = get_or_create(c.name, c.namespace, snapshot_dir or c.snapshot_dir, c.max_restarts,
                                   c.finished_run_grace_s, metrics)

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        """A checkpoint reported without raycomp's state (``ray.train.report(...,
        checkpoint=...)`` called where ``raycomp.train.report`` was meant): warned once per
        run, on the Ray Train controller, whose log reaches the driver's console."""
        if checkpoint is None or getattr(self, "_warned_plain_report", False) or _holds_raycomp_state(checkpoint):
            return
        self._warned_plain_report = True
        log.warning("a checkpoint without raycomp's state was reported (%s): ray.train.report(..., checkpoint=...) "
                    "saves only your files, so a restart from it starts compression and error feedback afresh. "
                    "Call raycomp.train.report(metrics, checkpoint=...) instead, on every rank: it keeps your files "
                    "and adds raycomp's (or call raycomp.train.save_state(directory) before ray.train.report). "
                    "Warned once per run", checkpoint.path)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        for rank, error in sorted(worker_exceptions.items()):
            log.warning("rank %d failed: %s", rank, error)


def _holds_raycomp_state(checkpoint: Any) -> bool:
    """Whether a reported checkpoint holds raycomp's files (at its top, as
    ``raycomp.train.report`` and ``save_state`` write them, or in a folder of it, as the
    framework integrations do). True when it cannot be listed: no warning on a guess."""
    try:
        from pyarrow.fs import FileSelector

        found = checkpoint.filesystem.get_file_info(FileSelector(checkpoint.path, recursive=True))
        return any(_RANK_FILE.match(info.base_name) for info in found)
    except Exception:  # noqa: BLE001 - storage we cannot list: stay quiet
        return True
