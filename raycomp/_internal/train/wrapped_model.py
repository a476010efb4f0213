"""A model that :func:`raycomp.train.prepare_model` must not wrap a second time.

``ray.train.torch.prepare_model`` (or ``DDP(...)``) left in place before raycomp's would
put DDP inside DDP: two all-reduces a step, raycomp's hook on the outer one only. A model
sharded with FSDP1's ``FullyShardedDataParallel`` cannot be sharded again by raycomp's FSDP2
path, nor wrapped in DDP; one sharded with FSDP2's ``fully_shard`` is taken as it is, but
only by ``strategy="fsdp"``. The framework integrations (:mod:`raycomp.integrations`) hand
their own DDP model to :func:`raycomp.train.start_loop` on purpose and never come here.
"""

from __future__ import annotations

import torch

__all__ = ["refuse_wrapped"]


def refuse_wrapped(model: torch.nn.Module, strategy: str) -> None:
    """A one-line ``ValueError`` for a model already wrapped for data parallelism that
    ``strategy`` (``"ddp"`` or ``"fsdp"``) would wrap again."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("prepare_model: the model is already a DistributedDataParallel (from "
                         "ray.train.torch.prepare_model or DDP(...)); pass the plain model: raycomp wraps it "
                         "in DDP itself, with its hook")
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        raise ValueError("prepare_model: the model is already wrapped in FSDP1's FullyShardedDataParallel; "
                         "pass the plain model: raycomp wraps it in DDP, or shards it with FSDP2 itself "
                         "with TrainOptions(strategy='fsdp')")
    if isinstance(model, FSDPModule) and strategy != "fsdp":
        raise ValueError("prepare_model: the model is sharded with fully_shard (FSDP2) and strategy='ddp' "
                         "would wrap it in DDP; pass TrainOptions(strategy='fsdp') to train it as sharded, "
                         "or the plain model")
