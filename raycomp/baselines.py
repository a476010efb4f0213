"""torch's own DDP communication hooks, registered by name: the baselines raycomp is measured against."""

from __future__ import annotations

from typing import Any

import torch


def register_torch_hook(model: torch.nn.parallel.DistributedDataParallel, compression: Any) -> None:
    """torch's own DDP hooks, for side-by-side benchmarks (their bytes are not counted here)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if compression.baseline_hook == "torch_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif compression.baseline_hook == "torch_powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=compression.baseline_powersgd_rank,
            start_powerSGD_iter=compression.baseline_powersgd_start_iter,
        )

        def serialized(state, bucket):  # unannotated: DDP checks hook annotations at run time
            # on gloo, powerSGD_hook's future chains of different buckets interleave their
            # collectives and fail or hang (reproduced without Ray): finish one bucket first
            future = powerSGD_hook.powerSGD_hook(state, bucket)
            future.wait()
            return future

        model.register_comm_hook(state, serialized)
    else:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
