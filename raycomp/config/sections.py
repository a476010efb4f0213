"""The sections of a job config and :class:`JobConfig` itself."""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from raycomp.config import policy_sections
from raycomp.config.base import _Strict
from raycomp.imports import import_object


class RunSection(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")] = "raycomp"
    storage_path: str = "outputs"
    seed: Annotated[int, Field(ge=0)] = 0
    #: rank 0 logs one status line (step, loss, ratio, plan, samples/s) every this many steps (0: off)
    progress_every_steps: Annotated[int, Field(ge=0)] = 50
    #: show Ray Train's own per-report log lines from the workers (noisy)
    ray_logs: bool = False


class WorkloadSection(_Strict):
    name: Literal["digits", "fashion_mnist", "kjv"] = "digits"
    epochs: Annotated[int, Field(ge=1, le=10_000)] = 3
    batch_size: Annotated[int, Field(ge=1, le=65_536)] = 64  # per worker
    steps_per_epoch: Annotated[int | None, Field(ge=1)] = None  # cap (default: full shard)
    lr: Annotated[float, Field(gt=0, le=10)] = 0.05
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    weight_decay: Annotated[float, Field(ge=0, lt=1)] = 0.0
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    optimizer: Literal["sgd", "adamw"] = "sgd"
    max_chars: Annotated[int | None, Field(ge=10_000)] = None  # kjv: truncate the corpus
    block: Annotated[int, Field(ge=8, le=1024)] = 64  # kjv: context length
    eval_batches: Annotated[int, Field(ge=1)] = 20  # kjv: test windows (batches)
    model_width: Annotated[int, Field(ge=8, le=4096)] | None = None  # hidden size override
    data_dir: str | None = None  # fashion_mnist: IDX files (default: the Debian package's)
    #: evaluate every this many steps on the fixed validation set (None: once per epoch)
    eval_every_steps: Annotated[int | None, Field(ge=1)] = None
    #: the model of the workload (None: its default): digits ``mlp``; fashion_mnist ``cnn`` or
    #: ``bn_cnn`` (BatchNorm, 2.5M parameters); kjv ``transformer`` or ``lstm``
    model: str | None = None
    model_layers: Annotated[int | None, Field(ge=1, le=64)] = None  # kjv: transformer blocks or LSTM layers (2)
    model_heads: Annotated[int | None, Field(ge=1, le=64)] = None  # kjv: attention heads (4)
    #: fashion_mnist: evaluate on the first N test images only (a fixed validation set)
    eval_examples: Annotated[int | None, Field(ge=1, le=10_000)] = None
    #: a user workload, ``package.module:callable`` with the signature of ``jobs.workloads.build``
    #: returning a ``Workload``; when set it replaces ``name``
    entrypoint: str | None = None
    #: stop once ``eval_<metric>`` has met this value (<= for a loss, >= for an accuracy) at
    #: ``stop_consecutive`` consecutive evaluations (benchmarks: time to target)
    stop_at_target: float | None = None
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


class ScalingSection(_Strict):
    num_workers: Annotated[int, Field(ge=1, le=1024)] = 2
    use_gpu: bool = False
    cpus_per_worker: Annotated[float, Field(gt=0, le=256)] = 1.0
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    #: ``ddp``: every worker holds the whole model, gradients are all-reduced (compressed by
    #: raycomp's DDP hook). ``fsdp``: FSDP2 (``fully_shard`` on each block and the root),
    #: gradients are reduce-scattered, each destination shard compressed (int8, bf16, ...)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    #: a collective that cannot complete (a rank hung or gone) fails after this, never hangs
    collective_timeout_s: Annotated[float, Field(ge=5, le=86_400)] = 300.0


class GuardSection(_Strict):
    """Fallback to dense all-reduce, acted on by every rank in the same step."""

    enabled: bool = True
    loss_spike_factor: Annotated[float, Field(gt=1)] = 3.0  # loss > factor x window median
    loss_window: Annotated[int, Field(ge=3, le=10_000)] = 20
    max_compression_error: Annotated[float, Field(gt=0)] = 0.999  # relative, any layer
    stable_steps: Annotated[int, Field(ge=1)] = 50  # clean steps before compressing again
    grad_norm_factor: Annotated[float, Field(gt=1)] = 10.0  # norm > factor x window median
    spike_quantile: Annotated[float, Field(ge=0.5, le=1)] = 0.9  # the window level compared to
    spike_steps: Annotated[int, Field(ge=1, le=1000)] = 5  # loss averaged over these steps


class LrScalingSection(_Strict):
    """Compression-aware learning rate: ramp LR after a dense -> compressed switch."""

    enabled: bool = False
    warmup_steps: Annotated[int, Field(ge=1)] = 50
    start_factor: Annotated[float, Field(gt=0, le=1)] = 0.5


#: the baselines of a sharded run: FSDP's own reduce-scatter, fp32 or bf16 (no raycomp comm)
SHARDED_BASELINES = ("torch_fsdp", "torch_fsdp_bf16")


class CompressionSection(_Strict):
    """``compression``: the policy and its options, the dense warm-up, the error-feedback
    memory, the guard and the LR ramp.

    Besides its fields it holds one section per built-in policy, named after it
    (``compression.adaptive``, ``compression.static``, ...: the policy's typed options, from
    ``controllers.policies``; see :mod:`raycomp.config.policy_sections`).
    """

    model_config = policy_sections.SECTION_CONFIG
    #: a built-in policy (``adaptive``, the default), a name registered with
    #: ``controllers.policies.register_policy``, or an import path ``package.module:Class``
    #: that the controller imports (docs/extending.md)
    policy: str = "adaptive"
    #: options of a policy that is not built in, validated by its options model (built-in
    #: policies take theirs from their own section, e.g. ``compression.adaptive``)
    custom_options: dict[str, Any] = {}
    warmup_steps: Annotated[int, Field(ge=0)] = 20  # dense first (all policies)
    memory: Literal["residual", "dgc", "none"] = "residual"
    min_compress_numel: Annotated[int, Field(ge=0)] = 1024
    guard: GuardSection = GuardSection()
    lr_scaling: LrScalingSection = LrScalingSection()
    #: compare against torch's own DDP hooks instead of raycomp's (benchmarks)
    #: (DDP hooks: torch_allreduce/fp16/bf16/powersgd, or torch_noop, torch's headroom hook:
    #: no communication, each rank keeps its own gradient, a step time without the network;
    #: with scaling.strategy=fsdp: torch_fsdp, FSDP's own fp32 reduce-scatter, or
    #: torch_fsdp_bf16, its MixedPrecisionPolicy(reduce_dtype=bf16))
    baseline_hook: Literal["none", "torch_allreduce", "torch_fp16", "torch_bf16", "torch_powersgd",
                           "torch_noop", "torch_fsdp", "torch_fsdp_bf16"] = "none"
    baseline_powersgd_rank: Annotated[int, Field(ge=1)] = 2
    baseline_powersgd_start_iter: Annotated[int, Field(ge=1)] = 10
    #: torch_fp16/torch_bf16: all-reduce fp32 for this many steps first (the dense warm-up
    #: every method of a benchmark shares; torch_powersgd uses baseline_powersgd_start_iter)
    baseline_warmup_steps: Annotated[int, Field(ge=0)] = 0
    #: torch's hooks only: their DDP ``bucket_cap_mb`` in place of ``bucket_cap_mb`` (None: the
    #: same buckets as raycomp's hook). torch's powerSGD_hook on gloo needs the whole model in
    #: one bucket: a cap above the model's fp32 size does it (DDP's first bucket uses it too)
    baseline_bucket_cap_mb: Annotated[float | None, Field(gt=0, le=100_000)] = None
    #: DDP ``bucket_cap_mb`` (MB of gradients per bucket) of the run's DDP model. The hook
    #: compresses and sends each bucket on a background thread while backward computes the
    #: next, so smaller buckets hide more of the wire behind backward; each costs a round.
    #: "auto": about 8 buckets, between DDP's 1 MB first bucket and its 25 MB default
    #: (raycomp.bucket_cap_mb; a model of 200 MB+ keeps DDP's 25 MB). On the KJV transformer
    #: at 100 Mbit/s, int4: step 528 ms with DDP's default, 436-447 ms with 1-4 MB. FSDP
    #: (scaling.strategy=fsdp) has no DDP buckets and ignores it
    bucket_cap_mb: float | Literal["auto"] = "auto"

    @field_validator("bucket_cap_mb", mode="before")
    @classmethod
    def _bucket_cap(cls, value: Any) -> Any:
        if value == "auto":
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not 0 < number <= 100_000:
            raise ValueError(f"must be 'auto' or a size in MB in (0, 100000], got {value!r}")
        return number

    @model_validator(mode="before")
    @classmethod
    def _policy_sections(cls, data: Any) -> Any:
        return policy_sections.split_sections(data, set(cls.model_fields)) if isinstance(data, dict) else data

    _policy_name = field_validator("policy")(lambda cls, name: policy_sections.check_policy_name(name))

    @model_validator(mode="after")
    def _custom_options(self) -> CompressionSection:
        policy_sections.check_custom_options(self.policy, self.custom_options)
        return self

    def check_strategy(self, strategy: str) -> None:
        """ValueError (one line) unless this compression can run with ``strategy``: with
        ``fsdp`` every compressor it may choose must fit a reduce-scatter row; FSDP's own
        baselines need ``fsdp``."""
        if strategy != "fsdp":
            if self.baseline_hook in SHARDED_BASELINES:
                raise ValueError(f"compression.baseline_hook: {self.baseline_hook!r} needs scaling.strategy=fsdp")
            return
        policy_sections.check_sharded_policy(self)
        if self.baseline_hook not in ("none", *SHARDED_BASELINES):
            raise ValueError(f"compression.baseline_hook: {self.baseline_hook!r} is a DDP hook; allowed with "
                             f"scaling.strategy=fsdp: none, {', '.join(SHARDED_BASELINES)}")
        if self.memory == "dgc":
            raise ValueError("compression.memory: 'dgc' is not available with scaling.strategy=fsdp; "
                             "allowed: residual, none")
        policy_sections.check_sharded_options(self)

    def policy_options(self) -> dict[str, Any]:
        """The options the controller gets for ``policy`` (JSON)."""
        return policy_sections.options_of(self)


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def host_literal(value: str) -> str:
    """``value`` if it is an IPv4/IPv6 address or a syntactically valid host name (RFC 1123).

    Pure syntax (no network): whether a name resolves is checked by :func:`check_resources`.
    A dotted string of numbers must be a valid IPv4 address, so ``0.0.0.0.0`` and
    ``256.1.1.1`` are refused here rather than looked up as names.
    """
    allowed = "an IPv4 or IPv6 address (e.g. 127.0.0.1, ::1) or a host name (e.g. localhost)"
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if not value or len(value) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise ValueError(f"must be {allowed}, got {value!r}")
    if labels[-1].isdigit():  # all-numeric top label: meant as an IPv4 address
        raise ValueError(f"{value!r} is not a valid IPv4 address; must be {allowed}")
    return value


class ControllerSection(_Strict):
    interval_steps: Annotated[int, Field(ge=1, le=100_000)] = 10  # K: stats + plan boundary
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] = "raycomp-controller"
    namespace: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] = "raycomp"
    snapshot_dir: str | None = None  # default: <storage_path>/controller
    max_restarts: Annotated[int, Field(ge=-1)] = -1
    metrics_enabled: bool = True
    metrics_host: str = "127.0.0.1"  # loopback unless you mean to expose it
    metrics_port: Annotated[int, Field(ge=0, le=65_535)] = 9478  # 0: pick a free port
    #: Prometheus file-SD list (default: /tmp/raycomp/prometheus/<name>.json)
    metrics_sd_file: str | None = None
    finished_run_grace_s: Annotated[float, Field(ge=0)] = 300.0

    _host = field_validator("metrics_host")(lambda cls, value: host_literal(value))


