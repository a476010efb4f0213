"""Typed, validated configuration for a training run, loaded from YAML plus overrides.

Everything is checked before any cluster resource is taken: unknown keys, wrong types,
out-of-range values and missing data sets raise :class:`ConfigError` with the dotted key
that is wrong and what is allowed. YAML is parsed with ``yaml.safe_load`` only: a config
is data, never code.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raycomp.plan import CompressorSpec

POLICIES = ("static", "schedule", "critical", "error_budget", "bandwidth")
WORKLOADS = ("digits", "fashion_mnist", "kjv")


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


class CompressionSection(_Strict):
    policy: Literal["static", "schedule", "critical", "error_budget", "bandwidth"] = "critical"
    warmup_steps: Annotated[int, Field(ge=0)] = 20  # dense first (all policies)
    memory: Literal["residual", "dgc", "none"] = "residual"
    min_compress_numel: Annotated[int, Field(ge=0)] = 1024
    static: StaticPolicy = StaticPolicy()
    schedule: SchedulePolicy = SchedulePolicy()
    critical: CriticalPolicy = CriticalPolicy()
    error_budget: ErrorBudgetPolicy = ErrorBudgetPolicy()
    bandwidth: BandwidthPolicy = BandwidthPolicy()
    guard: GuardSection = GuardSection()
    lr_scaling: LrScalingSection = LrScalingSection()
    #: compare against torch's own DDP hooks instead of raycomp's (benchmarks)
    baseline_hook: Literal["none", "torch_allreduce", "torch_fp16", "torch_powersgd"] = "none"
    baseline_powersgd_rank: Annotated[int, Field(ge=1)] = 2
    baseline_powersgd_start_iter: Annotated[int, Field(ge=1)] = 10

    def policy_options(self) -> dict[str, Any]:
        return getattr(self, self.policy).model_dump(mode="json")


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
    if config.workload.name == "fashion_mnist":
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
    if config.workload.name == "kjv" and shutil.which("bible") is None and not data.kjv_cache_file().is_file():
        raise ConfigError(
            "workload.name: kjv needs the Debian packages 'bible-kjv bible-kjv-text' "
            "(program 'bible' not found)"
        )
    if config.compression.memory == "dgc" and config.workload.momentum > 0:
        raise ConfigError(
            "compression.memory: 'dgc' applies momentum itself; set workload.momentum=0 "
            f"(got {config.workload.momentum})"
        )

