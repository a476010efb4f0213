"""Several ``python -m jobs.train`` runs in one Ray Train fit: one worker group trains them
one after another, each with its own config, run id, output directory, controller
registration and summary, as if each had its own fit.

A Ray Train fit costs about 20 s of start-up on 2 cores (worker and controller actors
importing torch and Ray Train), more than a small run's training, so the runs that need no
fault of the worker group share one: each test module lists its own in ``IN_TURN`` (name ->
overrides of ``jobs/configs/digits.yaml``), and the session's one fit trains those of every
collected module (:func:`collected_runs`; the ``in_turn`` fixture hands a module its own). Not for runs that kill a worker or crash: a restarted
worker group would start the whole sequence over. Ray Train keeps the fit's checkpoints in
one directory (:func:`fit_checkpoints`); raycomp.train starts each run fresh even though
``ray.train.get_checkpoint()`` then returns the previous run's latest checkpoint.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from jobs.config import JobConfig
from jobs.faults import DrillConfig

FIT = "fit"  # the shared fit's Ray Train directory, beside the runs' output directories


def _in_turn(config: dict[str, Any]) -> list[dict[str, Any]]:
    import ray.train

    from jobs.train import train_loop

    done = []
    for run in config["runs"]:
        started = time.time()
        totals = train_loop(run)
        latest = ray.train.get_checkpoint()  # the run's last reported checkpoint
        done.append({**totals, "wall_seconds": time.time() - started, "checkpoint": latest and latest.path})
    return done


def train_in_turn(tmp_path: Path, config_file: str, runs: dict[str, tuple[str, ...]]) -> dict[str, dict[str, Any]]:
    """Each named run's summary (``summary.json``'s), trained in turn, in ``runs``' order, by
    one 2-worker fit; overrides that set ``faults.*`` make a run a drill
    (:class:`jobs.faults.DrillConfig`)."""
    from jobs.train import conclude, controller_for, loop_config, prepare, start_ray, trainer_for

    prepared = []
    for name, overrides in runs.items():
        schema = DrillConfig if any(o.startswith("faults.") for o in overrides) else JobConfig
        label = name.removeprefix("tests.").replace(":", "-")  # a directory name and a run id
        prepared.append(prepare(["--config", config_file, "--output", str(tmp_path / label),
                                 "--run-id", f"{label}-{tmp_path.name}", *overrides], schema))
    # what the worker group is made of (jobs.train.trainer_for) must be the same for every run
    group = {(c.scaling.num_workers, c.scaling.cpus_per_worker, c.scaling.use_gpu, c.scaling.placement_strategy,
              c.scaling.collective_timeout_s, c.checkpoint.max_failures) for c, _, _ in prepared}
    assert len(group) == 1, f"runs in one fit need one worker group, got {group}"
    start_ray()
    controllers = [controller_for(c, output.parent) for c, _, output in prepared]
    first = prepared[0][0]
    trainer = trainer_for(first, _in_turn, {"runs": [loop_config(*p) for p in prepared]}, tmp_path / FIT)
    workers = trainer.fit().return_value
    assert len(workers) == len(prepared), f"{len(workers)} runs came back of {len(prepared)}"
    return {name: {**conclude(config, run_id, output, controller, "succeeded", None, worker, worker["wall_seconds"]),
                   "checkpoint": worker["checkpoint"]}
            for name, (config, run_id, output), controller, worker
            in zip(runs, prepared, controllers, workers, strict=True)}


def collected_runs() -> dict[str, tuple[str, ...]]:
    """``IN_TURN`` of every imported test module (pytest imports them all while collecting,
    before any test runs), keyed ``"<module>:<name>"``."""
    runs = {}
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith("tests.test_") and isinstance(getattr(module, "IN_TURN", None), dict):
            runs.update({f"{module_name}:{name}": overrides for name, overrides in module.IN_TURN.items()})
    return runs


def runs_of(module_name: str, summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One module's summaries out of :func:`collected_runs`' keys, by its own names."""
    prefix = f"{module_name}:"
    return {key.removeprefix(prefix): summary for key, summary in summaries.items() if key.startswith(prefix)}
