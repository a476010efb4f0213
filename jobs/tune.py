"""Search compression schedules with Ray Tune: every trial is a full Ray Train job.

    python -m jobs.tune --config jobs/configs/tune_digits.yaml [--output DIR] [--name NAME] [key=value ...]

The tune config names a base job config (like ``jobs.train --config``), a search space over
its keys, the objective and the ASHA settings; it is validated before Ray is touched (a bad
one exits with code 2 and one line naming the key). Each trial builds a ``TorchTrainer``
around ``jobs.train.train_loop``, registers its own run id with the controller service
(so every trial shows up on the dashboard) and reports once per epoch; ASHA stops trials
whose objective lags. Two baselines run as extra trials unless switched off: ``dense``
(plain all-reduce) and ``default`` (the base config unchanged).

Writes into ``<output_dir>/<name>/``: ``results.csv``, ``results.md``, ``best_config.yaml``
(a full job config for ``jobs.train`` / ``ray job submit``), ``pareto.png`` and ``runs/<run id>/``
(each trial's summary, step logs, checkpoints). Run the same command again to resume an
interrupted search (``Tuner.restore``); finished trials are not run again.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from raycomp.config import (
    ConfigError,
    JobConfig,
    apply_overrides,
    check_resources,
    load_config,
    validate,
)

log = logging.getLogger("raycomp.tune")
EXIT_BAD_INPUT = 2
REPO = Path(__file__).resolve().parents[1]
METRIC = "objective"
TIME_ATTR = "epochs_done"
DOMAINS = ("choice", "uniform", "loguniform", "randint", "lograndint")
OBJECTIVE_MODES = {"accuracy_at_budget": "max", "bytes_to_target": "min", "time_to_target": "min"}
DENSE = {"compression.policy": "static", "compression.static.compressor": {"name": "none"},
         "compression.warmup_steps": 0}


# --- the tune config -------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaseSection(_Strict):
    config: str | None = None  # a job config YAML (default: built-in defaults)
    overrides: list[str] = []  # key=value, as on the jobs.train command line


class ObjectiveSection(_Strict):
    """What a trial is scored by, after every epoch (see docs/tune.md)."""

    kind: Literal["accuracy_at_budget", "bytes_to_target", "time_to_target"] = "accuracy_at_budget"
    byte_budget: Annotated[float, Field(gt=0)] | None = None  # wire bytes, all ranks
    target_accuracy: Annotated[float, Field(gt=0, le=1)] | None = None

    @model_validator(mode="after")
    def _needs(self) -> ObjectiveSection:
        if self.kind == "accuracy_at_budget" and self.byte_budget is None:
            raise ValueError("byte_budget is required for kind accuracy_at_budget")
        if self.kind != "accuracy_at_budget" and self.target_accuracy is None:
            raise ValueError(f"target_accuracy is required for kind {self.kind}")
        return self

    @property
    def mode(self) -> str:
        return OBJECTIVE_MODES[self.kind]


class AshaSection(_Strict):
    enabled: bool = True
    grace_period: Annotated[int, Field(ge=1)] = 1  # epochs every trial gets
    reduction_factor: Annotated[float, Field(gt=1)] = 2.0


class TuneSpec(_Strict):
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


class TunePlan(BaseModel):
    """A validated tune config, resolved: everything the driver and the trials need."""

    spec: TuneSpec
    base: dict[str, Any]  # the base JobConfig, as JSON data
    search: dict[str, tuple[str, Any]]  # dotted config key -> (domain kind, arguments)
    exp_dir: Path

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
        return {"spec": self.spec.model_dump(mode="json"), "base": self.base,
                "search": {k: list(v) for k, v in self.search.items()}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="tune config YAML, e.g. jobs/configs/tune_digits.yaml")
    parser.add_argument("--output", help="output root (default: output_dir of the tune config)")
    parser.add_argument("--name", help="search name (default: name of the tune config)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="tune config overrides, e.g. num_samples=4 objective.byte_budget=5e7")
    return parser.parse_args(argv)


def load_tune_config(path: str | Path, overrides: list[str] = (), output: str | None = None,
                     name: str | None = None) -> TunePlan:
    """Read, validate and resolve a tune config; raises ConfigError (one line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tune config {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"tune config {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"tune config {str(path)!r}: top level must be a mapping")
    data = apply_overrides(data, list(overrides))
    if output is not None:
        data["output_dir"] = output
    if name is not None:
        data["name"] = name
    try:
        spec = TuneSpec.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_one_line(error)) from None

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
    if base_config.workload.name == "kjv":
        raise ConfigError("base: workload.name: the objectives need an accuracy; kjv reports a loss "
                          "(use digits or fashion_mnist)")
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
                validate(set_key(copy.deepcopy(base), key, value))
            except ConfigError as error:
                raise ConfigError(f"search.{key}: {value!r} is not a valid value ({error})") from None
    exp_dir = Path(spec.output_dir).expanduser().resolve() / spec.name
    if exp_dir.exists() and not exp_dir.is_dir():
        raise ConfigError(f"output_dir: {str(exp_dir)!r} exists and is not a directory")
    return TunePlan(spec=spec, base=base, search=search, exp_dir=exp_dir)


def flatten_search(tree: Any, prefix: str = "") -> dict[str, tuple[str, Any]]:
    """Nested ``{section: {key: {choice: [...]}}}`` -> ``{"section.key": ("choice", [...])}``."""
    where = f"search.{prefix}" if prefix else "search"
    if not isinstance(tree, dict):
        raise ConfigError(f"{where}: expected a mapping of config keys, got {tree!r}")
    kinds = [k for k in tree if k in DOMAINS]
    if kinds:
        if len(tree) != 1:
            raise ConfigError(f"{where}: a search domain has exactly one key ({', '.join(DOMAINS)}), "
                              f"got {sorted(tree)}")
        kind = kinds[0]
        return {prefix: (kind, check_domain(where, kind, tree[kind]))}
    out: dict[str, tuple[str, Any]] = {}
    for key, child in tree.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{where}: {key!r} is not a config key")
        path = f"{prefix}.{key}" if prefix else key
        if not isinstance(child, dict):
            raise ConfigError(f"search.{path}: expected a domain such as {{choice: [a, b]}}, "
                              f"{{uniform: [lo, hi]}}, {{loguniform: [lo, hi]}} or {{randint: [lo, hi]}}, "
                              f"got {child!r}")
        out.update(flatten_search(child, path))
    return out


def check_domain(where: str, kind: str, args: Any) -> Any:
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}.choice: expected a non-empty list of values, got {args!r}")
        return args
    if not (isinstance(args, list) and len(args) == 2
            and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)):
        raise ConfigError(f"{where}.{kind}: expected [low, high], got {args!r}")
    low, high = args
    if kind in ("randint", "lograndint") and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}.{kind}: expected integers [low, high], got {args!r}")
    if not low < high:
        raise ConfigError(f"{where}.{kind}: low must be < high, got {args!r}")
    if kind in ("loguniform", "lograndint") and low <= 0:
        raise ConfigError(f"{where}.{kind}: low must be > 0 on a log scale, got {args!r}")
    return [low, high]


