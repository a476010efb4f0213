"""A :class:`~raycomp.train.TrainLoop`'s own checkpoint state: what it saves beside the
model and optimizer, and how a restarted worker takes it back (files:
:mod:`raycomp._internal.train.checkpoint`). It reads and restores the loop's parts, as the
loop hands them over (:class:`~raycomp._internal.train.run_state.RankParts`), not the loop."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from raycomp._internal.train import checkpoint, resize
from raycomp._internal.train.run_state import RankParts

__all__ = ["forget_finished_run", "load_merged", "load_own", "own_state", "restore", "save_state"]

log = logging.getLogger("raycomp.train")

#: the checkpoints that runs finished in this worker process left: ``ray.train.get_checkpoint()``
#: returns the latest one reported in the training function, so a second run started in the
#: same function (a fine-tuning after a pre-training, say) would resume from the first's state
_finished_runs: set[str] = set()


def own_state(parts: RankParts) -> dict[str, Any]:
    """What only this rank holds: compression and error-feedback state, guard (with the late
    losses waiting for an agreement), the controller's plan, RNG, counters and the
    GradScaler's state (``rank<r>.pt``)."""
    model, progress, handoff = parts.strategy.model, parts.progress, parts.handoff.state_dict()
    return {
        "compression": parts.strategy.state.state_dict(), "guard": {**parts.judge.state_dict(), "late": handoff["late"]},
        "controller_plan": handoff["controller_plan"], "rng": torch.get_rng_state(),
        "counters": {"plan_switches": handoff["switches"], "outages": parts.outages.count,
                     "skipped_steps": progress.skipped_steps, "lr_ramp_from": parts.lr_ramp.started_at,
                     "loss_scale_overflows": parts.judge.overflows, "outer_steps": progress.outer_steps,
                     "local_skips": progress.local_skips},
        "grad_scaler": None if parts.grad_scaler is None else parts.grad_scaler.state_dict(),
        "preemption": parts.preemption.state_dict(),
        # during local steps every rank's weights and optimizer state are its own
        "replica": None if parts.strategy.per_step else {
            "model": getattr(model, "module", model).state_dict(),
            "optimizer": parts.optimizer.state_dict()},
    }


def load_own(parts: RankParts, own: dict[str, Any]) -> None:
    """Take back :func:`own_state`'s dictionary (the GradScaler's only if the loop holds one;
    the RNG's only if it holds one: a rank added by a resize keeps its own)."""
    parts.strategy.state.load_state_dict(own["compression"])
    parts.judge.load_state_dict(own["guard"])
    counters, progress = own["counters"], parts.progress
    # a checkpoint from before late losses: none
    parts.handoff.load_state_dict({"controller_plan": own["controller_plan"], "switches": counters["plan_switches"],
                                   "late": own["guard"].get("late", ())})
    if own.get("rng") is not None:
        torch.set_rng_state(own["rng"])
    parts.outages.count = counters["outages"]
    progress.skipped_steps, parts.lr_ramp.started_at = counters["skipped_steps"], counters["lr_ramp_from"]
    parts.judge.overflows = counters.get("loss_scale_overflows", 0)
    progress.outer_steps, progress.local_skips = counters.get("outer_steps", 0), counters.get("local_skips", 0)
    if parts.grad_scaler is not None and own.get("grad_scaler"):
        parts.grad_scaler.load_state_dict(own["grad_scaler"])
    parts.preemption.load_state_dict(own.get("preemption", {}))  # absent before notices were kept
    if own.get("replica") is not None:  # this rank's own weights (local steps)
        model = parts.strategy.model
        getattr(model, "module", model).load_state_dict(own["replica"]["model"])
        parts.optimizer.load_state_dict(own["replica"]["optimizer"])


def save_state(parts: RankParts, directory: Path) -> None:
    """Every rank's compression, guard and counters, and the shards of a sharded model (a
    collective). Rank 0's shared part follows: :func:`save_shared`."""
    checkpoint.save_own(directory, parts.rank, own_state(parts))
    if parts.strategy.sharded:  # every rank writes its shards (a collective)
        checkpoint.save_sharded(directory, parts.strategy.model, parts.optimizer)


