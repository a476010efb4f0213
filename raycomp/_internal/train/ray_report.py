"""What a rank hands Ray Train and the training function beyond its steps: the metrics of
``ray.train.report`` (with the run's byte totals so far), the checkpoint that goes with
one, the evaluation value a report carries, and the run's totals at the end
(:meth:`raycomp._internal.train.loop.TrainLoop.report`, :meth:`~raycomp._internal.train.loop.TrainLoop.totals`)."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raycomp._internal.train.run_state import RankParts, StepClock
from raycomp._internal.wire.ledger import WireLedger

__all__ = ["any_rank", "check_report_checkpoint", "eval_value", "report_metrics", "report_to_ray", "run_totals"]


def report_metrics(metrics: dict[str, Any], epoch: int, step: int, ledger: WireLedger,
                   world_size: int) -> dict[str, Any]:
    """``metrics`` with the epoch and the step (unless they hold their own) and the byte
    totals so far added."""
    return {"epoch": epoch, "step": step, **metrics,
            "wire_bytes": ledger.wire_total * world_size,  # rank 0's, scaled to all ranks
            "dense_bytes": ledger.dense_total * world_size,
            "compression_ratio": ledger.compression_ratio or 1.0}


def check_report_checkpoint(checkpoint: Any) -> Any:
    """:func:`raycomp.train.report`'s ``checkpoint`` if it is a ``ray.train.Checkpoint`` (the
    user's own), else None; a one-line ``TypeError`` for what is none of True, False, None
    or a ``ray.train.Checkpoint``, a ``ValueError`` for one holding a file named as raycomp's."""
    import ray.train

    if isinstance(checkpoint, ray.train.Checkpoint):
        with checkpoint.as_directory() as source:
            clash = sorted(p.name for p in Path(source).iterdir() if _OWN_NAMES.match(p.name))
        if clash:
            raise ValueError(f"report: the checkpoint's files {clash} have the names of raycomp's own "
                             "(meta.json, shared.pt, rank<r>.pt, sharded); rename them")
        return checkpoint
    if checkpoint is None or isinstance(checkpoint, bool):
        return None
    raise TypeError(f"report: checkpoint must be True, False, None or a ray.train.Checkpoint, "
                    f"got {type(checkpoint).__name__}")


def any_rank(flag: bool, group: Any) -> bool:
    """Whether ``flag`` holds on any rank (a collective: every rank calls it)."""
    value = torch.tensor([float(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


#: the names raycomp's checkpoint files take in a directory (:mod:`raycomp._internal.train.checkpoint`)
_OWN_NAMES = re.compile(r"^(meta\.json|shared\.pt|rank\d+\.pt|sharded)(\.tmp)?$")


def report_to_ray(metrics: dict[str, Any], save: Callable[[Path], None] | None, user: Any = None) -> None:
    """``ray.train.report(metrics)`` (a barrier on all ranks); with a checkpoint of what
    ``save`` writes into a directory, unless ``save`` is None. ``user``: the caller's own
    ``ray.train.Checkpoint`` (:func:`check_report_checkpoint`'s), whose files are copied
    into that directory first; its own directory is left as it is."""
    import ray.train

    if save is None:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="raycomp-ckpt-") as tmp:
        if user is not None:
            with user.as_directory() as source:
                shutil.copytree(source, tmp, dirs_exist_ok=True)
        save(Path(tmp))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    # Ray Train registers a reported checkpoint asynchronously; a worker dying before
    # that loses it and a restart would begin from scratch. Wait until it is registered.
    ray.train.get_all_reported_checkpoints()


def eval_value(name: str, value: Any) -> float:
    """The reported evaluation metric as a float (a Python number or a one-element tensor)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"report: metrics[{name!r}] (TrainOptions.eval_metric) must be a number, "
                         f"got {value!r}") from None


def run_totals(parts: RankParts, clock: StepClock, stats_dropped: int, group: Any) -> dict[str, Any]:
    """The run's totals over all ranks (a collective on ``group``: every rank calls it);
    ``stats_dropped``: this rank's statistics the controller never took."""
    state, progress = parts.strategy.state, parts.progress
    sums = torch.tensor([state.ledger.wire_total, state.ledger.dense_total,
                         float(parts.outages.count), state.intra_bytes], dtype=torch.float64)
    if parts.world_size > 1:
        dist.all_reduce(sums, group=group)
    return {
        "wire_bytes_total": float(sums[0]), "dense_bytes_total": float(sums[1]),
        # two levels: wire_bytes_total is what crossed nodes, this what stayed inside them
        "intra_node_bytes_total": float(sums[3]),
        "controller_outages": int(sums[2]), "steps": progress.global_step, "stats_dropped": stats_dropped,
        "plan_switches": parts.handoff.switches, "skipped_steps": progress.skipped_steps,
        "local_skipped_steps": progress.local_skips, "outer_steps": progress.outer_steps,
        "loss_scale_overflows": parts.judge.overflows,
        "fallback_events": [e.to_dict() for e in parts.judge.guard.events],
        "replayed_steps": progress.replayed_steps, "restored_from_step": progress.restored_from,
        "final_plan": state.plan.to_dict(), "control_seconds": clock.control_seconds,
        "control_boundary_seconds": clock.boundary_seconds,
        "control_overhead": clock.control_seconds / clock.step_seconds if clock.step_seconds else 0.0,
        # what DDP was built with (compression.bucket_cap_mb); None without DDP (FSDP, 1 worker)
        "ddp_bucket_cap_mb": parts.strategy.bucket_cap_mb,
    }
