"""The tune config: its typed sections, and :func:`load_tune_config`, which validates and
resolves one (base job config, search space, output folder) before Ray is touched."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from jobs.config import (
    ConfigError,
    apply_overrides,
    check_cluster_fits,
    check_metrics_endpoint,
    check_resources,
    check_sizes,
    check_writable_dir,
    load_config,
    one_line,
    read_yaml_mapping,
    validate,
)
from jobs.config.job_sections import Section
from jobs.tune.space import domain_values, flatten_search, set_key

__all__ = ["OBJECTIVE_MODES", "AshaSection", "BaseSection", "ObjectiveSection", "TuneSetup", "TuneSpec",
           "load_tune_config"]

OBJECTIVE_MODES = {"accuracy_at_budget": "max", "loss_at_budget": "min", "bytes_to_target": "min",
                   "time_to_target": "min"}


class BaseSection(Section):
    config: str | None = None  # a job config YAML (default: built-in defaults)
    overrides: list[str] = []  # key=value, as on the jobs.train command line


class ObjectiveSection(Section):
    """What a trial is scored by, after every epoch (see docs/tune.md)."""

    kind: Literal["accuracy_at_budget", "loss_at_budget", "bytes_to_target", "time_to_target"] = \
        "accuracy_at_budget"
    byte_budget: Annotated[float, Field(gt=0)] | None = None  # wire bytes, all ranks
    target_accuracy: Annotated[float, Field(gt=0, le=1)] | None = None  # workloads that report accuracy
    target_loss: Annotated[float, Field(gt=0)] | None = None  # workloads that report a loss (kjv)

    @model_validator(mode="after")
    def _needs(self) -> ObjectiveSection:
        if self.at_budget and self.byte_budget is None:
            raise ValueError(f"byte_budget is required for kind {self.kind}")
        if not self.at_budget and (self.target_accuracy is None) == (self.target_loss is None):
            raise ValueError(f"kind {self.kind} needs one of target_accuracy (higher is better) "
                             "or target_loss (lower is better)")
        return self

    @property
    def mode(self) -> str:
        return OBJECTIVE_MODES[self.kind]

    @property
    def at_budget(self) -> bool:
        return self.kind.endswith("_at_budget")

    @property
    def metric(self) -> str:
        """What the objective reads: the workload's "accuracy" or "loss"."""
        if self.at_budget:  # a target given beside a budget is not read
            return "loss" if self.kind == "loss_at_budget" else "accuracy"
        return "loss" if self.target_loss is not None else "accuracy"

    @property
    def target(self) -> float | None:
        if self.at_budget:
            return None
        return self.target_loss if self.target_loss is not None else self.target_accuracy

    def scorer(self) -> dict[str, Any]:
        """The arguments of :class:`Objective` (what each trial scores itself with)."""
        return {"kind": self.kind, "metric": self.metric, "byte_budget": self.byte_budget, "target": self.target}


class AshaSection(Section):
    enabled: bool = True
    grace_period: Annotated[int, Field(ge=1)] = 1  # epochs every trial gets
    reduction_factor: Annotated[float, Field(gt=1)] = 2.0


class TuneSpec(Section):
    name: Annotated[str, Field(min_length=1, max_length=48, pattern=r"^[A-Za-z0-9_.-]+$")] = "tune"
    output_dir: str = "outputs/tune"
    base: BaseSection = BaseSection()
    search: dict[str, Any]
    num_samples: Annotated[int, Field(ge=1, le=10_000)] = 8  # sampled trials (baselines extra)
    baselines: list[Literal["dense", "default"]] = ["dense", "default"]
    objective: ObjectiveSection
    asha: AshaSection = AshaSection()
    max_concurrent_trials: Annotated[int, Field(ge=1)] | None = None  # default: what the CPUs allow
    seed: Annotated[int, Field(ge=0)] = 0  # of the search's random sampling


