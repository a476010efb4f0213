"""The sections of a job config (``python -m jobs.train``) and :class:`JobConfig` itself.

A job config nests the worker-side sections of :mod:`raycomp.config` (compression,
controller, checkpoint) beside what only a job needs: the run's name and storage, the
workload, the cluster shape and the benchmark's torch baselines.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from raycomp._internal.imports import import_object
from raycomp.config import CheckpointSection, CompressionSection, ControllerSection

__all__ = ["DDP_BASELINES", "FSDP_BASELINES", "WORKLOAD_MODELS", "BenchmarkSection", "JobConfig",
           "RunSection", "ScalingSection", "Section", "WorkloadSection", "resolve_entrypoint"]


class Section(BaseModel):
    """Strict (unknown keys refused), frozen, defaults validated: as raycomp's sections."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class RunSection(Section):
    """``run``: the run's name, where its outputs go, its seed and what it logs."""

    #: the run's name; its id is the name with the start time and a suffix
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")] = "raycomp"
    #: the directory that holds each run's outputs (``<storage_path>/<run id>``) and the
    #: controller's snapshots (``<storage_path>/_controller``)
    storage_path: str = "outputs"
    #: the seed of the model's initial weights, the data order and the compressors' draws
    seed: Annotated[int, Field(ge=0)] = 0
    #: rank 0 logs one status line (step, loss, ratio, plan, samples/s) every this many steps (0: off)
    progress_every_steps: Annotated[int, Field(ge=0)] = 50
    #: show Ray Train's own per-report log lines from the workers (noisy)
    ray_logs: bool = False


class WorkloadSection(Section):
    """``workload``: the data set and model a job trains, and how (``entrypoint``: your own)."""

    #: the shipped workload: digits (an MLP, fast), fashion_mnist (a CNN) or kjv
    #: (character-level language model on the King James Bible)
    name: Literal["digits", "fashion_mnist", "kjv"] = "digits"
    #: passes over the data
    epochs: Annotated[int, Field(ge=1, le=10_000)] = 3
    #: examples per step on each worker
    batch_size: Annotated[int, Field(ge=1, le=65_536)] = 64
    #: at most this many steps an epoch (None: each worker's whole shard)
    steps_per_epoch: Annotated[int | None, Field(ge=1)] = None
    #: the optimizer's peak learning rate
    lr: Annotated[float, Field(gt=0, le=10)] = 0.05
    #: SGD's momentum (``optimizer: sgd``)
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    #: the optimizer's weight decay
    weight_decay: Annotated[float, Field(ge=0, lt=1)] = 0.0
    #: the learning rate over the run: constant, or cosine decay to 0
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    #: a linear warm-up from ``lr``/N to ``lr`` over the first N steps, the schedule's decay
    #: over the steps after it (0: none), as language models are usually trained with AdamW
    lr_warmup_steps: Annotated[int, Field(ge=0)] = 0
    #: sgd (with ``momentum``) or adamw
    optimizer: Literal["sgd", "adamw"] = "sgd"
    #: kjv: truncate the corpus to this many characters (None: all of it)
    max_chars: Annotated[int | None, Field(ge=10_000)] = None
    #: kjv: the context length in characters
    block: Annotated[int, Field(ge=8, le=1024)] = 64
    #: kjv: the test windows an evaluation reads, in batches
    eval_batches: Annotated[int, Field(ge=1)] = 20
    #: the model's hidden size (None: the workload's default)
    model_width: Annotated[int, Field(ge=8, le=4096)] | None = None
    #: fashion_mnist: the directory of its IDX files (None: the Debian package's)
    data_dir: str | None = None
    #: evaluate every this many steps on the fixed validation set (None: once per epoch)
    eval_every_steps: Annotated[int | None, Field(ge=1)] = None
    #: the model of the workload (None: its default): digits ``mlp``; fashion_mnist ``cnn`` or
    #: ``bn_cnn`` (BatchNorm, 2.5M parameters); kjv ``transformer`` or ``lstm``
    model: str | None = None
    #: kjv: transformer blocks or LSTM layers (None: 2)
    model_layers: Annotated[int | None, Field(ge=1, le=64)] = None
    #: kjv: the transformer's attention heads (None: 4); must divide ``model_width``
    model_heads: Annotated[int | None, Field(ge=1, le=64)] = None
    #: fashion_mnist: evaluate on the first N test images only (a fixed validation set)
    eval_examples: Annotated[int | None, Field(ge=1, le=10_000)] = None
    #: a user workload, ``package.module:callable`` with the signature of ``jobs.workloads.build``
    #: returning a ``Workload``; when set it replaces ``name``
    entrypoint: str | None = None
    #: stop once ``eval_<metric>`` has met this value (<= for a loss, >= for an accuracy) at
    #: ``stop_consecutive`` consecutive evaluations (benchmarks: time to target)
    stop_at_target: float | None = None
    #: the consecutive evaluations that must meet ``stop_at_target``
    stop_consecutive: Annotated[int, Field(ge=1, le=100)] = 2
    #: the forward pass's precision: ``fp32``; ``bf16`` (autocast); ``fp16`` (autocast and a
    #: ``torch.amp.GradScaler``, which raycomp's error feedback and guard follow). fp16 is
    #: for GPUs: on a CPU, autocast computes it slower than fp32
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"

    @field_validator("entrypoint")
    @classmethod
    def _importable(cls, value: str | None) -> str | None:
        if value is not None:
            resolve_entrypoint(value)  # raises ValueError: one line naming what is wrong
        return value

    @field_validator("model")
    @classmethod
    def _model_fits(cls, value: str | None, info: ValidationInfo) -> str | None:
        name = info.data.get("name")
        allowed = WORKLOAD_MODELS.get(name, ())
        if value is not None and value not in allowed:
            raise ValueError(f"{name} has the models {', '.join(map(repr, allowed))}, got {value!r}")
        return value

    @field_validator("model_heads")
    @classmethod
    def _heads_divide(cls, value: int | None, info: ValidationInfo) -> int | None:
        width = info.data.get("model_width")
        if value and width and width % value:
            raise ValueError(f"{value} must divide model_width ({width})")
        return value


