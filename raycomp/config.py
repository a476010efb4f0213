"""Typed, validated configuration for a training run, loaded from YAML plus overrides.

Everything is checked before any cluster resource is taken: unknown keys, wrong types,
out-of-range values and missing data sets raise :class:`ConfigError` with the dotted key
that is wrong and what is allowed. YAML is parsed with ``yaml.safe_load`` only: a config
is data, never code.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from raycomp.plan import CompressorSpec

POLICIES = ("static", "schedule", "critical", "error_budget", "bandwidth", "adaptive")
WORKLOADS = ("digits", "fashion_mnist", "kjv")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*$")


class ConfigError(ValueError):
    """A configuration problem; ``str()`` is one line naming the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class CompressorConfig(_Strict):
    """A compressor by registry name with its parameters, e.g. ``{name: topk, ratio: 0.01}``."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str

    @model_validator(mode="after")
    def _known(self) -> CompressorConfig:
        self.spec()  # raises ValueError naming the parameter
        return self

    def spec(self) -> CompressorSpec:
        return CompressorSpec.of(self.name, **(self.model_extra or {}))


def compressor(name: str, **params: Any) -> CompressorConfig:
    return CompressorConfig(name=name, **params)


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
    #: ``bn_cnn`` (BatchNorm, 2.5M parameters); kjv ``transformer``
    model: str | None = None
    model_layers: Annotated[int | None, Field(ge=1, le=64)] = None  # kjv: transformer blocks (2)
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
WORKLOAD_MODELS = {"digits": ("mlp",), "fashion_mnist": ("cnn", "bn_cnn"), "kjv": ("transformer",)}
_ENTRYPOINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def resolve_entrypoint(path: str) -> Any:
    """``package.module:callable`` -> the callable; ValueError with one line otherwise."""
    import importlib

    if not _ENTRYPOINT.match(path):
        raise ValueError(f"expected 'package.module:function', got {path!r}")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is a bad entry point
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"cannot import {module_name!r} ({message})") from None
    target = getattr(module, attr, None)
    if target is None:
        raise ValueError(f"module {module_name!r} has no {attr!r}")
    if not callable(target):
        raise ValueError(f"{path!r} is not callable")
    return target


class ScalingSection(_Strict):
    num_workers: Annotated[int, Field(ge=1, le=1024)] = 2
    use_gpu: bool = False
    cpus_per_worker: Annotated[float, Field(gt=0, le=256)] = 1.0
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
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


def _distinct_ratios(ratios: list[float], descending: bool = False) -> list[float]:
    if not ratios:
        raise ValueError("at least one ratio is required")
    return sorted(set(ratios), reverse=descending)


class StaticPolicy(_Strict):
    compressor: CompressorConfig = compressor("topk", ratio=0.01)


class ScheduleStage(_Strict):
    start_step: Annotated[int, Field(ge=0)]
    compressor: CompressorConfig


class SchedulePolicy(_Strict):
    """Piecewise plan by step, e.g. DGC's exponential density warm-up."""

    stages: list[ScheduleStage] = [
        ScheduleStage(start_step=0, compressor=compressor("topk", ratio=0.25)),
        ScheduleStage(start_step=50, compressor=compressor("topk", ratio=0.06)),
        ScheduleStage(start_step=100, compressor=compressor("topk", ratio=0.015)),
        ScheduleStage(start_step=150, compressor=compressor("topk", ratio=0.004)),
    ]

    @field_validator("stages")
    @classmethod
    def _increasing(cls, stages: list[ScheduleStage]) -> list[ScheduleStage]:
        if not stages:
            raise ValueError("at least one stage is required")
        starts = [s.start_step for s in stages]
        if starts != sorted(set(starts)):
            raise ValueError(f"start_step values must strictly increase, got {starts}")
        return stages


