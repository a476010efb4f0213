"""torch's post-local SGD as a benchmark baseline (``benchmark.baseline=torch_postlocalsgd``).

As torch's authors set it up (``torch.distributed.algorithms.model_averaging``, RFC pytorch
#59699): DDP with ``post_localSGD_hook`` all-reduces gradients for the first
``start_localSGD_iter`` = W steps; from then on each rank steps its own optimizer on its own
gradient, and a ``PeriodicModelAverager(period=H, warmup_steps=W)`` averages the ranks'
parameters after every H-th optimizer step (what ``PostLocalSGDOptimizer.step`` does; here
:meth:`PostLocalSgdStrategy.after_optimizer_step`, called by raycomp's loop after each optimizer
step). Optimizer state stays local.

After its warm-up torch's hook keeps all-reducing gradients inside a *subgroup*, by default
the ranks of one machine (``dist.new_subgroups()``, sized by the CUDA device count: it
raises on a CPU-only host), meant for GPUs that share a fast interconnect. Where the workers
sit several to a node on several nodes (``compression.levels`` auto and a topology of two
levels, :mod:`raycomp._internal.topology`), the subgroup is the node's group: torch's two-level
recipe, gradients all-reduced inside the node every step and parameters averaged across all
ranks every H steps. Where every worker is its own node (one per Ray node, or flat), its
subgroup would hold one rank and reduce nothing: the state is then built with
``post_local_gradient_allreduce=False``, which is exactly that, without a subgroup, on one
host too; after the warm-up only the parameter average every H steps crosses the link (and
DDP's broadcast of a model's buffers, if it has any, at every forward, as under torch's own
recipe).
"""

from __future__ import annotations

from typing import Any

import torch

from jobs.baseline_guard import BaselineGuardState
from jobs.config import BenchmarkSection
from raycomp._internal.train.ddp_strategy import DdpStrategy, compression_state, wrap_ddp
from raycomp.train.gradient_strategy import StrategySetup

__all__ = ["PostLocalSgdStrategy", "post_local_sgd", "register_post_local_sgd"]


def register_post_local_sgd(model: torch.nn.parallel.DistributedDataParallel, benchmark: BenchmarkSection,
                            node_group: Any = None) -> torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager:
    """``post_localSGD_hook`` on ``model`` (gradient all-reduce over all ranks for
    ``localsgd_start_iter`` steps; after them over ``node_group`` if given, else none) and the
    averager to call after every optimizer step."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    start = benchmark.localsgd_start_iter
    state = PostLocalSGDState(process_group=None, subgroup=node_group, start_localSGD_iter=start,
                              post_local_gradient_allreduce=node_group is not None)
    model.register_comm_hook(state, post_localSGD_hook)
    return PeriodicModelAverager(period=benchmark.localsgd_period, warmup_steps=start)


class PostLocalSgdStrategy(DdpStrategy):
    """DDP with ``post_localSGD_hook``; the parameters averaged every H optimizer steps."""

    def __init__(self, model: torch.nn.Module, state: BaselineGuardState, averager: object | None) -> None:
        super().__init__(model, state, hook=None)  # type: ignore[arg-type]
        self.averager = averager
        module = getattr(model, "module", model)
        self._params = list(module.parameters())

    def after_optimizer_step(self, applied: bool, loss: float) -> None:
        # every rank calls it at every step, applied or skipped (the guard skips on every
        # rank alike), so the averagers count the same steps and average together
        if self.averager is not None:
            self.averager.average_parameters(self._params)


def post_local_sgd(model: torch.nn.Module, setup: StrategySetup, benchmark: BenchmarkSection,
                   ddp_options: dict[str, object]) -> PostLocalSgdStrategy:
    """The model in DDP (``ddp_options``) under post-local SGD, the guard's inputs agreed."""
    import torch.distributed as dist

    model = wrap_ddp(model, setup, ddp_options)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    compression = compression_state(model, setup)  # its topology: the node's group, where there are two levels
    state = BaselineGuardState(compression, rank, world, setup.control_group)
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    levels = compression.levels
    averager = register_post_local_sgd(model, benchmark, levels.intra.handle if levels else None) if ddp else None
    return PostLocalSgdStrategy(model, state, averager)
