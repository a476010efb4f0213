"""raycomp in PyTorch Lightning on Ray Train: a ``RayDDPStrategy`` with adaptive compression.

A Lightning script on Ray Train changes one line (and the driver adds the controller)::

    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback, prepare_trainer
    from raycomp.integrations.lightning import RaycompStrategy

    def train_func(config):
        trainer = lightning.Trainer(
            strategy=RaycompStrategy(raycomp.train.TrainOptions(...)),  # was RayDDPStrategy()
            plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback()],
            precision="bf16-mixed", accumulate_grad_batches=2, ...)
        trainer = prepare_trainer(trainer)
        trainer.fit(model, datamodule=...)    # ckpt_path=... from ray.train.get_checkpoint()

    TorchTrainer(train_func, ..., run_config=RunConfig(callbacks=[raycomp.train.ControllerCallback()]))

What the strategy does, on top of Lightning's DDP strategy:

* builds DDP with raycomp's bucket cap (``compression.bucket_cap_mb``) and registers
  raycomp's comm hook on it, on every device (Lightning registers its own
  ``ddp_comm_hook`` on CUDA only);
* starts the :class:`~raycomp.train.TrainLoop` (controller link, plan sync, guard,
  statistics, step logs) once Lightning has built the optimizer and its precision plugin,
  told the plugin's GradScaler (``precision="16-mixed"``) so error feedback follows the
  loss scale;
* follows Lightning's step (:class:`~raycomp.integrations.framework_step.FrameworkStep`):
  the loss of every micro-batch's backward, the guard's verdict in
  ``on_before_optimizer_step`` (after the plugin unscaled the gradients, before gradient
  clipping), the step's record after the optimizer step. A callback of the strategy's own
  is added to the trainer's callbacks for ``on_before_optimizer_step``: that hook is where
  every Lightning precision plugin hands over gradients that are complete and unscaled;
* logs the compression ratio, the plan version and the guard's fallbacks
  (``raycomp/compression_ratio``, ``raycomp/plan_version``, ``raycomp/fallback_active``,
  ``raycomp/fallbacks``) with the LightningModule's ``log`` after each training batch, so
  they are in ``trainer.callback_metrics`` and the trainer's loggers beside the loss;
* writes every rank's raycomp state beside each Lightning checkpoint
  (``<checkpoint>.raycomp/rank<r>.pt``, :mod:`raycomp.integrations.state_files`) and reads
  it back when ``trainer.fit(ckpt_path=...)`` resumes from that checkpoint;
* at the end of fitting, totals over all ranks (``strategy.totals``) and ``summary.json``.

Only the DDP strategy: FSDP and DeepSpeed wrap the model otherwise. One optimizer.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from ray.train.lightning import RayDDPStrategy

from raycomp._internal.ddp.buckets import ddp_kwargs
from raycomp.integrations import state_files
from raycomp.integrations.framework_step import (
    FrameworkStep,
    batch_size,
    framework_strategy,
    refuse_unsupported,
)
from raycomp.train import TrainLoop, TrainOptions, finish_loop, start_loop
from raycomp.train.gradient_strategy import GradientStrategyFactory

try:  # the package Ray's RayDDPStrategy was built from
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import TrainerFn
except ModuleNotFoundError:  # pragma: no cover - the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.trainer.states import TrainerFn  # type: ignore[no-redef]

__all__ = ["RaycompStrategy", "state_dir"]

#: DDP options raycomp's strategy does not take: it registers its own hook
_REFUSED = ("module", "device_ids", "output_device", "process_group")


def state_dir(checkpoint_path: str | Path) -> Path:
    """Where raycomp's state lies beside the Lightning checkpoint ``checkpoint_path``."""
    return Path(f"{checkpoint_path}.raycomp")