class CriticalPolicy(_Strict):
    """Accordion: layers whose gradient norm changes fast are in a critical regime."""

    low: CompressorConfig = compressor("topk", ratio=0.1)  # light compression (critical)
    high: CompressorConfig = compressor("topk", ratio=0.01)  # heavy compression
    threshold: Annotated[float, Field(gt=0)] = 0.5  # relative norm change
    window_steps: Annotated[int, Field(ge=1)] = 50  # detection interval


class ErrorBudgetPolicy(_Strict):
    """L-GreCo: per-layer Top-K ratios minimising bytes under a total error budget."""

    ratios: list[Annotated[float, Field(gt=0, le=1)]] = [0.001, 0.003, 0.01, 0.03, 0.1]
    reference_ratio: Annotated[float, Field(gt=0, le=1)] = 0.01  # budget = its total error
    slack: Annotated[float, Field(ge=0, le=10)] = 0.0
    every_steps: Annotated[int, Field(ge=1)] = 50

    _ratios = field_validator("ratios")(lambda cls, r: _distinct_ratios(r))


class BandwidthPolicy(_Strict):
    """Compress just enough that communication hides behind computation."""

    ratios: list[Annotated[float, Field(gt=0, le=1)]] = [1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001]
    target_overlap: Annotated[float, Field(gt=0, le=10)] = 1.0  # comm time / compute time

    _ratios = field_validator("ratios")(lambda cls, r: _distinct_ratios(r, descending=True))


class AdaptivePolicy(_Strict):
    """The default: measure the link, model each candidate plan's step time, pick the
    lightest compression that is (nearly) the fastest, and lighter still for layers in a
    critical regime (Accordion) or whose measured error is too high. "Dense" is one of the
    candidates: on a fast link it usually wins (Agarwal et al., MLSys'22: compression paid
    off in only 6 of 200+ data-center setups). Decision rule: ``controllers/policies/adaptive.py``.
    """

    #: PowerSGD ranks for matrices, heaviest first (Vogels et al., NeurIPS'19: rank 1-4
    #: matches dense accuracy on ResNet/LSTM with error feedback). Payload per layer is
    #: (rows + cols) x rank fp32, all-reduced. Drop 1 if your model trains worse at rank 1;
    #: add 16 or 32 for very wide layers.
    ranks: list[Annotated[int, Field(ge=1, le=1024)]] = [1, 2, 4, 8]
    #: Top-K densities for compressible tensors PowerSGD cannot take (1-D, or shapes whose
    #: factors are not smaller), heaviest first. Top-K is all-gathered: its bytes grow with
    #: the number of ranks, which the cost model accounts for.
    topk_ratios: list[Annotated[float, Field(gt=0, le=1)]] = [0.01, 0.1]
    #: Accordion's eta: relative change of a layer's mean gradient norm between two windows
    #: at or above this is a critical regime (Agarwal et al., MLSys'21 use 0.5). Lower it to
    #: protect more layers (less compression), raise it to compress through more change.
    threshold: Annotated[float, Field(gt=0)] = 0.5
    #: Steps per regime window (Accordion detects every few epochs; here, in steps). Use
    #: about an epoch or 5-10 control intervals; it is also how often error is re-judged.
    window_steps: Annotated[int, Field(ge=1)] = 50
    #: How many rungs lighter a critical layer goes (rank 1 -> rank 4 with the default
    #: ranks, Accordion's heavy/light PowerSGD pair). 0 turns regime detection off.
    critical_boost: Annotated[int, Field(ge=0, le=16)] = 2
    #: A layer whose measured relative compression error ||c - sent|| / ||c|| over a window
    #: exceeds this moves one rung lighter for the rest of the run (never back: no
    #: flapping). With error feedback PowerSGD runs at 0.7-0.93 on the digits MLP and still
    #: matches dense accuracy; above 0.95 less than 10% of the gradient's energy is sent
    #: per step. Lower it (e.g. 0.8) for models sensitive to compression.
    max_error: Annotated[float, Field(gt=0, le=1)] = 0.95
    #: Among candidate plans take the lightest whose predicted step time is within this
    #: fraction of the fastest; dense counts as the lightest, so compression must save more
    #: than this to be used. It is also the hysteresis band: the current plan is kept while
    #: it stays within it. Raise it on noisy shared machines; lower it to squeeze the link.
    slack: Annotated[float, Field(ge=0, le=10)] = 0.1
    #: Seconds each extra collective round of a compressed plan costs (latency plus
    #: compression and decompression) until the run has measured it. NCCL on one node:
    #: ~1e-4; gloo over TCP: ~1e-3; shared CPUs: more. Learned from the first compressed
    #: control interval on.
    round_seconds: Annotated[float, Field(ge=0, le=10)] = 0.001
    #: Link bandwidth in bytes per second per rank to plan for, instead of measuring it on
    #: dense steps (warm-up, guard fallbacks). Set it when you know the link better than a
    #: short warm-up can measure it, or to plan for a target link (100 Mbit/s: 12.5e6).
    bandwidth: Annotated[float, Field(gt=0)] | None = None

    @field_validator("ranks", "topk_ratios")
    @classmethod
    def _ladder(cls, values: list[Any]) -> list[Any]:
        if not values:
            raise ValueError("at least one value is required")
        return sorted(set(values))  # heaviest first


