"""One trial: a ``jobs.train.run`` under its own run id, reporting its objective to Tune,
and the run registry through which a trial ASHA stops has its Train run aborted."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from jobs.config import JobConfig, validate
from jobs.tune.objective import TIME_ATTR, Objective
from jobs.tune.space import trial_config
from jobs.tune.spec import TuneSetup, TuneSpec

__all__ = ["RunRegistry", "ensure_controller", "finish_run", "registry_name", "run_trial",
           "stop_train_runs_callback"]

log = logging.getLogger("raycomp.tune")


def _report_callback(objective: dict[str, Any], run_id: str, variant: str, registry: tuple[str, str]) -> Any:
    """A TuneReportCallback that adds the objective (and the trial's identity) to each report.

    It runs in the trial's Train controller actor; before the first report reaches Tune it
    hands that actor's handle to the search's run registry, so that a trial ASHA stops can
    have its Train run aborted gracefully (see :func:`stop_train_runs_callback`).
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


def registry_name(spec: TuneSpec) -> tuple[str, str]:
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


def stop_train_runs_callback(name: str, registry_id: tuple[str, str], epochs: int) -> Any:
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
        finish_run(config, run_id, "stopped")
    ray.get(registry.finish.remote(run_id))
    if summary["status"] == "failed":
        raise RuntimeError(f"run {run_id} failed: {summary['error']}")


def ensure_controller(tuning: TuneSetup) -> Any:
    """Start the controller service from the driver, as ``jobs.train.run`` would: a service
    that cannot start then ends the search before any trial takes CPUs."""
    from jobs.train import controller_for

    return controller_for(validate(tuning.base), tuning.runs_dir)


def finish_run(config: JobConfig | dict[str, Any], run_id: str, status: str) -> None:
    """Tell the controller service how a run ended (it may never have been told)."""
    import ray

    section = config["controller"] if isinstance(config, dict) else config.controller.model_dump()
    try:
        controller = ray.get_actor(section["name"], namespace=section["namespace"])
        ray.get(controller.finish_run.remote(run_id, status), timeout=10)
    except Exception as failure:  # noqa: BLE001 - never registered (failed early), or gone
        log.debug("finish_run %s: %s", run_id, failure)