def domain_values(kind: str, args: Any) -> list[Any]:
    """The values a domain can produce that bound it (every choice, both ends of a range)."""
    return list(args)


def to_tune_domain(kind: str, args: Any) -> Any:
    from ray import tune

    if kind == "choice":
        return tune.choice(args)
    if kind == "uniform":
        return tune.uniform(*args)
    if kind == "loguniform":
        return tune.loguniform(*args)
    if kind == "randint":
        return tune.randint(args[0], args[1] + 1)  # inclusive here, exclusive in Tune
    return tune.lograndint(args[0], args[1] + 1)


def set_key(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    node = data
    parts = dotted.split(".")
    for key in parts[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {key!r} is not a section")
        node = child
    node[parts[-1]] = copy.deepcopy(value)
    return data


def trial_config(base: dict[str, Any], variant: str, params: dict[str, Any]) -> JobConfig:
    """The job config a trial trains with."""
    data = copy.deepcopy(base)
    changes = DENSE if variant == "dense" else {} if variant == "default" else params
    for key, value in changes.items():
        set_key(data, key, value)
    return validate(data)


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    key = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-after"))
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif first["type"] == "literal_error":
        message = f"must be one of {first.get('ctx', {}).get('expected', '')}, got {first['input']!r}"
    elif first["type"] == "missing":
        message = "required"
    elif "input" in first and first["type"] not in ("value_error", "assertion_error"):
        message = f"{message} (got {first['input']!r})"
    return f"tune config: {key or 'config'}: {message}"


# --- the objective ---------------------------------------------------------------------
class Objective:
    """Scores a trial after each epoch from cumulative wire bytes and eval accuracy.

    ``accuracy_at_budget`` (maximise): the best ``accuracy * min(1, budget / wire_bytes)``
    so far: accuracy counts in full while the trial is within the byte budget and is
    discounted in proportion to the overshoot once it is not.
    ``bytes_to_target`` / ``time_to_target`` (minimise): the wire bytes / seconds at the
    first epoch that reached the target accuracy; before that, the linear projection
    ``spent * target / accuracy``.
    """

    def __init__(self, kind: str, byte_budget: float | None = None, target_accuracy: float | None = None):
        self.kind, self.budget, self.target = kind, byte_budget, target_accuracy
        self.best = -math.inf
        self.reached: float | None = None

    def update(self, accuracy: float, wire_bytes: float, elapsed_s: float) -> dict[str, Any]:
        if self.kind == "accuracy_at_budget":
            factor = min(1.0, self.budget / wire_bytes) if wire_bytes > 0 else 1.0
            self.best = max(self.best, accuracy * factor)
            return {METRIC: self.best, "within_budget": wire_bytes <= self.budget}
        spent = wire_bytes if self.kind == "bytes_to_target" else elapsed_s
        if self.reached is None and accuracy >= self.target:
            self.reached = spent
        if self.reached is not None:
            return {METRIC: self.reached, "reached_target": True}
        return {METRIC: spent * self.target / max(accuracy, 1e-3), "reached_target": False}


def _report_callback(objective: dict[str, Any], run_id: str, variant: str) -> Any:
    """A TuneReportCallback that adds the objective (and the trial's identity) to each report."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class ObjectiveReport(TuneReportCallback):
        def __init__(self) -> None:
            super().__init__()
            self.objective = Objective(**objective)
            self.started = time.time()

        def after_report(self, run_context, metrics, checkpoint):  # noqa: ANN001 - Ray's signature
            first = dict(metrics[0])
            elapsed = time.time() - self.started
            first.update(self.objective.update(float(first.get("eval_accuracy", 0.0)),
                                               float(first.get("wire_bytes", 0.0)), elapsed))
            first.update({TIME_ATTR: int(first.get("epoch", -1)) + 1, "trial_elapsed_s": elapsed,
                          "run_id": run_id, "variant": variant})
            super().after_report(run_context, [first, *metrics[1:]], checkpoint)

    return ObjectiveReport()


# --- one trial -------------------------------------------------------------------------
def run_trial(params: dict[str, Any], setup: dict[str, Any]) -> None:
    """The Tune function trainable: one Ray Train job under its own controller run id."""
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    variant = params["variant"]
    config = trial_config(setup["base"], variant, params["params"])
    run_id = f"{setup['name']}-{trial_id}"
    output = Path(setup["runs_dir"]) / run_id
    callback = _report_callback(setup["objective"], run_id, variant)
    summary = train_with_callbacks(config, run_id, output, [callback])
    if summary["status"] != "succeeded":
        raise RuntimeError(f"run {run_id} failed: {summary['error']}")


def train_with_callbacks(config: JobConfig, run_id: str, output: Path, callbacks: list[Any]) -> dict[str, Any]:
    """``jobs.train.run`` with Train callbacks (mirrors it step by step; see docs/tune.md)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from jobs.train import build_summary, train_loop, write_outputs
    from jobs.workloads import layer_sizes

    output.mkdir(parents=True, exist_ok=True)
    controller = _controller(config, output.parent)
    compression = config.compression
    initial_plan = ray.get(controller.register_run.remote(
        run_id, config.scaling.num_workers, layer_sizes(config.workload, config.run.seed),
        compression.policy, compression.policy_options(), compression.warmup_steps,
        config.controller.interval_steps, compression.min_compress_numel,
    ))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": config.model_dump(mode="json"), "run_id": run_id,
                           "output_dir": str(output), "initial_plan": initial_plan},
        scaling_config=ScalingConfig(num_workers=config.scaling.num_workers, use_gpu=config.scaling.use_gpu,
                                     resources_per_worker={"CPU": config.scaling.cpus_per_worker}),
        run_config=RunConfig(name=output.name, storage_path=str(output.parent), callbacks=callbacks,
                             failure_config=FailureConfig(max_failures=config.checkpoint.max_failures)),
    )
    started = time.time()
    status, error, result = "succeeded", None, None
    try:
        result = trainer.fit()
    except Exception as failure:  # noqa: BLE001 - recorded in summary.json, then the trial errors
        status, error = "failed", f"{type(failure).__name__}: {failure}"
    wall = time.time() - started
    try:
        controller_summary = ray.get(controller.finish_run.remote(run_id, status), timeout=30)
    except Exception as failure:  # noqa: BLE001 - the summary says so
        controller_summary = {"error": f"controller unreachable at the end: {failure}"}
    worker = (result.return_value if result is not None else None) or {}
    summary = build_summary(config, run_id, status, error, worker, controller_summary, wall, output)
    write_outputs(summary, output)
    return summary