class CompressionSection(_Strict):
    #: a built-in policy (``adaptive``, the default: see AdaptivePolicy), a name registered
    #: with ``controllers.policies.register_policy``, or an import path
    #: ``package.module:Class`` that the controller imports (docs/extending.md)
    policy: str = "adaptive"
    #: options of a policy that is not built in, validated by its options model (built-in
    #: policies take theirs from their own section, e.g. ``compression.adaptive``)
    custom_options: dict[str, Any] = {}
    #: filled by ``controllers.policies.register_policy``: name -> (import path, options model)
    custom_policies: ClassVar[dict[str, tuple[str | None, type[BaseModel] | None]]] = {}
    warmup_steps: Annotated[int, Field(ge=0)] = 20  # dense first (all policies)
    memory: Literal["residual", "dgc", "none"] = "residual"
    min_compress_numel: Annotated[int, Field(ge=0)] = 1024
    adaptive: AdaptivePolicy = AdaptivePolicy()
    static: StaticPolicy = StaticPolicy()
    schedule: SchedulePolicy = SchedulePolicy()
    critical: CriticalPolicy = CriticalPolicy()
    error_budget: ErrorBudgetPolicy = ErrorBudgetPolicy()
    bandwidth: BandwidthPolicy = BandwidthPolicy()
    guard: GuardSection = GuardSection()
    lr_scaling: LrScalingSection = LrScalingSection()
    #: compare against torch's own DDP hooks instead of raycomp's (benchmarks)
    baseline_hook: Literal["none", "torch_allreduce", "torch_fp16", "torch_bf16", "torch_powersgd"] = "none"
    baseline_powersgd_rank: Annotated[int, Field(ge=1)] = 2
    baseline_powersgd_start_iter: Annotated[int, Field(ge=1)] = 10
    #: torch_fp16/torch_bf16: all-reduce fp32 for this many steps first (the dense warm-up
    #: every method of a benchmark shares; torch_powersgd uses baseline_powersgd_start_iter)
    baseline_warmup_steps: Annotated[int, Field(ge=0)] = 0
    #: DDP ``bucket_cap_mb`` for ``prepare_model(parallel_strategy_kwargs=...)`` (None: DDP's
    #: default). torch's powerSGD_hook on gloo needs the whole model in one bucket: a cap above
    #: the model's fp32 size does it (DDP's first bucket then uses the cap too)
    baseline_bucket_cap_mb: Annotated[float | None, Field(gt=0, le=100_000)] = None

    @field_validator("policy")
    @classmethod
    def _policy_name(cls, name: str) -> str:
        if name in POLICIES:
            return name
        if name in cls.custom_policies:
            path = cls.custom_policies[name][0]
            return path or name  # the import path travels to the controller's process
        if _IMPORT_PATH.match(name):
            return name
        builtin = ", ".join(repr(p) for p in POLICIES)
        raise ValueError(f"must be one of {builtin}, a name registered with "
                         f"controllers.policies.register_policy, or an import path "
                         f"'package.module:Class', got {name!r}")

    @model_validator(mode="after")
    def _custom_options(self) -> CompressionSection:
        if self.policy in POLICIES:
            if self.custom_options:
                raise ValueError(f"custom_options: only for policies that are not built in; "
                                 f"set compression.{self.policy}.<option> instead")
            return self
        models = [m for n, (path, m) in self.custom_policies.items() if self.policy in (n, path)]
        if models and models[0] is not None:
            try:
                models[0].model_validate(self.custom_options)
            except ValidationError as error:
                raise ValueError(one_line(error, prefix="custom_options.")) from None
        return self

    def policy_options(self) -> dict[str, Any]:
        if self.policy not in POLICIES:
            models = [m for n, (path, m) in self.custom_policies.items() if self.policy in (n, path)]
            if models and models[0] is not None:
                return models[0].model_validate(self.custom_options).model_dump(mode="json")
            return dict(self.custom_options)
        return getattr(self, self.policy).model_dump(mode="json")


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


