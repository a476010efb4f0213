"""torch's own gradient communication, the baselines raycomp is measured against: a
gradient-strategy factory (:func:`torch_baseline`) that ``jobs.train`` passes to
``raycomp.train.prepare_model(..., gradient_strategy=...)`` when ``benchmark.baseline`` is set.
The guard, the controller link, the step log and checkpoints stay raycomp's; its plans are
then not applied and nothing is counted on the wire. The plan in force stays raycomp's dense
one, so the guard skips a non-finite step (on every rank alike) and leaves the rest as the
baseline takes them: its fallback rules judge raycomp's compression only.

DDP hooks (``scaling.strategy=ddp``), registered by name:

* ``torch_allreduce``: ``default_hooks.allreduce_hook`` (dense fp32);
* ``torch_fp16`` / ``torch_bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``
  after ``benchmark.warmup_steps`` dense fp32 steps (0 by default: torch's hooks have no
  warm-up of their own);
* ``torch_powersgd``: ``powerSGD_hook`` at ``benchmark.powersgd_rank``, dense (torch's own
  all-reduce) before ``benchmark.powersgd_start_iter``.
* ``torch_postlocalsgd``: ``post_localSGD_hook`` and a ``PeriodicModelAverager``
  (:mod:`jobs.postlocal_sgd`): DDP for ``benchmark.localsgd_start_iter`` steps, then local
  steps with the parameters averaged every ``benchmark.localsgd_period``.
* ``torchft_diloco``: torchft's ``DiLoCo`` (:mod:`jobs.torchft_diloco`), no DDP, the
  pseudo-gradient all-reduced every ``benchmark.diloco_sync_every`` steps.
* ``torch_noop``: ``debugging_hooks.noop_hook``, torch's hook for headroom analysis: no
  collective at all, each rank steps with its own gradient (the replicas drift apart). Not
  training: the step time of the same workers, buckets and loop with the network free, which
  the benchmark divides step times by.

FSDP2 (``scaling.strategy=fsdp``): ``torch_fsdp``, FSDP's own fp32 reduce-scatter,
``torch_fsdp_bf16``, its ``MixedPrecisionPolicy(reduce_dtype=bf16)``, and ``torch_hsdp``,
torch's hybrid sharding on several nodes of several workers: ``fully_shard`` over a 2-D mesh
(replicate across nodes, shard inside each), FSDP's fp32 reduce-scatter inside the node and
its fp32 all-reduce of each shard across nodes.

torch's ``powerSGD_hook`` on gloo needs the whole model in one DDP bucket (chains of futures
from several buckets interleave differently on the ranks: abort or hang): build the DDP model
with ``bucket_cap_mb`` above the model's fp32 size (``benchmark.bucket_cap_mb``,
:func:`one_bucket_cap_mb`; :func:`ddp_options` applies it).
"""

from __future__ import annotations

from typing import Any

import torch

from jobs.config import DDP_BASELINES, FSDP_BASELINES, BenchmarkSection
from raycomp._internal.ddp.buckets import ddp_kwargs
from raycomp.train.gradient_strategy import GradientStrategy, GradientStrategyFactory, StrategySetup

__all__ = ["HOOKS", "ddp_options", "hsdp_mesh", "one_bucket_cap_mb", "register_torch_hook", "torch_baseline"]


