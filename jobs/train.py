"""Train with adaptive gradient compression as a Ray Train job.

    python -m jobs.train --config jobs/configs/fashion_mnist.yaml [--output DIR] [key=value ...]
    ray job submit --working-dir . -- python -m jobs.train --config jobs/configs/digits.yaml

Runs on the cluster in ``RAY_ADDRESS`` if set, else on an embedded local Ray. The config
is validated (and the data checked) before Ray is touched: a bad config exits with code 2
and one line naming the key. The run writes ``summary.json``, ``plot.png``, per-rank step
logs and checkpoints into its output directory, printed at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from jobs.config import (
    ConfigError,
    JobConfig,
    check_metrics_endpoint,
    check_resources,
    check_writable_dir,
    load_config,
)

log = logging.getLogger("raycomp.train")
EXIT_BAD_INPUT = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: built-in defaults)")
    parser.add_argument("--output", help="output directory (default: <run.storage_path>/<run id>)")
    parser.add_argument("--run-id", help="run id (default: <run.name>-<time>-<random>)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. compression.policy=static workload.epochs=2")
    return parser.parse_args(argv)


def prepare(argv: list[str] | None = None, schema: type[JobConfig] = JobConfig) -> tuple[JobConfig, str, Path]:
    """Everything that can fail on bad input, before any cluster resource is taken. The
    config is a ``schema``: :class:`JobConfig`, or the fault drill's ``jobs.faults.DrillConfig``."""
    args = parse_args(argv)
    config = load_config(args.config, args.overrides, schema)
    check_resources(config)
    run_id = args.run_id or f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    if not all(c.isalnum() or c in "-_." for c in run_id):
        raise ConfigError(f"--run-id: only letters, digits, '-', '_' and '.' are allowed, got {run_id!r}")
    # the directory the run writes into (summary, step logs, checkpoints): creatable/writable
    if args.output:
        output = check_writable_dir("--output", args.output)
    else:
        output = check_writable_dir("run.storage_path", config.run.storage_path) / run_id
        if output.exists() and not output.is_dir():
            raise ConfigError(f"--run-id: {str(output)!r} exists and is not a directory")
    c = config.controller
    if c.metrics_enabled and not os.environ.get("RAY_ADDRESS"):
        check_metrics_endpoint(c.metrics_host, c.metrics_port)  # the exporter binds it on this machine
    return config, run_id, output


# --- the worker loop: a user of the public API, raycomp.train ---------------------------
def train_loop(loop_config: dict[str, Any]) -> dict[str, Any]:
    import torch

    import raycomp.train
    from jobs.faults import DrillConfig, FaultInjector, FaultsSection
    from jobs.workloads import build, optimizer_for

    config = loop_config["schema"].model_validate(loop_config["config"])
    quiet_worker_logs(config.run.ray_logs)
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    torch.set_num_threads(max(1, int(config.scaling.cpus_per_worker)))
    workload = build(config.workload, context.get_world_rank(), context.get_world_size(), config.run.seed)
    optimizer, scheduler = optimizer_for(config.workload, workload.model,
                                         workload.steps_per_epoch * config.workload.epochs)
    options = raycomp.train.TrainOptions(
        compression=config.compression, controller=config.controller, checkpoint=config.checkpoint,
        output_dir=loop_config["output_dir"], run_id=loop_config["run_id"], seed=config.run.seed,
        progress_every=config.run.progress_every_steps, eval_kind="loss" if workload.metric == "loss" else "accuracy",
        eval_metric=None,  # evaluate() below records each evaluation, also those between reports
        strategy=config.scaling.strategy)
    precision = Precision(config.workload.precision, ray.train.torch.get_device().type)
    strategy = raycomp._internal.train.default_strategy.raycomp_strategy
    if config.benchmark.baseline != "none":  # torch's own communication in raycomp's place
        from jobs.baselines import torch_baseline

        strategy = torch_baseline(config.benchmark)
    model = raycomp.train.prepare_model(workload.model, optimizer, scheduler, grad_scaler=precision.scaler,
                                        options=options, gradient_strategy=strategy,
                                        scheduler_interval="step")  # cosine over the run's steps
    loop = raycomp.train.current()
    loss_fn = workload.loss
    if isinstance(config, DrillConfig) and config.faults != FaultsSection():  # a drill: wrap the loop
        injector = FaultInjector(config.faults, loop.rank, Path(loop_config["output_dir"]))
        injector.install(loop)
        loss_fn = injector.wrap_loss(loss_fn, lambda: loop.global_step)
    name, every = f"eval_{workload.metric}", config.workload.eval_every_steps
    metric, evaluated_at = None, -1
    stop = TargetStop(config.workload.stop_at_target, config.workload.stop_consecutive,
                      lower_is_better=workload.metric == "loss", group=loop.control_group)

    def evaluate() -> float:
        nonlocal evaluated_at
        value = evaluated_once(lambda: workload.evaluate(getattr(model, "module", model)), loop.rank,
                               loop.control_group, sharded=config.scaling.strategy == "fsdp")
        raycomp.train.record_eval({name: value}, value)
        evaluated_at = loop.global_step
        return value

    for epoch in loop.epochs(config.workload.epochs, workload.steps_per_epoch):
        for x, y in workload.batches(epoch, loop.step_in_epoch):
            with precision.autocast():
                loss = loss_fn(model(x), y)
            precision.backward(loss)
            raycomp.train.step(loss, samples=len(y))
            if every and loop.global_step % every == 0:
                metric = evaluate()
                if stop.held(metric):
                    break
        last = epoch + 1 == config.workload.epochs or stop.stopped
        if (not every or last) and evaluated_at != loop.global_step:
            metric = evaluate()  # once per epoch; with eval_every_steps, at the end as well
        raycomp.train.report({name: metric} if metric is not None else {})
        if stop.stopped:
            break
    totals = raycomp.train.finish()
    return {**totals, "epochs": config.workload.epochs, "world_size": context.get_world_size(),
            f"final_eval_{workload.metric}": metric}