def _controller(config: JobConfig, runs_dir: Path) -> Any:
    from controllers.service import get_or_create

    snapshot_dir = config.controller.snapshot_dir or str(runs_dir / "_controller")
    return get_or_create(config.controller.name, config.controller.namespace, snapshot_dir,
                         config.controller.max_restarts, config.controller.finished_run_grace_s)


# --- the search ------------------------------------------------------------------------
def trial_cpus(plan: TunePlan) -> float:
    scaling = plan.base["scaling"]
    return scaling["num_workers"] * scaling["cpus_per_worker"]


def search(plan: TunePlan) -> Any:
    """Run (or resume) the search; returns Tune's ResultGrid."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    spec = plan.spec
    cpus = ray.cluster_resources().get("CPU", 0)
    need = trial_cpus(plan)
    if need > cpus:
        raise ConfigError(f"base: scaling: a trial needs {need:g} CPUs "
                          f"(num_workers x cpus_per_worker), the cluster has {cpus:g}")
    # The trial function itself holds (almost) no CPU and trials never outnumber what the
    # CPUs can train at once: otherwise trials hold CPUs their worker groups wait for.
    concurrent = spec.max_concurrent_trials or max(1, int(cpus // need))
    setup = {"name": spec.name, "base": plan.base, "runs_dir": str(plan.runs_dir),
             "objective": spec.objective.model_dump(mode="json")}
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"CPU": 0.01})

    plan.runs_dir.mkdir(parents=True, exist_ok=True)
    _controller(validate(plan.base), plan.runs_dir)  # up before the first trial
    if tune.Tuner.can_restore(str(plan.tuner_dir)):
        print(f"resuming the search in {plan.tuner_dir}", flush=True)
        tuner = tune.Tuner.restore(str(plan.tuner_dir), trainable=trainable,
                                   resume_unfinished=True, resume_errored=False)
    else:
        scheduler = (ASHAScheduler(time_attr=TIME_ATTR, max_t=plan.epochs,
                                   grace_period=spec.asha.grace_period,
                                   reduction_factor=spec.asha.reduction_factor)
                     if spec.asha.enabled else FIFOScheduler())
        tuner = tune.Tuner(
            trainable,
            param_space={"variant": "search",
                         "params": {key: to_tune_domain(*domain) for key, domain in plan.search.items()}},
            tune_config=tune.TuneConfig(
                metric=METRIC, mode=spec.objective.mode, scheduler=scheduler,
                search_alg=BasicVariantGenerator(
                    points_to_evaluate=[{"variant": b} for b in spec.baselines], random_state=spec.seed),
                num_samples=spec.num_samples + len(spec.baselines),  # each point replaces a sample
                max_concurrent_trials=concurrent,
            ),
            run_config=tune.RunConfig(name=plan.tuner_dir.name, storage_path=str(plan.exp_dir),
                                      failure_config=tune.FailureConfig(max_failures=0), verbose=1),
        )
    return tuner.fit()


# --- results ---------------------------------------------------------------------------
def collect(plan: TunePlan, grid: Any) -> list[dict[str, Any]]:
    """One row per trial, best first."""
    rows = []
    for result in grid:
        config = result.config or {}
        metrics = result.metrics or {}
        variant = config.get("variant", "search")
        trial_id = metrics.get("trial_id") or Path(result.path).name
        epochs_done = int(metrics.get(TIME_ATTR, 0) or 0)
        if result.error is not None:
            status = "error"
        elif epochs_done >= plan.epochs:
            status = "completed"
        else:
            status = "stopped"
        wire, dense = metrics.get("wire_bytes"), metrics.get("dense_bytes")
        row = {
            "trial_id": trial_id,
            "run_id": metrics.get("run_id") or f"{plan.spec.name}-{trial_id}",
            "variant": variant,
            "status": status,
            "epochs": epochs_done,
            METRIC: metrics.get(METRIC),
            "eval_accuracy": metrics.get("eval_accuracy"),
            "wire_bytes": wire,
            "dense_bytes": dense,
            "compression_ratio": dense / wire if wire else None,
            "seconds": metrics.get("trial_elapsed_s"),
            "reached_target": metrics.get("reached_target"),
            "error": _first_line(result.error) if result.error is not None else "",
        }
        params = config.get("params", {}) if variant == "search" else {}
        for key in plan.search:  # baselines ignore the sampled values: blank
            row[key] = params.get(key, "")
        row["_params"] = params
        rows.append(row)
    return sorted(rows, key=lambda r: _rank_key(plan, r))


def _rank_key(plan: TunePlan, row: dict[str, Any]) -> tuple:
    order = {"completed": 0, "stopped": 1, "error": 2}[row["status"]]
    score = row[METRIC]
    if score is None:
        return (order, 1, math.inf)
    reached = 0 if row.get("reached_target") in (True, None) else 1
    signed = -score if plan.spec.objective.mode == "max" else score
    if plan.spec.objective.kind == "accuracy_at_budget":
        reached = 0
    return (order, reached, signed)


def _first_line(error: Any) -> str:
    text = str(error).strip().splitlines()
    return (text[-1] if text else type(error).__name__)[:200]


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    completed = [r for r in rows if r["status"] == "completed" and r[METRIC] is not None]
    return completed[0] if completed else None  # rows are sorted best first


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def write_tables(plan: TunePlan, rows: list[dict[str, Any]]) -> tuple[Path, Path]:
    columns = [c for c in rows[0] if not c.startswith("_")] if rows else ["trial_id"]
    csv_path, md_path = plan.exp_dir / "results.csv", plan.exp_dir / "results.md"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([json.dumps(row[c]) if isinstance(row[c], (dict, list)) else
                             "" if row[c] is None else row[c] for c in columns])
    objective = plan.spec.objective
    goal = (f"byte budget {objective.byte_budget:.4g}" if objective.kind == "accuracy_at_budget"
            else f"target accuracy {objective.target_accuracy}")
    shown = [c for c in columns if c not in ("error",)]
    lines = [
        f"# Tune results: {plan.spec.name}",
        "",
        f"Objective: `{objective.kind}` ({goal}, {objective.mode}imise). "
        f"{len(rows)} trials, best first; `stopped` = stopped early by ASHA.",
        "",
        "| " + " | ".join(shown) + " |",
        "| " + " | ".join("---:" if c in ("epochs", METRIC, "eval_accuracy", "wire_bytes", "dense_bytes",
                                           "compression_ratio", "seconds") else "---" for c in shown) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]).replace("|", "\\|") for c in shown) + " |")
    errors = [r for r in rows if r["error"]]
    if errors:
        lines += ["", "Errors:", ""] + [f"- `{r['trial_id']}`: {r['error']}" for r in errors]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def write_best_config(plan: TunePlan, best: dict[str, Any]) -> Path:
    config = trial_config(plan.base, best["variant"], best["_params"])
    data = config.model_dump(mode="json")
    data["run"]["name"] = f"{plan.spec.name}-best"[:64]
    validate(data)  # still a valid job config
    objective = plan.spec.objective
    header = [
        f"# Best compression schedule of the search {plan.spec.name!r} ({objective.kind}: "
        f"{best[METRIC]:.6g}, eval accuracy {best['eval_accuracy']}, wire bytes {best['wire_bytes']:.4g}).",
        f"# Trial {best['trial_id']} ({best['variant']}), run id {best['run_id']}.",
        "# Run it:  python -m jobs.train --config <this file>",
        "#     or:  ray job submit --working-dir . --runtime-env jobs/runtime_env.yaml -- "
        "python -m jobs.train --config <this file>",
    ]
    if best["variant"] != "search":
        header.append(f"# Note: the {best['variant']} baseline beat every searched schedule.")
    path = plan.exp_dir / "best_config.yaml"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)
    load_config(path)  # what users will do with it
    return path


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Completed trials no other completed trial beats on both accuracy and wire bytes."""
    points = [r for r in rows if r["status"] == "completed" and r["wire_bytes"] and r["eval_accuracy"] is not None]
    front = [p for p in points if not any(
        q["eval_accuracy"] >= p["eval_accuracy"] and q["wire_bytes"] <= p["wire_bytes"]
        and (q["eval_accuracy"] > p["eval_accuracy"] or q["wire_bytes"] < p["wire_bytes"]) for q in points)]
    return sorted(front, key=lambda r: r["wire_bytes"])


