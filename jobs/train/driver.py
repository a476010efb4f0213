"""The driver of a ``jobs.train`` run: Ray (the cluster in ``RAY_ADDRESS``, or an embedded
one), the controller service the workers register with, one ``TorchTrainer`` fit of
:func:`~jobs.train.worker.train_loop`, and at the end the controller told and the summary
written."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from jobs.config import JobConfig
from jobs.train.summary import build_summary, write_outputs
from jobs.train.worker import train_loop

__all__ = ["conclude", "controller_for", "loop_config", "run", "start_ray", "trainer_for"]


def controller_for(config: JobConfig, runs_dir: Path) -> Any:
    """The controller service this config names, started (detached) if it is not running.

    Its snapshots default to ``<runs_dir>/_controller``, beside the runs it steers.
    """
    from raycomp.train import ControllerCallback

    snapshot_dir = config.controller.snapshot_dir or str(runs_dir / "_controller")
    return ControllerCallback(config.controller, snapshot_dir).actor


def run(config: JobConfig, run_id: str, output: Path, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Train ``config`` as one Ray Train run; returns (and writes) its summary.

    ``callbacks`` are extra Ray Train callbacks, e.g. Tune's report callback.
    """
    output.mkdir(parents=True, exist_ok=True)
    start_ray()
    controller = controller_for(config, output.parent)  # the workers register the run
    trainer = trainer_for(config, train_loop, loop_config(config, run_id, output), output, callbacks)
    started = time.time()
    status, error, result = "succeeded", None, None
    try:
        result = trainer.fit()
    except Exception as failure:  # noqa: BLE001 - recorded in summary.json, exit code 1
        status, error = "failed", f"{type(failure).__name__}: {failure}"
    worker = (result.return_value if result is not None else None) or {}
    return conclude(config, run_id, output, controller, status, error, worker, time.time() - started)


def start_ray() -> None:
    """Connect to the cluster in ``RAY_ADDRESS``, or start an embedded one (not a cluster
    that ``ray start`` left on this machine); nothing if Ray is already initialised."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}}
                 if not os.environ.get("RAY_ADDRESS") else None)


def loop_config(config: JobConfig, run_id: str, output: Path) -> dict[str, Any]:
    """What :func:`train_loop` gets on every worker for this run."""
    return {"config": config.model_dump(mode="json"), "schema": type(config), "run_id": run_id,
            "output_dir": str(output)}


def trainer_for(config: JobConfig, train_func: Any, train_loop_config: dict[str, Any], output: Path,
                callbacks: list[Any] | None = None) -> Any:
    """The ``TorchTrainer`` of ``config``'s scaling, fault tolerance and collective timeout,
    storing Ray Train's checkpoints in ``output``."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        train_func,
        train_loop_config=train_loop_config,
        scaling_config=ScalingConfig(num_workers=config.scaling.num_workers, use_gpu=config.scaling.use_gpu,
                                     resources_per_worker={"CPU": config.scaling.cpus_per_worker},
                                     placement_strategy=config.scaling.placement_strategy),
        torch_config=TorchConfig(timeout_s=int(config.scaling.collective_timeout_s)),
        run_config=RunConfig(name=output.name, storage_path=str(output.parent),
                             failure_config=FailureConfig(max_failures=config.checkpoint.max_failures),
                             callbacks=list(callbacks or [])),
    )


def conclude(config: JobConfig, run_id: str, output: Path, controller: Any, status: str, error: str | None,
             worker: dict[str, Any], wall: float) -> dict[str, Any]:
    """After the run: tell the controller it ended, write ``summary.json`` and the plot."""
    import ray

    try:
        controller_summary = ray.get(controller.finish_run.remote(run_id, status), timeout=30)
    except Exception as failure:  # noqa: BLE001 - the summary says so
        controller_summary = {"error": f"controller unreachable at the end: {failure}"}
    summary = build_summary(config, run_id, status, error, worker, controller_summary, wall, output)
    write_outputs(summary, output)
    return summary