#: the models each shipped workload offers (first: its default)
WORKLOAD_MODELS = {"digits": ("mlp",), "fashion_mnist": ("cnn", "bn_cnn"), "kjv": ("transformer", "lstm")}
_ENTRYPOINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def resolve_entrypoint(path: str) -> Any:
    """``package.module:callable`` -> the callable; ValueError with one line otherwise."""
    if not _ENTRYPOINT.match(path):
        raise ValueError(f"expected 'package.module:function', got {path!r}")
    target = import_object(path)
    if not callable(target):
        raise ValueError(f"{path!r} is not callable")
    return target


class ScalingSection(Section):
    """``scaling``: Ray Train's workers and how their gradients are exchanged."""

    #: the data-parallel workers (ranks)
    num_workers: Annotated[int, Field(ge=1, le=1024)] = 2
    #: one GPU per worker
    use_gpu: bool = False
    #: CPUs Ray reserves for each worker; also its torch threads
    cpus_per_worker: Annotated[float, Field(gt=0, le=256)] = 1.0
    #: Ray's placement of the workers on nodes (SPREAD: across nodes, as far as Ray can)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    #: ``ddp``: every worker holds the whole model, gradients are all-reduced (compressed by
    #: raycomp's DDP hook). ``fsdp``: FSDP2 (``fully_shard`` on each block and the root),
    #: gradients are reduce-scattered, each destination shard compressed (int8, bf16, ...)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    #: a collective that cannot complete (a rank hung or gone) fails after this, never hangs
    collective_timeout_s: Annotated[float, Field(ge=5, le=86_400)] = 300.0


#: torch's own DDP communication hooks (``jobs.baselines``): dense fp32, fp16, bf16 and
#: PowerSGD all-reduce, ``torch_noop``, torch's headroom hook (no communication, each rank
#: keeps its own gradient: a step time without the network), and the local-step baselines:
#: ``torch_postlocalsgd`` (torch's post-local SGD: DDP, then periodic model averaging) and
#: ``torchft_diloco`` (torchft's DiLoCo; no DDP, needs the torchft package)
DDP_BASELINES = ("torch_allreduce", "torch_fp16", "torch_bf16", "torch_powersgd", "torch_noop",
                 "torch_postlocalsgd", "torchft_diloco")
#: FSDP's own reduce-scatter, fp32 or bf16 (``MixedPrecisionPolicy(reduce_dtype=bf16)``), and
#: torch's HSDP (a 2-D mesh: sharded inside each node, its fp32 all-reduce across nodes)
FSDP_BASELINES = ("torch_fsdp", "torch_fsdp_bf16", "torch_hsdp")