class CheckpointSection(_Strict):
    every_epochs: Annotated[int, Field(ge=1)] = 1
    #: also checkpoint every this many steps, so a crash on a long epoch replays few steps
    every_steps: Annotated[int | None, Field(ge=1)] = None
    max_failures: Annotated[int, Field(ge=0, le=100)] = 2


class FaultsSection(_Strict):
    """Fault injection for tests and drills; all off by default."""

    nan_at_step: Annotated[int | None, Field(ge=0)] = None
    nan_rank: Annotated[int, Field(ge=0)] = 0
    kill_rank_at_step: Annotated[int | None, Field(ge=0)] = None
    kill_rank: Annotated[int, Field(ge=0)] = 0
    force_plan_mismatch_at_step: Annotated[int | None, Field(ge=0)] = None
    loss_scale_at_step: Annotated[int | None, Field(ge=0)] = None  # multiply the loss: a spike
    loss_scale: Annotated[float, Field(gt=0)] = 100.0
    hang_rank_at_step: Annotated[int | None, Field(ge=0)] = None  # that rank stops communicating
    hang_rank: Annotated[int, Field(ge=0)] = 0
    crash_while_checkpointing_epoch: Annotated[int | None, Field(ge=0)] = None  # rank 0, once
    slow_eval_seconds: Annotated[float, Field(ge=0)] = 0.0  # every evaluation takes this much longer
    slow_report_seconds: Annotated[float, Field(ge=0)] = 0.0  # every report takes this much longer


class JobConfig(_Strict):
    run: RunSection = RunSection()
    workload: WorkloadSection = WorkloadSection()
    scaling: ScalingSection = ScalingSection()
    compression: CompressionSection = Field(default_factory=CompressionSection)
    controller: ControllerSection = ControllerSection()
    checkpoint: CheckpointSection = CheckpointSection()
    faults: FaultsSection = FaultsSection()

    @model_validator(mode="after")
    def _strategy(self) -> JobConfig:
        self.compression.check_strategy(self.scaling.strategy)
        if self.workload.precision == "fp16" and self.scaling.strategy == "fsdp":
            raise ValueError("workload.precision: 'fp16' (a loss scaler) is not available with "
                             "scaling.strategy=fsdp; allowed there: fp32, bf16")
        return self

    @model_validator(mode="after")
    def _ranks_exist(self) -> JobConfig:
        workers = self.scaling.num_workers
        for key in ("nan_rank", "kill_rank", "hang_rank"):
            if getattr(self.faults, key) >= workers:
                raise ValueError(f"faults.{key} must be < scaling.num_workers ({workers})")
        return self


