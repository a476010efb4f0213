"""Search compression schedules with Ray Tune: every trial is a full Ray Train job.

    python -m jobs.tune --config jobs/configs/tune_digits.yaml [--output DIR] [--name NAME] [key=value ...]

The tune config names a base job config (like ``jobs.train --config``), a search space over
its keys, the objective and the ASHA settings; it is validated before Ray is touched (a bad
one exits with code 2 and one line naming the key). Each trial is a ``jobs.train.run``
(a ``TorchTrainer`` around ``jobs.train.train_loop``) under its own run id in the controller
service (so every trial shows up on the dashboard), reporting to Tune once per epoch; ASHA
stops trials whose objective lags. Two baselines run as extra trials unless switched off: ``dense``
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
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jobs.config import (
    ConfigError,
    JobConfig,
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

log = logging.getLogger("raycomp.tune")
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
REPO = Path(__file__).resolve().parents[1]
METRIC = "objective"
TIME_ATTR = "epochs_done"
DOMAINS = ("choice", "uniform", "loguniform", "randint", "lograndint")
OBJECTIVE_MODES = {"accuracy_at_budget": "max", "loss_at_budget": "min", "bytes_to_target": "min",
                   "time_to_target": "min"}
TRIAL_RESOURCES = {"CPU": 0, "memory": 128 * 2**20}  # the trial function (a waiting driver)
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


# --- the objective ---------------------------------------------------------------------
class Objective:
    """Scores a trial after each epoch from cumulative wire bytes and its evaluation metric
    (``metric``: "accuracy", higher is better, or "loss", lower is better).

    ``accuracy_at_budget`` (maximise) / ``loss_at_budget`` (minimise): the best so far of the
    metric made worse in proportion to the byte overshoot, ``over = max(1, wire_bytes / budget)``:
    ``accuracy / over`` or ``loss * over``. The metric counts in full while the trial is within
    the byte budget.
    ``bytes_to_target`` / ``time_to_target`` (minimise): the wire bytes / seconds at the
    first epoch that reached the target; before that, the linear projection
    ``spent * target / accuracy`` or ``spent * loss / target``.
    """

    def __init__(self, kind: str, metric: str = "accuracy", byte_budget: float | None = None,
                 target: float | None = None):
        self.kind, self.budget, self.target = kind, byte_budget, target
        self.lower = metric == "loss"
        self.best = math.inf if self.lower else -math.inf
        self.reached: float | None = None

    def update(self, value: float, wire_bytes: float, elapsed_s: float) -> dict[str, Any]:
        if self.kind.endswith("_at_budget"):
            over = max(1.0, wire_bytes / self.budget)
            score = value * over if self.lower else value / over
            self.best = min(self.best, score) if self.lower else max(self.best, score)
            return {METRIC: self.best, "within_budget": wire_bytes <= self.budget}
        spent = wire_bytes if self.kind == "bytes_to_target" else elapsed_s
        if self.reached is None and (value <= self.target if self.lower else value >= self.target):
            self.reached = spent
        if self.reached is not None:
            return {METRIC: self.reached, "reached_target": True}
        shortfall = value / self.target if self.lower else self.target / max(value, 1e-3)
        return {METRIC: spent * shortfall, "reached_target": False}


def _report_callback(objective: dict[str, Any], run_id: str, variant: str, registry: tuple[str, str]) -> Any:
    """A TuneReportCallback that adds the objective (and the trial's identity) to each report.

    It runs in the trial's Train controller actor; before the first report reaches Tune it
    hands that actor's handle to the search's run registry, so that a trial ASHA stops can
    have its Train run aborted gracefully (see :class:`StopTrainRuns`).
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    class ObjectiveReport(TuneReportCallback):
        def __init__(self) -> None:
            super().__init__()
            self.objective = Objective(**objective)
            self.key = f"eval_{objective['metric']}"
            self.missing = math.inf if self.objective.lower else 0.0  # no evaluation reported
            self.started = time.time()
            self.registered = False

        def after_report(self, run_context, metrics, checkpoint):  # noqa: ANN001 - Ray's signature
            if not self.registered:
                self.registered = _register_train_controller(registry, run_id)
            first = dict(metrics[0])
            elapsed = time.time() - self.started
            first.update(self.objective.update(float(first.get(self.key, self.missing)),
                                               float(first.get("wire_bytes", 0.0)), elapsed))
            first.update({TIME_ATTR: int(first.get("epoch", -1)) + 1, "trial_elapsed_s": elapsed,
                          "run_id": run_id, "variant": variant})
            super().after_report(run_context, [first, *metrics[1:]], checkpoint)

    return ObjectiveReport()


class RunRegistry:
    """A small actor of the search: run id -> the trial's Train controller, and who was stopped.

    Why: when ASHA stops a trial, Tune ends the trial's actor; the Train controller it owns
    dies with it before removing its workers' placement group, and that group's CPUs stay
    reserved for as long as the driver lives (Ray's own clean-up actor needs the dashboard's
    state API, which an embedded cluster does not run), so the next trial waits forever.
    Aborting the controller first (what Ctrl-C does to a plain ``fit()``) releases them.
    """

    def __init__(self) -> None:
        self.controllers: dict[str, Any] = {}
        self.stopped: set[str] = set()
        self.finished: set[str] = set()

    def add(self, run_id: str, controller: Any) -> None:
        self.controllers[run_id] = controller

    def finish(self, run_id: str) -> None:
        self.finished.add(run_id)
        self.controllers.pop(run_id, None)

    def stop(self, run_id: str) -> Any:
        """Mark ``run_id`` stopped; its controller if it is still training, else None."""
        if run_id in self.finished:
            return None
        self.stopped.add(run_id)
        return self.controllers.pop(run_id, None)

    def was_stopped(self, run_id: str) -> bool:
        return run_id in self.stopped

    def is_finished(self, run_id: str) -> bool:
        return run_id in self.finished


def _registry_name(spec: TuneSpec) -> tuple[str, str]:
    return f"raycomp-tune-{spec.name}", "raycomp-tune"


def _register_train_controller(registry: tuple[str, str], run_id: str) -> bool:
    import ray

    try:
        actor = ray.get_actor(*registry)
        ray.get(actor.add.remote(run_id, ray.get_runtime_context().current_actor), timeout=30)
        return True
    except Exception as failure:  # noqa: BLE001 - early stopping then leaks CPUs: say so
        log.warning("run %s: not registered for graceful early stopping: %s", run_id, failure)
        return False


def _stop_train_runs_callback(name: str, registry_id: tuple[str, str], epochs: int) -> Any:
    import ray
    from ray.tune import Callback

    class StopTrainRuns(Callback):
        """Aborts the Train run of a trial Tune stops, before Tune ends the trial's actor.

        (Pickled into the experiment state, so it finds the registry by name: a resumed
        search has a new one.)
        """

        def on_trial_complete(self, iteration, trials, trial, **info):  # noqa: ANN001
            run_id = f"{name}-{trial.trial_id}"
            try:
                registry = ray.get_actor(*registry_id)
                if (trial.last_result or {}).get(TIME_ATTR, 0) >= epochs:
                    # every epoch trained (ASHA may still say STOP at its last rung): let the
                    # run end on its own before Tune ends the trial's actor
                    _wait_finished(registry, run_id, timeout_s=120)
                controller = ray.get(registry.stop.remote(run_id))
            except Exception as failure:  # noqa: BLE001
                log.warning("run %s: cannot reach the run registry: %s", run_id, failure)
                return
            if controller is None:
                return
            print(f"[tune] {trial.trial_id}: stopped early by ASHA, aborting its Train run", flush=True)
            try:
                ray.get(controller.abort.remote(), timeout=120)
            except Exception:  # noqa: BLE001, S110 - abort() ends by exiting the controller actor
                pass
            # let the trial record itself as stopped before Tune ends its actor
            _wait_finished(registry, run_id, timeout_s=60)

    return StopTrainRuns()


def _wait_finished(registry: Any, run_id: str, timeout_s: float) -> bool:
    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if ray.get(registry.is_finished.remote(run_id)):
            return True
        time.sleep(0.25)
    return False


# --- one trial -------------------------------------------------------------------------
def run_trial(params: dict[str, Any], setup: dict[str, Any]) -> None:
    """The Tune function trainable: one ``jobs.train.run`` under its own controller run id."""
    import ray
    from ray import tune

    from jobs.train import run as train_run
    from jobs.train import write_outputs

    trial_id = tune.get_context().get_trial_id()
    variant = params["variant"]
    config = trial_config(setup["base"], variant, params["params"])
    run_id = f"{setup['name']}-{trial_id}"
    output = Path(setup["runs_dir"]) / run_id
    registry_id = tuple(setup["registry"])
    registry = ray.get_actor(*registry_id)
    callback = _report_callback(setup["objective"], run_id, variant, registry_id)
    summary = train_run(config, run_id, output, callbacks=[callback])
    if summary["status"] == "failed" and ray.get(registry.was_stopped.remote(run_id)):
        # ASHA stopped it and its Train run was aborted: that is no failure
        summary.update(status="stopped", error=None)
        write_outputs(summary, output)
        _finish_run(config, run_id, "stopped")
    ray.get(registry.finish.remote(run_id))
    if summary["status"] == "failed":
        raise RuntimeError(f"run {run_id} failed: {summary['error']}")


def ensure_controller(plan: TunePlan) -> Any:
    """Start the controller service from the driver, as ``jobs.train.run`` would: a service
    that cannot start then ends the search before any trial takes CPUs."""
    from jobs.train import controller_for

    return controller_for(validate(plan.base), plan.runs_dir)


def _finish_run(config: JobConfig | dict[str, Any], run_id: str, status: str) -> None:
    """Tell the controller service how a run ended (it may never have been told)."""
    import ray

    section = config["controller"] if isinstance(config, dict) else config.controller.model_dump()
    try:
        controller = ray.get_actor(section["name"], namespace=section["namespace"])
        ray.get(controller.finish_run.remote(run_id, status), timeout=10)
    except Exception as failure:  # noqa: BLE001 - never registered (failed early), or gone
        log.debug("finish_run %s: %s", run_id, failure)


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
    # The trial function only waits on its TorchTrainer: it reserves memory, not CPU (even
    # 0.01 CPU would leave 1.99 of 2 CPUs, too few for 2 workers x 1 CPU: a deadlock), and
    # trials never outnumber what the CPUs can train at once (else their worker groups wait
    # on each other's CPUs).
    concurrent = spec.max_concurrent_trials or max(1, int(cpus // need))
    registry_id = _registry_name(spec)
    registry = ray.remote(RunRegistry).options(name=registry_id[0], namespace=registry_id[1],
                                               get_if_exists=True, num_cpus=0).remote()
    setup = {"name": spec.name, "base": plan.base, "runs_dir": str(plan.runs_dir),
             "objective": spec.objective.scorer(), "registry": list(registry_id)}
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), TRIAL_RESOURCES)
    callbacks = [_stop_train_runs_callback(spec.name, registry_id, plan.epochs),
                 _progress_callback(plan.metric_key)]

    plan.runs_dir.mkdir(parents=True, exist_ok=True)
    ray.get(ensure_controller(plan).health.remote())  # up, outside any trial's placement group
    if tune.Tuner.can_restore(str(plan.tuner_dir)):
        print(f"resuming the search in {plan.tuner_dir}", flush=True)
        tuner = tune.Tuner.restore(str(plan.tuner_dir), trainable=trainable,
                                   resume_unfinished=True, resume_errored=False)
    else:
        scheduler = (ASHAScheduler(time_attr=TIME_ATTR, max_t=plan.epochs,
                                   grace_period=spec.asha.grace_period,
                                   reduction_factor=spec.asha.reduction_factor,
                                   stop_last_trials=False)  # finishing trials end on their own
                     if spec.asha.enabled else FIFOScheduler())
        tuner = tune.Tuner(
            trainable,
            param_space={"variant": "search",
                         "params": {key: to_tune_domain(*domain) for key, domain in plan.search.items()}},
            tune_config=tune.TuneConfig(
                metric=METRIC, mode=spec.objective.mode, scheduler=scheduler,
                # Tune ignores TuneConfig.max_concurrent_trials next to a BasicVariantGenerator
                search_alg=BasicVariantGenerator(
                    points_to_evaluate=[{"variant": b} for b in spec.baselines],
                    max_concurrent=concurrent, random_state=spec.seed),
                num_samples=spec.num_samples + len(spec.baselines),  # each point replaces a sample
            ),
            run_config=tune.RunConfig(name=plan.tuner_dir.name, storage_path=str(plan.exp_dir),
                                      failure_config=tune.FailureConfig(max_failures=0),
                                      callbacks=callbacks, verbose=0),
        )
    try:
        return tuner.fit()
    finally:
        ray.kill(registry)


def _progress_callback(key: str) -> Any:
    from ray.tune import Callback

    class Progress(Callback):
        """One line per epoch and per finished trial (Tune's own table is too wide to read)."""

        def on_trial_result(self, iteration, trials, trial, result, **info):  # noqa: ANN001
            print(f"[tune] {trial.trial_id} ({trial.config.get('variant')}) epoch {result.get(TIME_ATTR)}: "
                  f"{key.replace('_', ' ')} {result.get(key, float('nan')):.4f}, wire bytes "
                  f"{result.get('wire_bytes', 0):.4g}, {METRIC} {result.get(METRIC, float('nan')):.6g}",
                  flush=True)

        def on_trial_complete(self, iteration, trials, trial, **info):  # noqa: ANN001
            print(f"[tune] {trial.trial_id} finished", flush=True)

        def on_trial_error(self, iteration, trials, trial, **info):  # noqa: ANN001
            print(f"[tune] {trial.trial_id} failed: see {trial.path}", flush=True)

    return Progress()


# --- results ---------------------------------------------------------------------------
SUMMARY_STATUS = {"succeeded": "completed", "stopped": "stopped", "failed": "error"}


def collect(plan: TunePlan, grid: Any, complete: bool = True) -> list[dict[str, Any]]:
    """One row per trial, best first. Status: completed, stopped (by ASHA), error, or
    unfinished (the search was interrupted before the trial ended)."""
    rows = []
    for result in grid:
        config = result.config or {}
        metrics = result.metrics or {}
        variant = config.get("variant", "unknown")
        found = re.search(r"[0-9a-f]{5}_\d{5}", Path(result.path).name)
        trial_id = metrics.get("trial_id") or (found.group(0) if found else Path(result.path).name)
        run_id = metrics.get("run_id") or f"{plan.spec.name}-{trial_id}"
        epochs_done = int(metrics.get(TIME_ATTR, 0) or 0)
        summary = plan.runs_dir / run_id / "summary.json"
        recorded = json.loads(summary.read_text()).get("status") if summary.exists() else None
        if result.error is not None:
            status = "error"
        elif recorded == "failed":  # Tune saw no error: the failure is ASHA's abort
            status = "stopped"
        elif recorded in SUMMARY_STATUS:  # what the trial itself wrote at its end
            status = SUMMARY_STATUS[recorded]
        elif not complete:
            status = "unfinished"
        else:
            status = "completed" if epochs_done >= plan.epochs else "stopped"
        wire, dense = metrics.get("wire_bytes"), metrics.get("dense_bytes")
        row = {
            "trial_id": trial_id,
            "run_id": run_id,
            "variant": variant,
            "status": status,
            "epochs": epochs_done,
            METRIC: metrics.get(METRIC),
            plan.metric_key: metrics.get(plan.metric_key),
            "wire_bytes": wire,
            "dense_bytes": dense,
            "compression_ratio": dense / wire if wire else None,
            "seconds": metrics.get("trial_elapsed_s"),
            **({} if plan.spec.objective.at_budget
               else {"reached_target": metrics.get("reached_target")}),
            "error": _first_line(result.error) if result.error is not None else "",
        }
        params = config.get("params", {}) if variant == "search" else {}
        for key in plan.search:  # baselines ignore the sampled values: blank
            row[key] = params.get(key, "")
        row["_params"] = params
        rows.append(row)
    return sorted(rows, key=lambda r: _rank_key(plan, r))


def _rank_key(plan: TunePlan, row: dict[str, Any]) -> tuple:
    order = {"completed": 0, "stopped": 1, "unfinished": 2, "error": 3}[row["status"]]
    score = row[METRIC]
    if score is None:
        return (order, 1, math.inf)
    reached = 0 if row.get("reached_target") in (True, None) else 1
    signed = -score if plan.spec.objective.mode == "max" else score
    return (order, reached, signed, row["wire_bytes"] or math.inf)  # ties: fewer bytes first


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
    goal = (f"byte budget {objective.byte_budget:.4g}" if objective.at_budget
            else f"target {objective.metric} {objective.target}")
    shown = [c for c in columns if c not in ("error",)]
    lines = [
        f"# Tune results: {plan.spec.name}",
        "",
        f"Objective: `{objective.kind}` ({goal}, {objective.mode}imise). "
        f"{len(rows)} trials, best first; `stopped` = stopped early by ASHA"
        + ("; `unfinished` = the search was interrupted: run the same command to resume it."
           if any(r["status"] == "unfinished" for r in rows) else "."),
        "",
        "| " + " | ".join(shown) + " |",
        "| " + " | ".join("---:" if c in ("epochs", METRIC, plan.metric_key, "wire_bytes", "dense_bytes",
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
        f"{best[METRIC]:.6g}, {plan.metric_key.replace('_', ' ')} {best[plan.metric_key]}, "
        f"wire bytes {best['wire_bytes']:.4g}).",
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


def pareto_front(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Completed trials no other completed trial beats on both the metric ``key`` (a loss:
    lower is better) and wire bytes."""
    sign = -1.0 if key == "eval_loss" else 1.0
    points = [(sign * r[key], r) for r in rows
              if r["status"] == "completed" and r["wire_bytes"] and r[key] is not None]
    front = [p for m, p in points if not any(
        n >= m and q["wire_bytes"] <= p["wire_bytes"] and (n > m or q["wire_bytes"] < p["wire_bytes"])
        for n, q in points)]
    return sorted(front, key=lambda r: r["wire_bytes"])


def plot_pareto(plan: TunePlan, rows: list[dict[str, Any]], best: dict[str, Any] | None,
                complete: bool = True) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    key = plan.metric_key
    usable = [r for r in rows if r["wire_bytes"] and r[key] is not None]
    searched = [r for r in usable if r["variant"] == "search"]
    for status, style in (("completed", {"color": "tab:blue", "alpha": 0.8}),
                          ("stopped", {"facecolors": "none", "edgecolors": "tab:gray"}),
                          ("unfinished", {"facecolors": "none", "edgecolors": "tab:purple"}),
                          ("error", {"color": "tab:red", "marker": "x"})):
        group = [r for r in searched if r["status"] == status]
        if group:
            ax.scatter([r["wire_bytes"] for r in group], [r[key] for r in group], s=36,
                       label=f"searched, {status}" + (" (ASHA)" if status == "stopped" else ""), **style)
    markers = {"dense": ("s", "tab:red", "dense baseline (all-reduce)"),
               "default": ("D", "tab:orange", f"adaptive default ({plan.base['compression']['policy']})")}
    for variant, (marker, color, label) in markers.items():
        for r in (r for r in usable if r["variant"] == variant):
            ax.scatter([r["wire_bytes"]], [r[key]], marker=marker, s=90, color=color,
                       edgecolors="black", zorder=3, label=label + ("" if r["status"] == "completed" else
                                                                    f" [{r['status']}]"))
    front = pareto_front(rows, key)
    if front:
        ax.plot([r["wire_bytes"] for r in front], [r[key] for r in front], "--", marker="|",
                color="tab:green", lw=1, label="Pareto front")
    if best is not None and best["wire_bytes"]:
        ax.scatter([best["wire_bytes"]], [best[key]], marker="*", s=320, color="gold",
                   edgecolors="black", zorder=4, label=f"best ({plan.spec.objective.kind})")
    objective = plan.spec.objective
    if objective.at_budget:
        ax.axvline(objective.byte_budget, color="gray", lw=0.8, ls=":", label="byte budget")
    else:
        ax.axhline(objective.target, color="gray", lw=0.8, ls=":", label=f"target {objective.metric}")
    ax.set_xscale("log")
    ax.set_xlabel("wire bytes, all ranks (log)")
    ax.set_ylabel(f"{key.replace('_', ' ')} (last reported epoch)")
    ax.set_title(f"{plan.spec.name}: {objective.metric} vs wire bytes ({len(rows)} trials"
                 + ("" if complete else ", interrupted") + ")")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right" if objective.metric == "loss" else "lower right")
    fig.tight_layout()
    path = plan.exp_dir / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish_stopped_runs(plan: TunePlan, rows: list[dict[str, Any]]) -> None:
    """Make each stopped trial's summary and controller record say so (a trial Tune ended
    quickly may not have managed it itself)."""
    from jobs.train import write_summary

    for row in rows:
        if row["status"] == "completed":
            continue
        path = plan.runs_dir / row["run_id"] / "summary.json"
        summary = json.loads(path.read_text()) if path.exists() else None
        if summary is not None and row["status"] == "stopped" and summary.get("status") == "failed":
            summary.update(status="stopped", error=None)
            write_summary(summary, path.parent)
        if summary is None or summary.get("status") == "stopped":
            _finish_run(plan.base, row["run_id"], row["status"])


def report(plan: TunePlan, grid: Any) -> dict[str, Any]:
    expected = plan.spec.num_samples + len(plan.spec.baselines)
    complete = grid.num_terminated + grid.num_errors >= expected
    rows = collect(plan, grid, complete)
    if complete:
        finish_stopped_runs(plan, rows)
    best = best_row(rows) if complete else None
    csv_path, md_path = write_tables(plan, rows)
    outputs = {"results_csv": str(csv_path), "results_md": str(md_path), "trials": len(rows),
               "expected_trials": expected, "complete": complete, "best": None}
    if best is not None:
        outputs["best_config"] = str(write_best_config(plan, best))
        outputs["best"] = {k: v for k, v in best.items() if not k.startswith("_")}
    outputs["pareto_png"] = str(plot_pareto(plan, rows, best, complete))
    (plan.exp_dir / "outputs.json").write_text(json.dumps(outputs, indent=2, default=str))
    return outputs


# --- the command -----------------------------------------------------------------------
def prepare(argv: list[str] | None = None) -> TunePlan:
    """Everything that can fail on bad input, before Ray is touched."""
    args = parse_args(argv)
    plan = load_tune_config(args.config, args.overrides, args.output, args.name)
    saved = plan.exp_dir / "tune_config.json"
    if saved.exists():
        try:
            before = json.loads(saved.read_text())
        except (OSError, ValueError):
            before = None
        if not (isinstance(before, dict) and isinstance(before.get("spec"), dict) and "base" in before):
            raise ConfigError(f"output: {str(saved)!r} is unreadable or not a tune config; use another "
                              "--name or --output, or delete that folder to start over")
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
    print(f"search {plan.spec.name}: {outputs['trials']} of {outputs['expected_trials']} trials")
    if not outputs["complete"]:
        print(f"search interrupted: partial results in {outputs['results_md']}; "
              "run the same command again to resume it")
        return EXIT_INTERRUPTED
    if best is None:
        print("no trial completed: no best config (see results.md)")
    else:
        print(f"best: trial {best['trial_id']} ({best['variant']}), {plan.spec.objective.kind} "
              f"{best[METRIC]:.6g}, {plan.metric_key.replace('_', ' ')} {best[plan.metric_key]:.4f}, "
              f"wire bytes {best['wire_bytes']:.4g}")
        print(f"best config: {outputs['best_config']}")
    print(f"results: {outputs['results_md']} (+ results.csv)")
    print(f"pareto plot: {outputs['pareto_png']}")
    print(f"output: {plan.exp_dir}")
    return 0 if best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