def save_shared(parts: RankParts, directory: Path) -> None:
    """Rank 0's part of a checkpoint: the model (unless sharded), optimizer, scheduler, step."""
    progress, strategy = parts.progress, parts.strategy
    meta = {"global_step": progress.global_step, "epoch": progress.epoch, "world_size": parts.world_size}
    checkpoint.save_shared(directory, None if strategy.sharded else strategy.model, parts.optimizer, parts.scheduler,
                           meta)


def restore(parts: RankParts) -> None:
    """Take back ``ray.train.get_checkpoint()``'s state, if it holds raycomp's. From the same
    number of workers every rank takes its own file back (bit for bit); from another number
    (an elastic resize) every rank merges all the old ranks' files by
    :mod:`raycomp._internal.train.resize`'s rule (a sharded run's compression state starts fresh)."""
    import ray.train

    found = ray.train.get_checkpoint()
    if found is None:
        return
    if found.path in _finished_runs:
        log.info("the latest checkpoint is a finished run's of this training function: starting fresh")
        return
    with found.as_directory() as directory:
        if not (Path(directory) / checkpoint.META).exists():
            log.warning("the checkpoint holds no raycomp state: starting fresh")
            return
        strategy = parts.strategy
        meta, own = checkpoint.load(Path(directory), parts.rank, parts.world_size, strategy.model,
                                    parts.optimizer, parts.scheduler, sharded=strategy.sharded)
        relaid = own is not None and not strategy.sharded and \
            resize.layout_of(own["compression"]) != resize.layout_of(strategy.state.state_dict())
        if relaid:  # the same size, laid out otherwise (two levels, or other places): merged
            log.info("checkpoint rank %d's layout is not this rank's: merging every rank's state", parts.rank)
            own = None
        if own is None and (meta["world_size"] != parts.world_size or relaid):
            _resize(parts, Path(directory), meta)
        elif own is None:
            log.warning("checkpoint lacks rank %d's state: compression state starts fresh", parts.rank)
        else:
            load_own(parts, own)
    parts.progress.global_step = parts.progress.restored_from = meta["global_step"]
    log.info("resumed from step %d", parts.progress.global_step)


def _resize(parts: RankParts, directory: Path, meta: dict[str, Any]) -> None:
    """Restore a checkpoint of ``meta["world_size"]`` workers on this loop's number."""
    old, sharded = int(meta["world_size"]), parts.strategy.sharded
    olds = None if sharded else checkpoint.load_all_own(directory, old)
    if olds is None:
        why = "a sharded run's residuals are laid out per shard" if sharded else "a rank's file is missing"
        log.warning("checkpoint is from %d workers, now %d (%s): compression state starts fresh",
                    old, parts.world_size, why)
        return
    load_merged(parts, olds, meta["global_step"])


def load_merged(parts: RankParts, olds: list[dict[str, Any]], step: int) -> None:
    """Take back every old rank's :func:`own_state` (a checkpoint of ``len(olds)`` workers,
    written at ``step``) on this loop's number of workers, by :mod:`raycomp._internal.train.resize`'s
    rule; rank 0 logs what was merged."""
    merged = resize.merge_own(olds, parts.rank, parts.world_size, parts.seed, parts.strategy.layers())
    load_own(parts, merged)
    if any(own.get("replica") is not None for own in olds):
        _replica_from_global(parts)
    if parts.rank == 0:
        log.info("resized at step %d: %s", step, resize.summary(olds, parts.world_size))


def _replica_from_global(parts: RankParts) -> None:
    """Local steps were in force: this rank's weights become the global weights (the old
    ranks' own replicas are not carried over; see :mod:`raycomp._internal.train.resize`)."""
    steps = parts.strategy.state.steps
    with torch.no_grad():
        for param, global_param in zip(steps.params, steps.global_params, strict=True):
            param.copy_(global_param)


def forget_finished_run() -> None:
    """When a run finishes: the checkpoint it leaves is not for a later run of the same
    training function to resume from (:func:`restore` starts that one fresh)."""
    import ray.train

    found = ray.train.get_checkpoint()
    if found is not None:
        _finished_runs.add(found.path)