def evaluated_once(evaluate: Any, rank: int, group: Any, *, sharded: bool) -> float:
    """The evaluation metric on every rank, computed once: rank 0 evaluates its replica and
    broadcasts the value (TargetStop and the reports follow rank 0's anyway). Workers that
    share a machine's cores no longer each evaluate the whole validation set. A sharded
    model (FSDP) needs every rank in its forward: there every rank evaluates."""
    import torch
    import torch.distributed as dist

    if sharded or not (dist.is_initialized() and dist.get_world_size() > 1):
        return evaluate()
    value = torch.tensor([evaluate() if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(value, src=0, group=group)
    return float(value.item())


class Precision:
    """``workload.precision`` on one worker: the autocast the forward pass runs under and,
    for fp16, the GradScaler that scales the loss for backward. raycomp.train unscales the
    gradients, steps the optimizer and updates the scale."""

    def __init__(self, precision: str, device_type: str) -> None:
        import torch

        self.device_type = device_type
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None

    def autocast(self) -> Any:
        import torch

        return torch.autocast(self.device_type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None)

    def backward(self, loss: Any) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()


class TargetStop:
    """``workload.stop_at_target``: stop once the evaluation metric has reached ``target``
    at ``consecutive`` evaluations in a row (benchmarks measure time to target). Rank 0
    decides and broadcasts, so every rank leaves the loop after the same step."""

    def __init__(self, target: float | None, consecutive: int, *, lower_is_better: bool, group: Any) -> None:
        self.target, self.consecutive, self.lower = target, consecutive, lower_is_better
        self.group, self.count, self.stopped = group, 0, False

    def held(self, metric: float) -> bool:
        if self.target is None:
            return False
        import torch
        import torch.distributed as dist

        reached = metric <= self.target if self.lower else metric >= self.target
        self.count = self.count + 1 if reached else 0
        decision = torch.tensor([float(self.count >= self.consecutive)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(decision, src=0, group=self.group)
        self.stopped = bool(decision.item())
        return self.stopped


def quiet_worker_logs(ray_logs: bool) -> None:
    """raycomp's own lines (progress, guard events) at INFO; Ray's per-report chatter only
    when ``run.ray_logs`` is set."""
    from raycomp._internal.train.step_log import show_progress

    show_progress()
    if not ray_logs:  # some Ray Train modules name their logger by file path
        for name in ["ray.train", "ray.data", "ray.tune", *logging.root.manager.loggerDict]:
            if name.startswith(("ray.train", "ray.data", "ray.tune")) or "/ray/train/" in name:
                logging.getLogger(name).setLevel(logging.WARNING)


# --- the driver ------------------------------------------------------------------------
def controller_for(config: JobConfig, runs_dir: Path) -> Any:
    """The controller service this config names, started (detached) if it is not running.

    Its snapshots default to ``<runs_dir>/_controller``, beside the runs it steers.
    """
    from raycomp._internal.observe.metrics import SD_DIR
    from raycomp.controllers.service import get_or_create

    c = config.controller
    sd_file = c.metrics_sd_file or f"{SD_DIR}/{c.name}.json"
    metrics = {"host": c.metrics_host, "port": c.metrics_port, "sd_file": sd_file} if c.metrics_enabled else None
    snapshot_dir = c.snapshot_dir or str(runs_dir / "_controller")
    return get_or_create(c.name, c.namespace, snapshot_dir, c.max_restarts, c.finished_run_grace_s, metrics)


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
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}}
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


def build_summary(config: JobConfig, run_id: str, status: str, error: str | None, worker: dict[str, Any],
                  controller: dict[str, Any], wall: float, output: Path) -> dict[str, Any]:
    wire, dense = worker.get("wire_bytes_total", 0.0), worker.get("dense_bytes_total", 0.0)
    steps = worker.get("steps", 0)
    summary = {
        "run_id": run_id,
        "status": status,
        "error": error,
        "steps": steps,
        "epochs": worker.get("epochs", 0),
        "world_size": worker.get("world_size", config.scaling.num_workers),
        "workload": config.workload.name,
        "wire_bytes_total": wire,
        "dense_bytes_total": dense,
        "compression_ratio": dense / wire if wire else None,
        "plan_switches": worker.get("plan_switches", 0),
        "fallback_events": worker.get("fallback_events", []),
        "skipped_steps": worker.get("skipped_steps", 0),
        "wall_seconds": wall,
        "steps_per_second": steps / wall if wall > 0 else 0.0,
        "controller_outages": worker.get("controller_outages", 0),
        "control_overhead": worker.get("control_overhead"),
        "control_seconds": worker.get("control_seconds"),
        "control_boundary_seconds": worker.get("control_boundary_seconds"),  # of control_seconds
        "stats_dropped": worker.get("stats_dropped", 0),
        "replayed_steps": worker.get("replayed_steps", 0),
        "restored_from_step": worker.get("restored_from_step"),
        "final_plan": worker.get("final_plan"),
        "ddp_bucket_cap_mb": worker.get("ddp_bucket_cap_mb"),
        "policy": {"name": config.compression.policy, **controller},
        "output_dir": str(output),
        "config": config.model_dump(mode="json"),
    }
    for key in ("final_eval_accuracy", "final_eval_loss"):
        if key in worker:
            summary[key] = worker[key]
    warnings = []
    if worker.get("controller_outages"):
        warnings.append(f"controller unreachable {worker['controller_outages']} times; "
                        "training continued on the last plan")
    if "error" in controller:
        warnings.append(controller["error"])
    summary["warnings"] = warnings
    return summary


def write_summary(summary: dict[str, Any], output: Path) -> None:
    """``summary.json``, replaced atomically."""
    from raycomp._internal.train.summary import write_summary as write

    write(summary, output)


def write_outputs(summary: dict[str, Any], output: Path) -> None:
    write_summary(summary, output)
    try:
        plot(output)
    except Exception as failure:  # noqa: BLE001 - a missing plot must not lose the summary
        log.warning("plot failed: %s", failure)


def plot(output: Path) -> None:
    """Loss and per-step compression ratio of rank 0 over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (output / "steps" / "rank0.jsonl").read_text().splitlines()]
    if not records:
        return
    steps = [r["step"] for r in records]
    ratios, previous = [], (0.0, 0.0)
    for r in records:
        wire, dense = r["wire_bytes"] - previous[0], r["dense_bytes"] - previous[1]
        ratios.append(dense / wire if wire > 0 else float("nan"))
        previous = (r["wire_bytes"], r["dense_bytes"])
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.plot(steps, [r["loss"] for r in records], lw=0.8)
    top.set_ylabel("training loss (rank 0)")
    bottom.plot(steps, ratios, lw=0.8, color="tab:green")
    bottom.set_yscale("log")
    bottom.set_ylabel("compression ratio (dense / wire)")
    bottom.set_xlabel("step")
    for r in records:
        if r["fallback"]:
            bottom.axvspan(r["step"] - 0.5, r["step"] + 0.5, color="tab:red", alpha=0.15, lw=0)
    fig.suptitle(output.name)
    fig.tight_layout()
    fig.savefig(output / "plot.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None, schema: type[JobConfig] = JobConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config, run_id, output = prepare(argv, schema)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from jobs.policy_report import intro, outcome

    print("\n".join(intro(config)), flush=True)  # the link the policy plans for
    summary = run(config, run_id, output)
    print("\n".join(outcome(summary)))  # what the policy chose, and why
    ratio = summary["compression_ratio"]
    metric = summary.get("final_eval_accuracy", summary.get("final_eval_loss"))
    print(f"run {run_id}: {summary['status']}, {summary['steps']} steps, eval {metric}, "
          f"compression ratio {ratio:.1f}x" if ratio else f"run {run_id}: {summary['status']}")
    print(f"output: {output}")
    return 0 if summary["status"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