def hsdp_mesh(device: torch.device) -> Any:
    """torch's HSDP mesh for this run: ``(nodes, workers per node)``, replicate x shard, from
    the topology Ray Train gives (:func:`raycomp._internal.topology.discover`). Ranks must be numbered
    node by node (Ray Train numbers them so); anything else is refused."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from raycomp._internal.topology import discover

    place = discover()
    world = dist.get_world_size()
    if place.nodes * place.per_node != world or dist.get_rank() != place.node * place.per_node + place.local_rank:
        raise ValueError(f"benchmark.baseline: torch_hsdp needs ranks numbered node by node on nodes of equal size; "
                         f"rank {dist.get_rank()} is {place}")
    return init_device_mesh(device.type, (place.nodes, place.per_node), mesh_dim_names=("replicate", "shard"))

HOOKS = DDP_BASELINES


def one_bucket_cap_mb(model: torch.nn.Module, margin: float = 1.25) -> float:
    """A ``bucket_cap_mb`` that holds every gradient of ``model`` in one bucket (fp32 size x margin)."""
    gradient_mb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    return round(max(1.0, margin * gradient_mb), 1)


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


def register_torch_hook(model: torch.nn.parallel.DistributedDataParallel, benchmark: BenchmarkSection) -> None:
    """torch's own DDP hook ``benchmark.baseline`` on ``model`` (its bytes are not counted here)."""
    from torch.distributed.algorithms.ddp_comm_hooks import (
        debugging_hooks,
        default_hooks,
        powerSGD_hook,
    )

    name, warmup = benchmark.baseline, benchmark.warmup_steps
    if name in ("torch_fp16", "torch_bf16"):
        cast = default_hooks.fp16_compress_hook if name == "torch_fp16" else default_hooks.bf16_compress_hook
        warm = _Warmup(cast, warmup)

        def casted(state, bucket):  # unannotated: DDP checks hook annotations at run time
            return warm(state, bucket)

        model.register_comm_hook(None, casted)
    elif name == "torch_powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=benchmark.powersgd_rank,
            start_powerSGD_iter=benchmark.powersgd_start_iter,
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
    elif name in ("torch_postlocalsgd", "torchft_diloco"):
        raise ValueError(f"benchmark.baseline: {name!r} is more than a comm hook; torch_baseline() builds it")
    else:
        model.register_comm_hook(None, default_hooks.allreduce_hook)


def ddp_options(benchmark: BenchmarkSection, compression: Any, model: torch.nn.Module) -> dict[str, Any]:
    """DDP's keyword arguments for a torch hook: ``benchmark.bucket_cap_mb`` when set, else
    the buckets raycomp's hook would get (:func:`raycomp._internal.ddp.buckets.ddp_kwargs`)."""
    if benchmark.bucket_cap_mb is not None:
        return {"bucket_cap_mb": float(benchmark.bucket_cap_mb)}
    return ddp_kwargs(compression, model)


def torch_baseline(benchmark: BenchmarkSection) -> GradientStrategyFactory:
    """A ``gradient_strategy`` factory for ``raycomp.train.prepare_model`` that communicates with
    torch's own ``benchmark.baseline`` (not ``none``) in place of raycomp's compression."""
    if benchmark.baseline not in (*DDP_BASELINES, *FSDP_BASELINES):
        raise ValueError(f"benchmark.baseline: must be one of {', '.join((*DDP_BASELINES, *FSDP_BASELINES))}, "
                         f"got {benchmark.baseline!r}")

    def build(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> GradientStrategy:
        fsdp = setup.options.strategy == "fsdp"
        if fsdp != (benchmark.baseline in FSDP_BASELINES):
            allowed = ", ".join(FSDP_BASELINES if fsdp else DDP_BASELINES)
            raise ValueError(f"benchmark.baseline: {benchmark.baseline!r} does not fit strategy "
                             f"{setup.options.strategy!r}; allowed there: {allowed}")
        if fsdp:  # FSDP's own reduce-scatter; raycomp's state keeps the guard's rows
            from raycomp._internal.train.sharding import FsdpStrategy, shard_model, sharded_state

            reduce_dtype = torch.bfloat16 if benchmark.baseline == "torch_fsdp_bf16" else None
            mesh = hsdp_mesh(setup.device) if benchmark.baseline == "torch_hsdp" else None
            model = shard_model(model, optimizer, setup.device, reduce_dtype, mesh=mesh)
            return FsdpStrategy(model, sharded_state(model, setup, install=False))
        if benchmark.baseline == "torchft_diloco":
            from jobs.torchft_diloco import torchft_diloco

            return torchft_diloco(model, optimizer, setup, benchmark)
        options = ddp_options(benchmark, setup.options.compression, model)
        if benchmark.baseline == "torch_postlocalsgd":
            from jobs.postlocal_sgd import post_local_sgd

            return post_local_sgd(model, setup, benchmark, options)
        from raycomp._internal.train.ddp_strategy import DdpStrategy, compression_state, wrap_ddp

        model = wrap_ddp(model, setup, options)
        strategy = DdpStrategy(model, compression_state(model, setup), hook=None)
        if strategy.ddp:
            register_torch_hook(model, benchmark)  # raycomp's hook stays out of the way
        return strategy

    return build