def plot_pareto(plan: TunePlan, rows: list[dict[str, Any]], best: dict[str, Any] | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    usable = [r for r in rows if r["wire_bytes"] and r["eval_accuracy"] is not None]
    searched = [r for r in usable if r["variant"] == "search"]
    for status, style in (("completed", {"color": "tab:blue", "alpha": 0.8}),
                          ("stopped", {"facecolors": "none", "edgecolors": "tab:gray"}),
                          ("error", {"color": "tab:red", "marker": "x"})):
        group = [r for r in searched if r["status"] == status]
        if group:
            ax.scatter([r["wire_bytes"] for r in group], [r["eval_accuracy"] for r in group], s=36,
                       label=f"searched, {status}" + (" (ASHA)" if status == "stopped" else ""), **style)
    markers = {"dense": ("s", "tab:red", "dense baseline (all-reduce)"),
               "default": ("D", "tab:orange", f"adaptive default ({plan.base['compression']['policy']})")}
    for variant, (marker, color, label) in markers.items():
        for r in (r for r in usable if r["variant"] == variant):
            ax.scatter([r["wire_bytes"]], [r["eval_accuracy"]], marker=marker, s=90, color=color,
                       edgecolors="black", zorder=3, label=label + ("" if r["status"] == "completed" else
                                                                    f" [{r['status']}]"))
    front = pareto_front(rows)
    if front:
        ax.plot([r["wire_bytes"] for r in front], [r["eval_accuracy"] for r in front], "--",
                color="tab:green", lw=1, label="Pareto front")
    if best is not None and best["wire_bytes"]:
        ax.scatter([best["wire_bytes"]], [best["eval_accuracy"]], marker="*", s=320, color="gold",
                   edgecolors="black", zorder=4, label=f"best ({plan.spec.objective.kind})")
    objective = plan.spec.objective
    if objective.kind == "accuracy_at_budget":
        ax.axvline(objective.byte_budget, color="gray", lw=0.8, ls=":", label="byte budget")
    else:
        ax.axhline(objective.target_accuracy, color="gray", lw=0.8, ls=":", label="target accuracy")
    ax.set_xscale("log")
    ax.set_xlabel("wire bytes, all ranks (log)")
    ax.set_ylabel("eval accuracy (last reported epoch)")
    ax.set_title(f"{plan.spec.name}: accuracy vs wire bytes ({len(rows)} trials)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = plan.exp_dir / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish_stopped_runs(plan: TunePlan, rows: list[dict[str, Any]]) -> None:
    """Trials ASHA stopped never reached their own finish_run: mark them for the controller."""
    import ray

    stopped = [r for r in rows if r["status"] != "completed"
               and not (plan.runs_dir / r["run_id"] / "summary.json").exists()]
    if not stopped:
        return
    controller = _controller(validate(plan.base), plan.runs_dir)
    for row in stopped:
        try:
            ray.get(controller.finish_run.remote(row["run_id"], row["status"]), timeout=10)
        except Exception as failure:  # noqa: BLE001 - never registered (failed early) or gone
            log.debug("finish_run %s: %s", row["run_id"], failure)


def report(plan: TunePlan, grid: Any) -> dict[str, Any]:
    rows = collect(plan, grid)
    finish_stopped_runs(plan, rows)
    best = best_row(rows)
    csv_path, md_path = write_tables(plan, rows)
    outputs = {"results_csv": str(csv_path), "results_md": str(md_path), "trials": len(rows), "best": None}
    if best is not None:
        outputs["best_config"] = str(write_best_config(plan, best))
        outputs["best"] = {k: v for k, v in best.items() if not k.startswith("_")}
    outputs["pareto_png"] = str(plot_pareto(plan, rows, best))
    (plan.exp_dir / "outputs.json").write_text(json.dumps(outputs, indent=2, default=str))
    return outputs


# --- the command -----------------------------------------------------------------------
def prepare(argv: list[str] | None = None) -> TunePlan:
    """Everything that can fail on bad input, before Ray is touched."""
    args = parse_args(argv)
    plan = load_tune_config(args.config, args.overrides, args.output, args.name)
    saved = plan.exp_dir / "tune_config.json"
    if saved.exists():
        before = json.loads(saved.read_text())
        if before != json.loads(json.dumps(plan.fingerprint())):
            changed = sorted(k for k in before["spec"] if before["spec"].get(k) != plan.fingerprint()["spec"].get(k))
            if before["base"] != plan.fingerprint()["base"]:
                changed.append("base config")
            raise ConfigError(
                f"output: {str(plan.exp_dir)!r} holds a search with a different config "
                f"(changed: {', '.join(changed) or 'search space'}); use another --name or --output, "
                "or delete that folder to start over")
    return plan


def run(plan: TunePlan) -> dict[str, Any]:
    import ray

    plan.exp_dir.mkdir(parents=True, exist_ok=True)
    (plan.exp_dir / "tune_config.json").write_text(json.dumps(plan.fingerprint(), indent=2))
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address or "local", log_to_driver=True,
                 runtime_env=None if address else {"env_vars": {"PYTHONPATH": str(REPO)}})
    grid = search(plan)
    return report(plan, grid)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        plan = prepare(argv)
        outputs = run(plan)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    best = outputs["best"]
    print(f"search {plan.spec.name}: {outputs['trials']} trials")
    if best is None:
        print("no trial completed: no best config (see results.md)")
    else:
        print(f"best: trial {best['trial_id']} ({best['variant']}), {plan.spec.objective.kind} "
              f"{best[METRIC]:.6g}, eval accuracy {best['eval_accuracy']:.4f}, "
              f"wire bytes {best['wire_bytes']:.4g}")
        print(f"best config: {outputs['best_config']}")
    print(f"results: {outputs['results_md']} (+ results.csv)")
    print(f"pareto plot: {outputs['pareto_png']}")
    print(f"output: {plan.exp_dir}")
    return 0 if best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
