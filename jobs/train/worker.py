"""The loop every worker of a ``jobs.train`` run runs: a user of the public API,
:mod:`raycomp.train`. The workload, its precision, the evaluations (rank 0's, broadcast) and
``workload.stop_at_target``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["Precision", "TargetStop", "evaluated_once", "quiet_worker_logs", "train_loop"]


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
    baseline = {}  # raycomp's own gradient strategy, unless torch's communication takes its place
    if config.benchmark.baseline != "none":
        from jobs.baselines import torch_baseline

        baseline = {"gradient_strategy": torch_baseline(config.benchmark)}
    model = raycomp.train.prepare_model(workload.model, optimizer, scheduler, grad_scaler=precision.scaler,
                                        options=options, scheduler_interval="step",  # cosine over the run's steps
                                        **baseline)
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
    """raycomp's own lines (progress, guard events: the ``raycomp`` logger) at INFO on every
    worker, unless something configured that logger already; Ray's per-report chatter only
    when ``run.ray_logs`` is set."""
    raycomp_log = logging.getLogger("raycomp")
    if not raycomp_log.handlers:  # Ray streams a worker's stderr to the driver
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        raycomp_log.addHandler(handler)
        raycomp_log.setLevel(logging.INFO)
        raycomp_log.propagate = False
    if not ray_logs:  # some Ray Train modules name their logger by file path
        for name in ["ray.train", "ray.data", "ray.tune", *logging.root.manager.loggerDict]:
            if name.startswith(("ray.train", "ray.data", "ray.tune")) or "/ray/train/" in name:
                logging.getLogger(name).setLevel(logging.WARNING)
