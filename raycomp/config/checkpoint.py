"""``checkpoint``: when raycomp writes a checkpoint."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from raycomp.config.base import Strict


class CheckpointSection(Strict):
    """When raycomp writes a checkpoint (model, optimizer, scheduler and every rank's
    compressor and error-feedback state, through ``ray.train.report``).

    By default once, at the end: ``raycomp.train.report(metrics)`` (``checkpoint=None``)
    checkpoints when it is called

    * in the last epoch of ``loop.epochs(epochs, steps_per_epoch)`` (raycomp knows which
      epoch is the last only from that call: without it, pass ``checkpoint=True``);
    * in an epoch ``e`` (0-based) with ``(e + 1) % every_epochs == 0``, when ``every_epochs``
      is set;
    * at an epoch's last step that is a multiple of ``every_steps``, when set (any other
      multiple is checkpointed inside ``raycomp.train.step``, so that a crash mid-epoch
      replays fewer than ``every_steps`` steps).

    ``report(metrics, checkpoint=True/False)`` overrides the rule for that call. A run that
    should survive a worker failure (``FailureConfig(max_failures=...)``) must set
    ``every_epochs`` or ``every_steps``: without a checkpoint a restarted run starts from
    step 0. Ray Train's ``CheckpointConfig(num_to_keep=...)`` bounds how many are kept.
    """

    config_key = "checkpoint"

    #: also checkpoint the report of every this many epochs (None: only the last epoch's)
    every_epochs: Annotated[int | None, Field(ge=1)] = None
    #: also checkpoint every this many steps, so a crash on a long epoch replays few steps
    every_steps: Annotated[int | None, Field(ge=1)] = None
    #: on a notice that a node hosting a worker is about to be preempted (Ray Train's, read
    #: by every rank at each agreement and carried in its all-gather), every rank
    #: checkpoints there, once per notice, and training goes on: the restart replays only
    #: the steps after it. ``raycomp.train`` only; a framework checkpoints
    #: through its own callbacks (``docs/elastic.md``)
    on_preemption: bool = True
    #: worker-group restarts a job allows: read by ``python -m jobs.train`` only (its
    #: ``FailureConfig(max_failures=...)``). ``raycomp.train`` ignores it: with the Ray Train
    #: API, pass ``FailureConfig(max_failures=...)`` to your ``RunConfig``
    max_failures: Annotated[int, Field(ge=0, le=100)] = 2

    def at_report(self, epoch: int, step: int, epochs: int | None = None,
                  steps_per_epoch: int | None = None) -> bool:
        """Whether a report with ``checkpoint=None`` checkpoints (the rule above): called in
        0-based ``epoch`` of ``epochs`` (None: unknown) after ``step`` steps in all."""
        if epochs is not None and epoch + 1 >= epochs:
            return True
        if self.every_epochs is not None and (epoch + 1) % self.every_epochs == 0:
            return True
        epoch_end = bool(steps_per_epoch) and step % steps_per_epoch == 0  # type: ignore[operator]
        return self.every_steps is not None and epoch_end and step > 0 and step % self.every_steps == 0


__all__ = ["CheckpointSection"]
