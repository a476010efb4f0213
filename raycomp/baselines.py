"""torch's own DDP communication hooks, registered by name: the baselines raycomp is measured against.

* ``torch_allreduce``: ``default_hooks.allreduce_hook`` (dense fp32);
* ``torch_fp16`` / ``torch_bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``
  after ``baseline_warmup_steps`` dense fp32 steps (torch's hooks have no warm-up of their own;
  a benchmark gives every method the same one);
* ``torch_powersgd``: ``powerSGD_hook`` at ``baseline_powersgd_rank``, dense (torch's own
  all-reduce) before ``baseline_powersgd_start_iter``.
* ``torch_noop``: ``debugging_hooks.noop_hook``, torch's hook for headroom analysis: no
  collective at all, each rank steps with its own gradient (the replicas drift apart). Not
  training: the step time of the same workers, buckets and loop with the network free, which
  the benchmark divides step times by.

torch's ``powerSGD_hook`` on gloo needs the whole model in one DDP bucket (chains of futures
from several buckets interleave differently on the ranks: abort or hang): build the DDP model
with ``bucket_cap_mb`` above the model's fp32 size (``compression.baseline_bucket_cap_mb``,
:func:`one_bucket_cap_mb`; :func:`raycomp.buckets.ddp_kwargs` applies it).
"""

from __future__ import annotations

from typing import Any

import torch

from raycomp.buckets import gradient_mb

HOOKS = ("torch_allreduce", "torch_fp16", "torch_bf16", "torch_powersgd", "torch_noop")


def one_bucket_cap_mb(model: torch.nn.Module, margin: float = 1.25) -> float:
    """A ``bucket_cap_mb`` that holds every gradient of ``model`` in one bucket (fp32 size x margin)."""
    return round(max(1.0, margin * gradient_mb(model)), 1)


class _Warmup:
    """Dense fp32 all-reduce for ``warmup`` steps, then ``hook``; counts steps by the last bucket."""

    def __init__(self, hook: Any, warmup: int) -> None:
        self.hook, self.warmup, self.step = hook, warmup, 0

    def __call__(self, state: Any, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.allreduce_hook if self.step < self.warmup else self.hook
        future = hook(state, bucket)
        if bucket.is_last():
            self.step += 1
        return future


def register_torch_hook(model: torch.nn.parallel.DistributedDataParallel, compression: Any) -> None:
    """torch's own DDP hooks, for side-by-side benchmarks (their bytes are not counted here)."""
    from torch.distributed.algorithms.ddp_comm_hooks import (
        debugging_hooks,
        default_hooks,
        powerSGD_hook,
    )

    name = compression.baseline_hook
    warmup = getattr(compression, "baseline_warmup_steps", 0)
    if name in ("torch_fp16", "torch_bf16"):
        cast = default_hooks.fp16_compress_hook if name == "torch_fp16" else default_hooks.bf16_compress_hook
        warm = _Warmup(cast, warmup)

        def casted(state, bucket):  # unannotated: DDP checks hook annotations at run time
            return warm(state, bucket)

        model.register_comm_hook(None, casted)
    elif name == "torch_powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=compression.baseline_powersgd_rank,
            start_powerSGD_iter=compression.baseline_powersgd_start_iter,
        )

        def serialized(state, bucket):
            # on gloo, powerSGD_hook's future chains of different buckets interleave their
            # collectives and fail or hang (reproduced without Ray): finish one bucket first
            future = powerSGD_hook.powerSGD_hook(state, bucket)
            future.wait()
            return future

        model.register_comm_hook(state, serialized)
    elif name == "torch_noop":
        model.register_comm_hook(None, debugging_hooks.noop_hook)
    else:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
