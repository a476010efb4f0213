"""raycomp for Ray Train users: adaptive gradient compression in a few lines.

::

    import raycomp.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_func(config):
        model, optimizer = MyModel(), torch.optim.SGD(...)
        model = raycomp.train.prepare_model(model, optimizer)   # DDP + hook + controller link
        loop = raycomp.train.current()
        for epoch in loop.epochs(num_epochs, steps_per_epoch):  # resumes at a checkpoint
            for x, y in my_batches(epoch, start=loop.step_in_epoch):
                loss = loss_fn(model(x), y)
                loss.backward()                                 # fp16: grad_scaler.scale(loss).backward()
                raycomp.train.step(loss, samples=len(y))       # guard, optimizer, boundary
            raycomp.train.report({"accuracy": evaluate(model)})  # + evaluation; last epoch: checkpoint
        return raycomp.train.finish()                          # run totals (rank 0's is returned)

    TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="my-run",
                                      callbacks=[raycomp.train.ControllerCallback()])).fit()

:class:`ControllerCallback` starts (or finds) the controller service when it is built, on
the driver. Options: :class:`TrainOptions`.

:func:`report` records the evaluation it carries (``TrainOptions.eval_metric``, default
``"accuracy"``): a line of rank 0's ``evals.jsonl``, and the value reaches the controller
with the next statistics. It checkpoints in the last epoch, and more often when
``TrainOptions.checkpoint`` says (:class:`raycomp.config.CheckpointSection`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from raycomp._internal.train.default_strategy import raycomp_strategy
from raycomp._internal.train.finish_watch import watch
from raycomp._internal.train.loop import TrainLoop
from raycomp._internal.train.plan_agreement import PlanMismatchError
from raycomp._internal.train.resume import forget_finished_run
from raycomp._internal.train.run_state import RankParts
from raycomp._internal.train.scaler_check import refuse_scaler
from raycomp._internal.train.step_arguments import SchedulerInterval, check_scheduler
from raycomp._internal.train.wrapped_model import refuse_wrapped
from raycomp.train.callback import ControllerCallback
from raycomp.train.gradient_strategy import GradientStrategyFactory
from raycomp.train.options import TrainOptions, resolve_options

if TYPE_CHECKING:
    import ray.train

#: what a Ray Train user calls; the rest (the loop's parts, the gradient-strategy extension
#: point in :mod:`raycomp.train.gradient_strategy`, ``start_loop``/``finish_loop`` for the
#: framework integrations) is internal and may change
__all__ = ["ControllerCallback", "PlanMismatchError", "TrainLoop", "TrainOptions", "current", "finish",
           "prepare_model", "record_eval", "report", "save_state", "step"]

_loop: TrainLoop | None = None


def prepare_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None, *,
                  grad_scaler: torch.amp.GradScaler | None = None,
                  options: TrainOptions | None = None,
                  gradient_strategy: GradientStrategyFactory = raycomp_strategy,
                  scheduler_interval: SchedulerInterval | None = None) -> torch.nn.Module:
    """Wrap ``model`` in DDP (``ray.train.torch.prepare_model``) with raycomp's comm hook,
    link this worker to the controller, restore from ``ray.train.get_checkpoint()`` if it
    holds raycomp state, and return the model to train.

    ``model`` is your plain model: one already wrapped in ``DistributedDataParallel``
    (``ray.train.torch.prepare_model`` left in place) or FSDP1 is refused with a one-line
    ``ValueError``, before anything is built; one sharded with ``fully_shard`` (FSDP2) is
    taken as it is with ``strategy="fsdp"``.

    The controller service must be running (``RunConfig(callbacks=[ControllerCallback()])``,
    under the name ``options.controller.name``): without it this raises a one-line
    ``RuntimeError``, unless ``ControllerSection(required=False)`` opts in to training dense
    for the whole run.

    Args:
        model: your model, on this worker's device; ``optimizer`` and ``scheduler`` (optional)
            over its parameters — raycomp steps them in :func:`step`.
        scheduler_interval: required with a ``scheduler``: ``"step"`` steps it after every
            step, ``"epoch"`` after the last step of each epoch of ``loop.epochs(...)``
            (before that epoch's :func:`report`, so a checkpoint holds it as stepped).
        grad_scaler: your ``torch.amp.GradScaler`` for fp16 training with loss scaling (not
            needed for bf16). Call ``grad_scaler.scale(loss).backward()`` and then
            :func:`step` with the unscaled ``loss``: raycomp unscales the gradients before
            the guard judges them (unless you did, to clip them), steps the optimizer and
            updates the scale; error feedback follows the scale, and the scaler's state is
            checkpointed. An overflow is skipped as the scaler would skip it, without a
            fallback to dense.
        options: see :class:`TrainOptions` (default: the adaptive policy, K=10).
        gradient_strategy: builds how the gradients travel (:mod:`raycomp.train.gradient_strategy`):
            ``factory(model, optimizer, StrategySetup) -> GradientStrategy``. The default,
            :func:`raycomp_strategy`, is raycomp's compressed DDP hook or, with
            ``options.strategy="fsdp"``, its compressed reduce-scatter. Pass another factory
            to put something else in their place (a benchmark's torch baselines do) while
            the guard, the controller link, the step log and checkpoints stay as they are.
    """
    options = options or TrainOptions()
    refuse_wrapped(model, options.strategy)  # before anything is built
    return start_loop(model, optimizer, scheduler, grad_scaler=grad_scaler, options=options,
                      gradient_strategy=gradient_strategy, scheduler_interval=scheduler_interval).model


def start_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None, *,
               grad_scaler: torch.amp.GradScaler | None = None, options: TrainOptions | None = None,
               gradient_strategy: GradientStrategyFactory = raycomp_strategy, owns_optimizer: bool = True,
               resume: Callable[[RankParts], None] | None = None,
               scheduler_interval: SchedulerInterval | None = None) -> TrainLoop:
    """The :class:`TrainLoop` behind :func:`prepare_model`, for code that drives the step
    itself (:mod:`raycomp.integrations`: Lightning, the Hugging Face Trainer): it calls
    ``loop.after_backward`` and ``loop.after_optimizer_step`` around its own optimizer step
    and :func:`finish_loop` at the end. The loop is also :func:`current`.

    Args: as :func:`prepare_model`'s; ``owns_optimizer`` and ``resume``: as
    :class:`TrainLoop`'s (False and a restore of raycomp's own state, for a framework that
    steps, zeroes and checkpoints the optimizer itself).
    """
    global _loop
    options = options or TrainOptions()
    check_scheduler(scheduler, scheduler_interval)
    refuse_scaler(grad_scaler, options)
    options = resolve_options(options, optimizer)  # once: what the run uses and registers
    controller = _find_controller(options)
    _loop = TrainLoop(model, optimizer, scheduler, options=options, controller=controller, grad_scaler=grad_scaler,
                      gradient_strategy=gradient_strategy, owns_optimizer=owns_optimizer, resume=resume,
                      scheduler_interval=scheduler_interval)
    # a training function that returns without finish(): warned, and finished for it
    watch(_loop, lambda loop: _loop is loop, finish_loop)
    return _loop


def current() -> TrainLoop:
    """This worker's :class:`TrainLoop` (after :func:`prepare_model`)."""
    if _loop is None:
        raise RuntimeError("call raycomp.train.prepare_model(...) first, in the training function")
    return _loop


def step(loss: torch.Tensor, samples: int = 0, clip_grad_norm: float | None = None) -> bool:
    """After ``loss.backward()``: guard, optimizer step unless skipped, control boundary.
    ``samples``: this rank's batch size (for samples/s). Returns whether the step applied.

    ``clip_grad_norm``: clip the gradient to this total 2-norm
    (``torch.nn.utils.clip_grad_norm_``) before the optimizer steps. raycomp clips the
    gradient averaged over the ranks (identical on every rank), after a GradScaler's
    unscale and after the guard judged the unclipped gradient. Clipping yourself between
    ``backward()`` and :func:`step` clips only this rank's gradient where the reduction
    finishes inside :func:`step` (a dense plan on a small model). During local steps
    (``compression.local``) there is no averaged gradient: each rank clips its own."""
    return current().step(loss, samples, clip_grad_norm)


def record_eval(metrics: dict[str, Any], value: float | None = None) -> None:
    """Log an evaluation (a line of rank 0's ``evals.jsonl``: ``metrics``, step, epoch, time);
    ``value`` is what the controller sees. Call it on every rank. Not needed for an
    evaluation you pass to :func:`report` (see ``TrainOptions.eval_metric``); for one you
    make between reports."""
    current().record_eval(metrics, value)


def report(metrics: dict[str, Any], checkpoint: bool | ray.train.Checkpoint | None = None) -> None:
    """``ray.train.report(metrics)`` on every rank, with raycomp's byte totals added.

    An evaluation: when ``metrics`` hold ``TrainOptions.eval_metric`` (default
    ``"accuracy"``), the call also records them as :func:`record_eval` would, with that
    metric's value for the controller, unless an evaluation was recorded at this step.

    A checkpoint (model, optimizer, scheduler, every rank's compressor and error-feedback
    state): ``checkpoint=True`` writes one, ``False`` none; ``None`` (the default) writes one
    in the last epoch of ``loop.epochs(...)``, and besides every ``checkpoint.every_epochs``
    epochs and at an epoch end on a multiple of ``checkpoint.every_steps`` when they are
    set (:class:`raycomp.config.CheckpointSection`). A ``ray.train.Checkpoint`` of your own
    (as for ``ray.train.report``, e.g. on rank 0 only) is kept: the reported checkpoint holds
    a copy of its files with raycomp's beside them, which a resume reads (its files must not
    be named as raycomp's: ``meta.json``, ``shared.pt``, ``rank<r>.pt``, ``sharded``). When
    any rank asks for a checkpoint (``True`` or its own), every rank writes its state.
    Anything else is refused with a ``TypeError``. Call it on every rank, once per epoch, at
    its end.
    """
    current().report(metrics, checkpoint)


def save_state(directory: str | Path) -> None:
    """Write raycomp's checkpoint files into your own checkpoint directory."""
    current().save_state(Path(directory))


def finish() -> dict[str, Any]:
    """Run totals over all ranks (a collective), then close this worker's loop; rank 0 also
    tells the controller the run is done and writes ``<output_dir>/summary.json``; each rank's
    files then reach the run's storage if they were not written there
    (:mod:`raycomp._internal.train.outputs`). A run in
    local steps first merges the ranks' weights (one last sync of every fragment), so that
    every rank ends with the same model.

    Call it at the end of the training function, on every rank. A function that returns
    without it gets a warning, and raycomp finishes the run for it as the worker's
    training thread ends, unless Ray Train shuts the worker down first
    (:mod:`raycomp._internal.train.finish_watch`)."""
    return finish_loop(current())


def finish_loop(loop: TrainLoop) -> dict[str, Any]:
    """:func:`finish` for a given loop (one :func:`start_loop` returned)."""
    global _loop
    # every rank's last statistics are in before the collective, so rank 0's finish_run (after
    # it) summarises the run's last step rather than racing the other ranks' final reports
    loop.send_final()
    totals = loop.totals()
    loop.close()
    forget_finished_run()
    if _loop is loop:
        _loop = None
    if loop.rank == 0:
        _write_summary(loop, totals)
    loop.outputs.upload(loop.rank)  # to the run's storage, unless written there already
    return totals


def _write_summary(loop: TrainLoop, totals: dict[str, Any]) -> None:
    import logging

    import ray

    from raycomp._internal.train.summary import worker_summary, write_summary

    controller: dict[str, Any] = {}
    try:
        if loop.handoff.controller is not None:
            controller = ray.get(loop.handoff.controller.finish_run.remote(loop.run_id, "succeeded"), timeout=30)
        write_summary(worker_summary(totals, loop.run_id, loop.world_size, loop.options.compression.policy,
                                     controller, loop.outputs.location), loop.output_dir)
    except Exception as error:  # noqa: BLE001 - the totals are returned either way
        logging.getLogger("raycomp.train").warning("summary.json not written: %s", error)


def _find_controller(options: TrainOptions) -> Any:
    import logging

    import ray

    c = options.controller
    try:
        return ray.get_actor(c.name, namespace=c.namespace)
    except ValueError:
        if c.required:
            raise RuntimeError(
                f"no controller service {c.name!r} (namespace {c.namespace!r}): add "
                "RunConfig(callbacks=[raycomp.train.ControllerCallback()]) with the same ControllerSection "
                "name as TrainOptions.controller, or set ControllerSection(required=False) to train dense "
                "without a controller") from None
        logging.getLogger("raycomp.train").warning(
            "no controller service %r and controller.required=False: this run trains dense, uncompressed, "
            "for its whole length", c.name)
        return None