class JobConfig(_Strict):
    run: RunSection = RunSection()
    workload: WorkloadSection = WorkloadSection()
    scaling: ScalingSection = ScalingSection()
    compression: CompressionSection = CompressionSection()
    controller: ControllerSection = ControllerSection()
    checkpoint: CheckpointSection = CheckpointSection()
    faults: FaultsSection = FaultsSection()

    @model_validator(mode="after")
    def _ranks_exist(self) -> JobConfig:
        workers = self.scaling.num_workers
        for key in ("nan_rank", "kill_rank", "hang_rank"):
            if getattr(self.faults, key) >= workers:
                raise ValueError(f"faults.{key} must be < scaling.num_workers ({workers})")
        return self


# --- loading ---------------------------------------------------------------------------
_OVERRIDE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)=(.*)$", re.S)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as a YAML scalar/flow value)."""
    match = _OVERRIDE.match(text)
    if not match:
        raise ConfigError(f"override {text!r}: expected key.path=value, e.g. compression.policy=static")
    try:
        value = yaml.safe_load(match.group(2)) if match.group(2).strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({error.problem})") from None
    return match.group(1).split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {key!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read YAML (optional), apply ``key=value`` overrides, validate."""
    data = read_yaml_mapping(path) if path is not None else {}
    return validate(apply_overrides(data, list(overrides)))


def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A YAML file whose top level is a mapping (``safe_load``: data, never code)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {error}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{what} {str(path)!r}: top level must be a mapping of sections")
    return loaded or {}


def validate(data: dict[str, Any]) -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(one_line(error)) from None


def one_line(error: ValidationError, prefix: str = "") -> str:
    """The first problem of a validation error as ``<prefix><dotted key>: <what is wrong>``."""
    first = error.errors()[0]
    key = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-after"))
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif first["type"] == "literal_error":
        expected = first.get("ctx", {}).get("expected", "")
        message = f"must be one of {expected}, got {first['input']!r}"
    elif first["type"] == "missing":
        message = "required"
    elif "input" in first and first["type"] not in ("value_error", "assertion_error"):
        message = f"{message} (got {first['input']!r})"
    return f"{prefix}{key or 'config'}: {message}"


def check_resources(config: JobConfig) -> None:
    """Things outside the config that must exist before any cluster resource is taken."""
    from raycomp import data

    fashion_dir = Path(config.workload.data_dir or data.FASHION_MNIST_DIR)
    shipped = config.workload.entrypoint is None  # a user workload checks its own data
    if shipped and config.workload.name == "fashion_mnist":
        if not (fashion_dir / "train-images-idx3-ubyte.gz").is_file():
            raise ConfigError(
                f"workload.data_dir: no Fashion-MNIST in {str(fashion_dir)!r}; install the Debian "
                "package 'dataset-fashion-mnist' or point workload.data_dir at the IDX files"
            )
        for name in data.FASHION_MNIST_FILES:
            try:
                data.idx_header(fashion_dir / name)
            except (OSError, ValueError, EOFError) as error:
                raise ConfigError(f"workload.data_dir: {name} is unreadable: {error}") from None
    if shipped and config.workload.name == "kjv" and shutil.which("bible") is None and not data.kjv_cache_file().is_file():
        raise ConfigError(
            "workload.name: kjv needs the Debian packages 'bible-kjv bible-kjv-text' "
            "(program 'bible' not found)"
        )
    if config.compression.memory == "dgc" and config.workload.momentum > 0:
        raise ConfigError(
            "compression.memory: 'dgc' applies momentum itself; set workload.momentum=0 "
            f"(got {config.workload.momentum})"
        )
    from controllers.exporter import SD_DIR

    address = os.environ.get("RAY_ADDRESS")
    check_sizes(config)
    check_cluster_fits(config, address)
    check_controller_paths(config, address, SD_DIR)



# --- checks against the machine (before Ray starts) --------------------------------------
#: sklearn's digits: 1,797 images, 20 % held out for evaluation (see raycomp.data.digits)
DIGITS_TRAIN_EXAMPLES = 1797 - int(1797 * 0.2)


def local_cpus() -> int:
    """CPUs an embedded ``ray.init()`` would see here (the affinity mask, capped by a cgroup
    v2 CPU quota as Ray does)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count


def _is_local(address: str | None) -> bool:
    """True when the Ray cluster (and so the controller actor) runs on this machine's files:
    an embedded cluster, or a driver on a cluster node; False for a Ray Client (ray://)."""
    return not (address or "").startswith("ray://")


def check_writable_dir(key: str, value: str | Path, shown: str | Path | None = None) -> Path:
    """``value`` as an absolute directory that exists and is writable, or can be created.

    Nothing is left behind: writability is probed with a temporary directory in the
    directory itself, or in its nearest existing ancestor (where it would be created).
    """
    try:
        path = Path(value).expanduser().resolve()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{key}: {str(path)!r} exists and is not a directory")
        parent = path
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"{key}: cannot create {str(path)!r}: {str(parent)!r} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".raycomp-probe-", dir=parent))
    except ConfigError:
        raise
    except (OSError, ValueError, RuntimeError) as error:
        where = f" in {str(parent)!r}" if "parent" in locals() else ""
        reason = getattr(error, "strerror", None) or str(error)
        what = "is not a writable directory" if shown is None else "cannot be written"
        raise ConfigError(f"{key}: {str(shown or value)!r} {what} (cannot create a "
                          f"directory{where}: {reason})") from None
    return path


def check_writable_file(key: str, value: str | Path) -> Path:
    """``value`` as a file path whose folder is (or can be made) writable."""
    path = Path(value).expanduser()
    if str(value).endswith(("/", os.sep)) or (path.exists() and path.is_dir()):
        raise ConfigError(f"{key}: {str(value)!r} is a directory; expected a file path")
    check_writable_dir(key, path.parent, shown=value)
    return path.resolve()


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def check_metrics_endpoint(host: str, port: int) -> None:
    """On an embedded cluster the controller's exporter binds ``host:port`` on this machine:
    the address must be one of this machine's and the port free (or already serving
    raycomp metrics: the controller is shared by every run)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as error:
        raise ConfigError(f"controller.metrics_host: cannot resolve {host!r} ({error})") from None
    family, _, _, _, sockaddr = infos[0]
    address = sockaddr[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, 0, *sockaddr[2:]))
        except OSError as error:
            raise ConfigError(f"controller.metrics_host: cannot listen on {host!r} on this machine "
                              f"({error.strerror}); use 127.0.0.1, 0.0.0.0 or one of its addresses") from None
    if port == 0:
        return
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port, *sockaddr[2:]))
            return
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM):
                raise ConfigError(f"controller.metrics_port: {port} needs privileges to listen on "
                                  f"({error.strerror}); use a port >= 1024 (0 picks a free one)") from None
    try:
        import urllib.request

        with urllib.request.urlopen(f"http://{_url_host(address)}:{port}/metrics", timeout=2) as answer:
            if b"raycomp_" in answer.read(1 << 20):
                return  # our own controller's exporter: it is shared by every run
    except (OSError, ValueError):
        pass
    raise ConfigError(f"controller.metrics_port: {port} on {host} is in use by another program; "
                      "choose a free port (0 picks one)")


def train_examples(config: JobConfig) -> int | None:
    """Training examples of a classification workload (None: windows sampled from a corpus)."""
    from raycomp import data

    if config.workload.name == "digits":
        return DIGITS_TRAIN_EXAMPLES
    if config.workload.name == "fashion_mnist":
        root = Path(config.workload.data_dir or data.FASHION_MNIST_DIR)
        return data.idx_header(root / "train-labels-idx1-ubyte.gz")[0]
    return None


def check_sizes(config: JobConfig) -> None:
    """Batch and window sizes against the data, so no rank finds an empty epoch."""
    w, workers = config.workload, config.scaling.num_workers
    examples = train_examples(config)
    if examples is not None and w.batch_size * workers > examples:
        raise ConfigError(
            f"workload.batch_size: {w.batch_size} x {workers} workers (scaling.num_workers) exceeds the "
            f"{examples} training examples of {w.name}; at most {examples // workers} per worker")
    if w.name == "kjv" and w.max_chars is not None:
        test_chars = int(w.max_chars * 0.05)  # raycomp.data.CharCorpus.from_text holds out 5 %
        if test_chars <= w.block + 1:
            raise ConfigError(
                f"workload.block: {w.block} is too long for the {test_chars}-character test split of "
                f"workload.max_chars={w.max_chars}; use block < {test_chars - 1} or a larger max_chars")


def check_cluster_fits(config: JobConfig, address: str | None) -> None:
    """On an embedded cluster, the workers must fit this machine: Ray Train would otherwise
    wait for CPUs or GPUs that never come. (A running cluster may autoscale: not checked.)"""
    if address:
        return
    s = config.scaling
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # the run will use this process's cluster
        resources = ray.cluster_resources()
        cpus, gpus, where = resources.get("CPU", 0), resources.get("GPU", 0), "the Ray cluster of this process"
    else:
        cpus, gpus, where = local_cpus(), None, "this machine"
    if s.num_workers * s.cpus_per_worker > cpus:
        raise ConfigError(
            f"scaling.num_workers: {s.num_workers} workers x {s.cpus_per_worker:g} CPU each "
            f"(scaling.cpus_per_worker) need {s.num_workers * s.cpus_per_worker:g} CPUs; {where} "
            f"has {cpus:g} (set RAY_ADDRESS to use a cluster)")
    if s.use_gpu:
        if gpus is None:
            import torch

            gpus = torch.cuda.device_count()
        if gpus < s.num_workers:
            raise ConfigError(f"scaling.use_gpu: needs {s.num_workers} GPUs (one per worker, "
                              f"scaling.num_workers); {where} has {gpus:g}")


def check_controller_paths(config: JobConfig, address: str | None, default_sd_dir: str) -> None:
    """Where the controller writes (snapshots, the Prometheus file-SD list) must be writable."""
    if not _is_local(address):
        return
    c = config.controller
    if c.snapshot_dir is not None:
        check_writable_dir("controller.snapshot_dir", c.snapshot_dir)
    if c.metrics_enabled:
        check_writable_file("controller.metrics_sd_file", c.metrics_sd_file or f"{default_sd_dir}/{c.name}.json")
        if not _is_ip(c.metrics_host):
            try:
                socket.getaddrinfo(c.metrics_host, None)
            except (OSError, UnicodeError) as error:
                raise ConfigError(f"controller.metrics_host: cannot resolve {c.metrics_host!r} "
                                  f"({getattr(error, 'strerror', None) or error})") from None


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return False
