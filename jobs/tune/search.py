"""The search itself: Ray Tune's Tuner over :func:`~jobs.tune.trials.run_trial`, with
ASHA, the baselines as first points, and resume from an interrupted search."""

from __future__ import annotations

from typing import Any

from jobs.config import ConfigError
from jobs.tune.objective import METRIC, TIME_ATTR
from jobs.tune.space import to_tune_domain
from jobs.tune.spec import TuneSetup
from jobs.tune.trials import (
    RunRegistry,
    ensure_controller,
    registry_name,
    run_trial,
    stop_train_runs_callback,
)

__all__ = ["TRIAL_RESOURCES", "search", "trial_cpus"]

TRIAL_RESOURCES = {"CPU": 0, "memory": 128 * 2**20}  # the trial function (a waiting driver)


def trial_cpus(tuning: TuneSetup) -> float:
    scaling = tuning.base["scaling"]
    return scaling["num_workers"] * scaling["cpus_per_worker"]


def search(tuning: TuneSetup) -> Any:
    """Run (or resume) the search; returns Tune's ResultGrid."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    spec = tuning.spec
    cpus = ray.cluster_resources().get("CPU", 0)
    need = trial_cpus(tuning)
    if need > cpus:
        raise ConfigError(f"base: scaling: a trial needs {need:g} CPUs "
                          f"(num_workers x cpus_per_worker), the cluster has {cpus:g}")
    # The trial function only waits on its TorchTrainer: it reserves memory, not CPU (even
    # 0.01 CPU would leave 1.99 of 2 CPUs, too few for 2 workers x 1 CPU: a deadlock), and
    # trials never outnumber what the CPUs can train at once (else their worker groups wait
    # on each other's CPUs).
    concurrent = spec.max_concurrent_trials or max(1, int(cpus // need))
    registry_id = registry_name(spec)
    registry = ray.remote(RunRegistry).options(name=registry_id[0], namespace=registry_id[1],
                                               get_if_exists=True, num_cpus=0).remote()
    setup = {"name": spec.name, "base": tuning.base, "runs_dir": str(tuning.runs_dir),
             "objective": spec.objective.scorer(), "registry": list(registry_id)}
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), TRIAL_RESOURCES)
    callbacks = [stop_train_runs_callback(spec.name, registry_id, tuning.epochs),
                 _progress_callback(tuning.metric_key)]

    tuning.runs_dir.mkdir(parents=True, exist_ok=True)
    ray.get(ensure_controller(tuning).health.remote())  # up, outside any trial's placement group
    if tune.Tuner.can_restore(str(tuning.tuner_dir)):
        print(f"resuming the search in {tuning.tuner_dir}", flush=True)
        tuner = tune.Tuner.restore(str(tuning.tuner_dir), trainable=trainable,
                                   resume_unfinished=True, resume_errored=False)
    else:
        scheduler = (ASHAScheduler(time_attr=TIME_ATTR, max_t=tuning.epochs,
                                   grace_period=spec.asha.grace_period,
                                   reduction_factor=spec.asha.reduction_factor,
                                   stop_last_trials=False)  # finishing trials end on their own
                     if spec.asha.enabled else FIFOScheduler())
        tuner = tune.Tuner(
            trainable,
            param_space={"variant": "search",
                         "params": {key: to_tune_domain(*domain) for key, domain in tuning.search.items()}},
            tune_config=tune.TuneConfig(
                metric=METRIC, mode=spec.objective.mode, scheduler=scheduler,
                # Tune ignores TuneConfig.max_concurrent_trials next to a BasicVariantGenerator
                search_alg=BasicVariantGenerator(
                    points_to_evaluate=[{"variant": b} for b in spec.baselines],
                    max_concurrent=concurrent, random_state=spec.seed),
                num_samples=spec.num_samples + len(spec.baselines),  # each point replaces a sample
            ),
            run_config=tune.RunConfig(name=tuning.tuner_dir.name, storage_path=str(tuning.exp_dir),
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