class TuneSetup(BaseModel):
    """A validated tune config, resolved: everything the driver and the trials need."""

    spec: TuneSpec
    base: dict[str, Any]  # the base JobConfig, as JSON data
    search: dict[str, tuple[str, Any]]  # dotted config key -> (domain kind, arguments)
    exp_dir: Path

    @property
    def metric_key(self) -> str:
        """The column every trial reports its evaluation in: eval_accuracy or eval_loss."""
        return f"eval_{self.spec.objective.metric}"

    @property
    def epochs(self) -> int:
        return self.base["workload"]["epochs"]

    @property
    def tuner_dir(self) -> Path:
        return self.exp_dir / "tuner"

    @property
    def runs_dir(self) -> Path:
        return self.exp_dir / "runs"

    def fingerprint(self) -> dict[str, Any]:
        """What must not change between a search and its resume (not where it lives)."""
        return {"spec": self.spec.model_dump(mode="json", exclude={"output_dir", "name"}), "base": self.base,
                "search": {k: list(v) for k, v in self.search.items()}}


def load_tune_config(path: str | Path, overrides: list[str] = (), output: str | None = None,
                     name: str | None = None) -> TuneSetup:
    """Read, validate and resolve a tune config; raises ConfigError (one line)."""
    path = Path(path)
    data = apply_overrides(read_yaml_mapping(path, "tune config"), list(overrides))
    if output is not None:
        data["output_dir"] = output
    if name is not None:
        data["name"] = name
    try:
        spec = TuneSpec.model_validate(data)
    except ValidationError as error:
        raise ConfigError(one_line(error, "tune config: ")) from None

    base_path = None
    if spec.base.config is not None:
        base_path = Path(spec.base.config)
        if not base_path.is_file() and not base_path.is_absolute() and (path.parent / base_path).is_file():
            base_path = path.parent / base_path  # relative to the tune config's folder
    try:
        base_config = load_config(base_path, spec.base.overrides)
        check_resources(base_config)
    except ConfigError as error:
        raise ConfigError(f"base: {error}") from None
    from jobs.workloads import metric_of

    reported, wanted = metric_of(base_config.workload), spec.objective.metric
    if reported != wanted:
        use = ("kind loss_at_budget, or target_loss" if reported == "loss"
               else "kind accuracy_at_budget, or target_accuracy")
        raise ConfigError(f"objective: the base workload ({base_config.workload.name}) reports {reported}, "
                          f"not {wanted}: use {use} with bytes_to_target / time_to_target")
    base = base_config.model_dump(mode="json")
    if spec.asha.enabled and spec.asha.grace_period > base["workload"]["epochs"]:
        raise ConfigError(f"asha.grace_period: must be <= workload.epochs of the base config "
                          f"({base['workload']['epochs']}), got {spec.asha.grace_period}")

    search = flatten_search(spec.search)
    if not search:
        raise ConfigError("search: name at least one config key to search, e.g. "
                          "compression: {warmup_steps: {randint: [0, 40]}}")
    for key, (kind, args) in search.items():
        for value in domain_values(kind, args):
            try:
                trial = validate(set_key(copy.deepcopy(base), key, value))
                check_sizes(trial)  # e.g. a batch size the data cannot fill
                check_cluster_fits(trial, os.environ.get("RAY_ADDRESS"))  # workers this machine lacks
            except ConfigError as error:
                raise ConfigError(f"search.{key}: {value!r} is not a valid value ({error})") from None
    # where the search writes (tuner state, every trial's run): creatable/writable, checked last
    # so that a config error is reported before a path problem
    exp_dir = check_writable_dir("--output" if output is not None else "output_dir",
                                 Path(spec.output_dir).expanduser() / spec.name)
    c = base_config.controller
    if c.metrics_enabled and not os.environ.get("RAY_ADDRESS"):
        try:
            check_metrics_endpoint(c.metrics_host, c.metrics_port)  # the trials' controller binds it here
        except ConfigError as error:
            raise ConfigError(f"base: {error}") from None
    return TuneSetup(spec=spec, base=base, search=search, exp_dir=exp_dir)
