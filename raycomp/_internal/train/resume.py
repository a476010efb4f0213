"""A :class:`~raycomp.train.TrainLoop`'s own checkpoint state: what it saves beside the
model and optimizer, and how a restarted worker takes it back (files:
:mod:`raycomp._internal.train.checkpoint`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from raycomp._internal.train import checkpoint, resize
from raycomp.plan import Plan

if TYPE_CHECKING:
    from raycomp._internal.train.loop import TrainLoop

__all__ = ["forget_finished_run", "load_merged", "load_own", "own_state", "restore", "save_state"]

log = logging.getLogger("raycomp.train")

#: the checkpoints that runs finished in this worker process left: ``ray.train.get_checkpoint()``
#: returns the latest one reported in the training function, so a second run started in the
#: same function (a fine-tuning after a pre-training, say) would resume from the first's state
_finished_runs: set[str] = set()


def own_state(loop: TrainLoop) -> dict[str, Any]:
    """What only this rank holds: compression and error-feedback state, guard, the
    controller's plan, RNG, counters and the GradScaler's state (``rank<r>.pt``)."""
    return {
        "compression": loop.state.state_dict(), "guard": loop.guard.state_dict(),
        "controller_plan": loop.controller_plan.to_dict(), "rng": torch.get_rng_state(),
        "counters": {"plan_switches": loop.plan_switches, "outages": loop.outages.count,
                     "skipped_steps": loop.skipped_steps, "lr_ramp_from": loop.lr_ramp.started_at,
                     "loss_scale_overflows": loop.guard.overflows, "outer_steps": loop.outer_steps,
                     "local_skips": loop.local_skips},
        "grad_scaler": None if loop.grad_scaler is None else loop.grad_scaler.state_dict(),
        "preemption": loop.preemption.state_dict(),
        # during local steps every rank's weights and optimizer state are its own
        "replica": None if loop.strategy.per_step else {
            "model": getattr(loop.model, "module", loop.model).state_dict(),
            "optimizer": loop.optimizer.state_dict()},
    }


def load_own(loop: TrainLoop, own: dict[str, Any]) -> None:
    """Take back :func:`own_state`'s dictionary (the GradScaler's only if the loop holds one;
    the RNG's only if it holds one: a rank added by a resize keeps its own)."""
    loop.state.load_state_dict(own["compression"])
    loop.guard.load_state_dict(own["guard"])
    loop.controller_plan = Plan.from_dict(own["controller_plan"])
    if own.get("rng") is not None:
        torch.set_rng_state(own["rng"])
    counters = own["counters"]
    loop.plan_switches, loop.outages.count = counters["plan_switches"], counters["outages"]
    loop.skipped_steps, loop.lr_ramp.started_at = counters["skipped_steps"], counters["lr_ramp_from"]
    loop.guard.overflows = counters.get("loss_scale_overflows", 0)
    loop.outer_steps, loop.local_skips = counters.get("outer_steps", 0), counters.get("local_skips", 0)
    if loop.grad_scaler is not None and own.get("grad_scaler"):
        loop.grad_scaler.load_state_dict(own["grad_scaler"])
    loop.preemption.load_state_dict(own.get("preemption", {}))  # absent before notices were kept
    if own.get("replica") is not None:  # this rank's own weights (local steps)
        getattr(loop.model, "module", loop.model).load_state_dict(own["replica"]["model"])
        loop.optimizer.load_state_dict(own["replica"]["optimizer"])


def save_state(loop: TrainLoop, directory: Path) -> None:
    """Every rank's compression, guard and counters; the shards of a sharded model (a
    collective); rank 0's shared part through ``loop.save_shared``."""
    checkpoint.save_own(directory, loop.rank, own_state(loop))
    if loop.sharded:  # every rank writes its shards (a collective)
        checkpoint.save_sharded(directory, loop.model, loop.optimizer)
    if loop.rank == 0:
        loop.save_shared(directory)


def restore(loop: TrainLoop) -> None:
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
        meta, own = checkpoint.load(Path(directory), loop.rank, loop.world_size, loop.model,
                                    loop.optimizer, loop.scheduler, sharded=loop.sharded)
        relaid = own is not None and not loop.sharded and \
            resize.layout_of(own["compression"]) != resize.layout_of(loop.state.state_dict())
        if relaid:  # the same size, laid out otherwise (two levels, or other places): merged
            log.info("checkpoint rank %d's layout is not this rank's: merging every rank's state", loop.rank)
            own = None
        if own is None and (meta["world_size"] != loop.world_size or relaid):
            _resize(loop, Path(directory), meta)
        elif own is None:
            log.warning("checkpoint lacks rank %d's state: compression state starts fresh", loop.rank)
        else:
            load_own(loop, own)
    loop.global_step = loop.restored_from = meta["global_step"]
    log.info("resumed from step %d", loop.global_step)


def _resize(loop: TrainLoop, directory: Path, meta: dict[str, Any]) -> None:
    """Restore a checkpoint of ``meta["world_size"]`` workers on this loop's number."""
    old = int(meta["world_size"])
    olds = None if loop.sharded else checkpoint.load_all_own(directory, old)
    if olds is None:
        why = "a sharded run's residuals are laid out per shard" if loop.sharded else "a rank's file is missing"
        log.warning("checkpoint is from %d workers, now %d (%s): compression state starts fresh",
                    old, loop.world_size, why)
        return
    load_merged(loop, olds, meta["global_step"])


def load_merged(loop: TrainLoop, olds: list[dict[str, Any]], step: int) -> None:
    """Take back every old rank's :func:`own_state` (a checkpoint of ``len(olds)`` workers,
    written at ``step``) on this loop's number of workers, by :mod:`raycomp._internal.train.resize`'s
    rule; rank 0 logs what was merged."""
    merged = resize.merge_own(olds, loop.rank, loop.world_size, loop.options.seed, loop.strategy.layers())
    load_own(loop, merged)
    if any(own.get("replica") is not None for own in olds):
        _replica_from_global(loop)
    if loop.rank == 0:
        log.info("resized at step %d: %s", step, resize.summary(olds, loop.world_size))


def _replica_from_global(loop: TrainLoop) -> None:
    """Local steps were in force: this rank's weights become the global weights (the old
    ranks' own replicas are not carried over; see :mod:`raycomp._internal.train.resize`)."""
    steps = loop.state.steps
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