class RaycompStrategy(RayDDPStrategy):
    """Ray's ``RayDDPStrategy`` with raycomp's adaptive compression (see the module).

    Args:
        options: raycomp's options (policy, guard, control interval, output directory;
            :class:`~raycomp.train.TrainOptions`). Not available here: ``strategy="fsdp"``,
            ``checkpoint.every_steps`` (checkpoints are Lightning's, through
            ``RayTrainReportCallback`` or ``ModelCheckpoint``) and
            ``compression.lr_scaling`` (Lightning steps the optimizer).
        monitor: a metric your LightningModule logs in validation (``self.log("val_loss",
            ...)``); after each validation its value goes to the controller as the run's
            evaluation, read as ``options.eval_kind`` says (None: none is sent).
        ddp_options: keyword arguments of torch's ``DistributedDataParallel``
            (``static_graph``, ``gradient_as_bucket_view``, ``broadcast_buffers``, ...). raycomp
            sets ``bucket_cap_mb`` from ``compression.bucket_cap_mb`` and
            ``find_unused_parameters`` from ``options`` unless you give them here.
        gradient_strategy: how gradients travel, ``factory(ddp_model, optimizer, setup)``
            (:mod:`raycomp.train.gradient_strategy`). The default puts raycomp's hook on
            Lightning's DDP model, with local steps when ``compression.local.mode`` says so
            (:func:`raycomp.integrations.framework_step.framework_strategy`); another factory (a baseline)
            gets that same DDP model and must return it as its ``model``.
    """

    def __init__(self, options: TrainOptions | None = None, *, monitor: str | None = None,
                 ddp_options: Mapping[str, Any] | None = None,
                 gradient_strategy: GradientStrategyFactory = framework_strategy) -> None:
        self.options = options or TrainOptions()
        refuse_unsupported(self.options, "RaycompStrategy")
        ddp_options = dict(ddp_options or {})
        allowed = sorted(set(inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters)
                         - set(_REFUSED))
        for key in ddp_options:
            if key not in allowed:
                raise ValueError(f"ddp_options: {key!r} is not an option raycomp passes to DDP; "
                                 f"allowed: {', '.join(allowed)}")
        super().__init__(**ddp_options)
        self.monitor, self.gradient_strategy = monitor, gradient_strategy
        self.loop: TrainLoop | None = None
        self.steps: FrameworkStep | None = None
        #: run totals over all ranks, once fitting ended (``raycomp.train.finish``'s)
        self.totals: dict[str, Any] | None = None
        self._resume: tuple[dict[str, Any] | None, int] | None = None  # (own state, global step)
        self._callback = _StepCallback(self)

    # --- the DDP model and the loop ---------------------------------------------------------
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
        defaults = ddp_kwargs(self.options.compression, model)  # raycomp's bucket cap
        if self.options.find_unused_parameters:
            defaults["find_unused_parameters"] = True
        self._ddp_kwargs = {**defaults, **self._ddp_kwargs}  # what the user gave wins
        return super()._setup_model(model)

    def _register_ddp_hooks(self) -> None:
        """Nothing here: raycomp's hook is registered in :meth:`setup`, with the loop."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # DDP, the optimizers, the precision plugin
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"configure_optimizers: RaycompStrategy trains with one optimizer, "
                             f"got {len(self.optimizers)}")
        resume, self._resume = self._resume, None
        self.totals = None
        self.loop = start_loop(self.model, self.optimizers[0], grad_scaler=getattr(self.precision_plugin, "scaler", None),
                               options=self.options, gradient_strategy=self.gradient_strategy, owns_optimizer=False,
                               resume=None if resume is None else state_files.resume_with(*resume))
        if self.loop.model is not self.model:
            raise ValueError("gradient_strategy: under Lightning the factory must return the DDP model it was "
                             "given as its model (Lightning keeps training that one)")
        self.steps = FrameworkStep(self.loop)
        if self._callback not in trainer.callbacks:
            trainer.callbacks.append(self._callback)

    # --- the step ---------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.steps is not None and args:
            self.steps.add_samples(batch_size(args[0]))
        return super().training_step(*args, **kwargs)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.steps is not None:  # the loss before a precision plugin scales it
            self.steps.add(closure_loss)
        super().pre_backward(closure_loss)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.steps is not None:
            self.steps.after_optimizer_step()
        return output

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's file (rank 0) and, on every rank, raycomp's state beside it."""
        if self.loop is not None:
            state_files.save_state(self.loop, state_dir(filepath))
            self.steps.checkpoint_saved()  # type: ignore[union-attr]
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's checkpoint and this rank's raycomp state beside it, which the loop
        takes back when :meth:`setup` starts it."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        own = state_files.load_state(state_dir(checkpoint_path), self.global_rank, self.world_size)
        self._resume = (own, int(checkpoint.get("global_step", 0)))
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        directory = state_dir(filepath)
        (directory / f"rank{self.global_rank}.pt").unlink(missing_ok=True)
        if self.is_global_zero:
            (directory / "meta.json").unlink(missing_ok=True)

    # --- the end --------------------------------------------------------------------------------
    def finish(self) -> None:
        """Run totals over all ranks (a collective), ``summary.json``; closes the loop."""
        if self.loop is not None and self.totals is None:
            self.totals = finish_loop(self.loop)

    def teardown(self) -> None:
        if self.loop is not None and self.totals is None:  # fitting stopped early: no collective
            self.loop.close()
        self.steps = None
        super().teardown()


class _StepCallback(pl.Callback):
    """The strategy's hooks into Lightning's loop (added to the trainer by the strategy)."""

    def __init__(self, strategy: RaycompStrategy) -> None:
        self.strategy = strategy

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.strategy.loop is not None:  # optimizer steps in all (inf: no budget known)
            budget = trainer.estimated_stepping_batches
            self.strategy.loop.last_step = int(budget) if math.isfinite(budget) else None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.strategy.loop is not None:
            self.strategy.loop.epoch = trainer.current_epoch

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.strategy.steps is not None:
            self.strategy.steps.before_optimizer_step()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """raycomp's values (:meth:`FrameworkStep.logged`) through ``pl_module.log``: in
        ``trainer.callback_metrics`` and every logger, at the trainer's ``log_every_n_steps``."""
        if self.strategy.steps is not None:
            pl_module.log_dict(self.strategy.steps.logged(), on_step=True, on_epoch=False, batch_size=1)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop, monitor = self.strategy.loop, self.strategy.monitor
        if loop is None or monitor is None or trainer.sanity_checking or self.strategy.totals is not None:
            return
        value = trainer.callback_metrics.get(monitor)
        if value is not None:
            loop.record_eval({monitor: float(value)}, float(value))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.finish()