class BenchmarkSection(Section):
    """torch's own gradient communication in place of raycomp's, for side-by-side benchmarks."""

    #: ``none``: raycomp compresses; a DDP baseline of :data:`DDP_BASELINES`
    #: (scaling.strategy=ddp) or one of :data:`FSDP_BASELINES` (scaling.strategy=fsdp) replaces it
    baseline: Literal["none", "torch_allreduce", "torch_fp16", "torch_bf16", "torch_powersgd",
                      "torch_noop", "torch_postlocalsgd", "torchft_diloco", "torch_fsdp",
                      "torch_fsdp_bf16", "torch_hsdp"] = "none"
    #: torch_powersgd: the PowerSGD rank
    powersgd_rank: Annotated[int, Field(ge=1)] = 2
    #: torch_powersgd: vanilla all-reduce before this step (torch's docs suggest starting
    #: from 10% of the training steps)
    powersgd_start_iter: Annotated[int, Field(ge=1)] = 10
    #: torch_fp16/torch_bf16: all-reduce fp32 for this many steps first (torch's cast hooks
    #: have no warm-up of their own: 0)
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    #: torch_postlocalsgd: H, the ``PeriodicModelAverager`` period: the ranks' parameters are
    #: averaged every H steps after the warm-up (1 would be DDP with extra traffic)
    localsgd_period: Annotated[int, Field(ge=2, le=100_000)] = 8
    #: torch_postlocalsgd: W, the steps of DDP gradient all-reduce before local SGD starts
    #: (``start_localSGD_iter`` of the hook = ``warmup_steps`` of the averager)
    localsgd_start_iter: Annotated[int, Field(ge=0)] = 0
    #: torchft_diloco: H, inner steps between two syncs of the pseudo-gradient
    diloco_sync_every: Annotated[int, Field(ge=1, le=100_000)] = 16
    #: torchft_diloco: the outer Nesterov SGD (DiLoCo's paper: lr 0.7, momentum 0.9)
    diloco_outer_lr: Annotated[float, Field(gt=0, le=10)] = 0.7
    #: torchft_diloco: the outer Nesterov SGD's momentum
    diloco_outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    #: the DDP ``bucket_cap_mb`` of a torch hook in place of ``compression.bucket_cap_mb``
    #: (None: the same buckets as raycomp's hook). torch's powerSGD_hook on gloo needs the
    #: whole model in one bucket: a cap above the model's fp32 size does it
    bucket_cap_mb: Annotated[float | None, Field(gt=0, le=100_000)] = None

    @field_validator("baseline")
    @classmethod
    def _installed(cls, value: str) -> str:
        if value == "torchft_diloco" and importlib.util.find_spec("torchft") is None:
            raise ValueError("'torchft_diloco' needs the torchft package, which is not installed "
                             "(pip install 'raycomp[bench]')")
        return value


class JobConfig(Section):
    """A training job: what only a job needs (run, workload, scaling, benchmark) beside the
    sections a worker reads (compression, controller, checkpoint)."""

    run: RunSection = RunSection()
    workload: WorkloadSection = WorkloadSection()
    scaling: ScalingSection = ScalingSection()
    compression: CompressionSection = Field(default_factory=CompressionSection)
    controller: ControllerSection = ControllerSection()
    checkpoint: CheckpointSection = CheckpointSection()
    benchmark: BenchmarkSection = BenchmarkSection()

    @model_validator(mode="after")
    def _strategy(self) -> JobConfig:
        strategy, baseline = self.scaling.strategy, self.benchmark.baseline
        self.compression.check_strategy(strategy)
        if self.workload.precision == "fp16" and strategy == "fsdp":
            raise ValueError("workload.precision: 'fp16' (a loss scaler) is not available with "
                             "scaling.strategy=fsdp; allowed there: fp32, bf16")
        if strategy != "fsdp" and baseline in FSDP_BASELINES:
            raise ValueError(f"benchmark.baseline: {baseline!r} needs scaling.strategy=fsdp")
        if strategy == "fsdp" and baseline not in ("none", *FSDP_BASELINES):
            raise ValueError(f"benchmark.baseline: {baseline!r} is a DDP hook; allowed with "
                             f"scaling.strategy=fsdp: none, {', '.join(FSDP_BASELINES)}")
        return self
