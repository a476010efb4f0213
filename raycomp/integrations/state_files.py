"""raycomp's own checkpoint state beside a framework's checkpoint.

The framework checkpoints the model, the optimizer, its scheduler, its GradScaler and its
loop counters; what only raycomp holds is per rank (error-feedback residuals, compressor
state, the guard, the controller's plan, counters; :func:`raycomp._internal.train.resume.own_state`),
so every rank writes its own file into a directory beside the framework's files::

    <directory>/rank<r>.pt     every rank
    <directory>/meta.json      rank 0: {"global_step", "world_size"}

Ray Train gathers what every rank reported into one checkpoint, as it does for raycomp's
own checkpoints. A restarted worker reads its rank's file back where the framework resumes
from (:func:`load_state`) and the loop takes it in its constructor (:func:`resume_with`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from raycomp._internal.train import checkpoint
from raycomp._internal.train.resume import load_merged, load_own, own_state
from raycomp._internal.train.run_state import RankParts
from raycomp.train import TrainLoop

__all__ = ["OLD_RANKS", "load_state", "resume_with", "save_state"]

log = logging.getLogger("raycomp.train")

#: the key of :func:`load_state`'s answer for a checkpoint of another number of workers:
#: every old rank's state, merged by :func:`resume_with`'s loop (raycomp._internal.train.resize)
OLD_RANKS = "old_ranks"


def save_state(loop: TrainLoop, directory: Path) -> None:
    """This rank's raycomp state into ``directory`` (created); rank 0 also ``meta.json``.
    A sync of local steps still on the wire finishes first (:meth:`TrainLoop.drain`)."""
    loop.drain()
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint.save_own(directory, loop.rank, own_state(loop.parts()))
    if loop.rank == 0:
        meta = {"global_step": loop.global_step, "world_size": loop.world_size}
        checkpoint.atomic_write(directory / checkpoint.META, lambda p: p.write_text(json.dumps(meta)))


def load_state(directory: Path, rank: int, world_size: int) -> dict[str, Any] | None:
    """This rank's state from :func:`save_state`'s ``directory``; None (with a warning) when
    the checkpoint holds none. Written by another number of workers (an elastic resize):
    ``{OLD_RANKS: [every old rank's state]}``, which :func:`resume_with` merges."""
    own, meta = directory / f"rank{rank}.pt", directory / checkpoint.META
    if not meta.exists():
        log.warning("the checkpoint holds no raycomp state in %s: compression state starts fresh", directory)
        return None
    written_by = json.loads(meta.read_text())["world_size"]
    if written_by != world_size:
        olds = checkpoint.load_all_own(directory, written_by)
        if olds is None:
            log.warning("checkpoint is from %d workers, now %d, and lacks a rank's state: compression state "
                        "starts fresh", written_by, world_size)
        return None if olds is None else {OLD_RANKS: olds}
    if not own.exists():
        log.warning("the checkpoint holds no raycomp state in %s: compression state starts fresh", directory)
        return None
    return torch.load(own, weights_only=False)


def resume_with(own: dict[str, Any] | None, global_step: int) -> Callable[[RankParts], None]:
    """A ``TrainLoop(resume=...)`` that continues at the framework's ``global_step`` (its
    optimizer steps, which are raycomp's steps) with ``own`` (:func:`load_state`) if any."""

    def resume(parts: RankParts) -> None:
        if own is not None and OLD_RANKS in own:
            load_merged(parts, own[OLD_RANKS], global_step)
        elif own is not None:
            load_own(parts, own)
        parts.progress.global_step = parts.progress.restored_from = global_step
        log.info("resumed from step %d", global_step)

    return resume
