"""Several training runs in one Ray Train fit: one worker group trains them one after another,
each with its own run id, output directory and controller registration, as if each had its
own fit.

A Ray Train fit costs about 20 s of start-up on 2 cores (worker and controller actors
importing torch and Ray Train), more than a small run's training, so the runs that need no
fault of the worker group share one. Each test module lists its own in ``IN_TURN``, name ->
either the overrides of a ``python -m jobs.train`` run of ``jobs/configs/digits.yaml`` (its
summary comes back, as ``summary.json`` holds it) or a training function of the module
(``fn(config) -> value``, ``config`` as :func:`tests.support.controller_fit.fit_with_controller` gives it,
plus ``"run_id"``; rank 0's value comes back with the run's output directory). Runs that only
long checks read (``-m long``, left out of the default run) go in ``LONG_IN_TURN``. The
session's one fit trains the runs the selected tests read (:func:`collected_runs`); the
``in_turn`` fixture hands a module its own.

Not for runs that kill a worker or crash: a restarted worker group would start the whole
sequence over. Ray Train keeps the fit's checkpoints in one directory; each result names its
run's last one (``"checkpoint"``). raycomp.train starts each run fresh although
``ray.train.get_checkpoint()`` returns the previous run's last one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jobs.config import JobConfig
from jobs.faults import DrillConfig

FIT = "fit"  # the shared fit's Ray Train directory, beside the runs' output directories
Run = tuple[str, ...] | Callable[[dict[str, Any]], Any]


def _in_turn(config: dict[str, Any]) -> list[dict[str, Any]]:
    import ray.train

    def latest() -> str | None:
        found = ray.train.get_checkpoint()
        return found.path if found is not None else None

    done = []
    for fn, arg in config["runs"]:
        started, before = time.time(), latest()
        value = fn(arg)
        after = latest()  # the run's last reported checkpoint, unless it reported none
        done.append({"value": value, "wall_seconds": time.time() - started,
                     "checkpoint": after if after != before else None})
    return done


def train_in_turn(tmp_path: Path, config_file: str, runs: dict[str, Run]) -> dict[str, dict[str, Any]]:
    """Each named run's result, trained in turn, in ``runs``' order, by one 2-worker fit. A
    ``jobs.train`` run whose overrides set ``faults.*`` is a drill (:class:`jobs.faults.DrillConfig`)."""
    from jobs.train import (
        conclude,
        controller_for,
        loop_config,
        prepare,
        start_ray,
        train_loop,
        trainer_for,
    )

    jobs, calls = {}, []
    for name, run in runs.items():
        label = name.removeprefix("tests.").replace(":", "-")  # a directory name and a run id
        run_id, output = f"{label}-{tmp_path.name}", tmp_path / label
        if callable(run):
            calls.append((run, {"controller": None, "output_dir": str(output / "out"), "run_id": run_id}))
            continue
        schema = DrillConfig if any(o.startswith("faults.") for o in run) else JobConfig
        jobs[name] = prepare(["--config", config_file, "--output", str(output), "--run-id", run_id, *run], schema)
        calls.append((train_loop, loop_config(*jobs[name])))
    if not jobs:  # the worker group and the controller come from the config file's defaults
        jobs[""] = prepare(["--config", config_file, "--output", str(tmp_path / FIT)])
    # what the worker group is made of (jobs.train.trainer_for) must be the same for every run
    group = {(c.scaling.num_workers, c.scaling.cpus_per_worker, c.scaling.use_gpu, c.scaling.placement_strategy,
              c.scaling.collective_timeout_s, c.checkpoint.max_failures) for c, _, _ in jobs.values()}
    assert len(group) == 1, f"runs in one fit need one worker group, got {group}"
    first = next(iter(jobs.values()))[0]
    for fn, arg in calls:
        if fn is not train_loop:
            arg["controller"] = first.controller.name  # the service every run of the fit registers with
    start_ray()
    controllers = {name: controller_for(c, output.parent) for name, (c, _, output) in jobs.items()}
    trainer = trainer_for(first, _in_turn, {"runs": calls}, tmp_path / FIT)
    done = trainer.fit().return_value
    assert len(done) == len(calls), f"{len(done)} runs came back of {len(calls)}"
    results = {}
    for name, (fn, arg), result in zip(runs, calls, done, strict=True):
        if fn is train_loop:
            config, run_id, output = jobs[name]
            summary = conclude(config, run_id, output, controllers[name], "succeeded", None, result["value"],
                               result["wall_seconds"])
            results[name] = {**summary, "checkpoint": result["checkpoint"]}
        else:
            results[name] = {"value": result["value"], "output_dir": Path(arg["output_dir"]),
                             "checkpoint": result["checkpoint"]}
    return results


def collected_runs(items: Iterable[Any]) -> dict[str, Run]:
    """The runs the selected test ``items`` read, keyed ``"<module>:<name>"``: a module's
    ``IN_TURN`` when one of its selected tests uses the ``in_turn`` fixture (directly or
    through another fixture), and its ``LONG_IN_TURN`` too when such a test is a long check.
    A module none of whose selected tests reads the shared fit adds nothing to it."""
    long_check: dict[str, bool] = {}  # module -> whether a long check of it reads the shared fit
    for item in items:
        if "in_turn" in getattr(item, "fixturenames", ()):
            name = item.module.__name__
            long_check[name] = long_check.get(name, False) or item.get_closest_marker("long") is not None
    runs = {}
    for module_name, any_long in sorted(long_check.items()):
        module = sys.modules[module_name]
        for table in (getattr(module, "IN_TURN", {}), getattr(module, "LONG_IN_TURN", {}) if any_long else {}):
            runs.update({f"{module_name}:{name}": run for name, run in table.items()})
    return runs


def runs_of(module_name: str, results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One module's results out of :func:`collected_runs`' keys, by its own names."""
    prefix = f"{module_name}:"
    return {key.removeprefix(prefix): result for key, result in results.items() if key.startswith(prefix)}
