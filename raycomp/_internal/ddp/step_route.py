"""A step's route: which way its gradients travel in a DDP model under a
:class:`~raycomp._internal.ddp.state.CompressionState`, decided before the step's forward.

A plan that compresses nothing should cost what plain DDP costs. So the dense step is DDP's
own, and raycomp's comm hook joins only when a plan needs it. Two ways; which one a step
takes depends only on the plan, the step's number and what error feedback holds, which every
rank holds alike, so every rank takes the same way at the same step:

* **DDP's own reduction** (:attr:`Way.DDP`): a plain step (a plan that sends every layer
  dense with nothing held in error feedback, :mod:`raycomp._internal.ddp.plain_step`). DDP's buckets and
  C++ all-reduce, overlapped with backward, exactly as without raycomp. raycomp adds only
  the guard's control values, in an all-reduce of their own issued before the forward so
  that it finishes beside forward and backward (none when they were staged skippable:
  ``controller.dense_control: at_boundaries``), and counts the bytes; on a statistics step
  (one in ``stats_every``) a hook on each parameter reads the rank's own gradient norm as
  backward hands it to DDP. The values' non-finite flag stays clear: a NaN or Inf on any
  rank makes the mean non-finite, and the guard reads the mean's norm on every rank.
* **raycomp's hook** (:attr:`Way.HOOK`): every other step. The comm hook is registered
  with DDP at the first step that needs it and stays: DDP takes one comm hook and cannot
  remove it. A dense plan after that (the guard's fallback, a link that got faster) is the
  hook's plain step, bucket by bucket.

DDP with ``find_unused_parameters`` or ``static_graph`` keeps its own bookkeeping of a step
that a late hook would miss, so there the hook is registered at once and carries every
step. A forward without gradients (evaluation) or inside the user's ``no_sync()`` decides
nothing: the forward after the accumulation, outside ``no_sync()``, does.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from raycomp._internal.ddp.hook import CompressionState, compression_hook

__all__ = ["StepRoute", "Way"]


class Way(enum.Enum):
    DDP = "ddp"  #: DDP's own buckets and all-reduce
    HOOK = "hook"  #: raycomp's comm hook


class StepRoute:
    """The way of each step of ``model`` (a DDP) under ``state``.

    Args:
        model: the DDP model ``state`` was built on, before its first backward.
        state: the rank's compression state.
        hook: the comm hook registered when a step first needs one (raycomp's; a test may
            wrap it to count its calls).

    Call :meth:`end_backward` after every backward outside ``no_sync()``, before reading the
    gradients: it finishes what the step's way left for after backward.
    """

    def __init__(self, model: DistributedDataParallel, state: CompressionState,
                 hook: Callable[..., Any] = compression_hook) -> None:
        self.model, self.state, self._hook = model, state, hook
        self.hooked = False  # raycomp's hook is registered with DDP (for good)
        self.way: Way | None = None  # this step's, from its forward until end_backward
        self.steps = {way: 0 for way in Way}  # steps taken each way (for reports and tests)
        self._grads_ready = 0.0  # when backward computed this step's last gradient (Way.DDP)
        self._timer: Any = None  # the hook that notes it
        if model.find_unused_parameters or getattr(model, "static_graph", False):
            self._register_hook()
            return
        self._device = state.parameters[0].device
        # what DDP's own reduction hides in backward: the wait after the last gradient is
        # computed, as the hook counts the wait after its last bucket (comm_seconds). A
        # gradient hook on one parameter queues a callback for the end of backward's graph;
        # DDP queues its own, which waits for its all-reduces, once its last bucket is
        # ready, after ours: ours notes when the gradients were all computed
        self._timer = state.parameters[0].register_hook(self._queue_note)
        model.register_forward_pre_hook(self._before_forward)

    def _queue_note(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._note_grads_ready)  # type: ignore[attr-defined]

    def _note_grads_ready(self) -> None:
        self._grads_ready = time.perf_counter()

    def _register_hook(self) -> None:
        self.model.register_comm_hook(self.state, self._hook)
        self.hooked = True
        if self._timer is not None:
            self._timer.remove()
            self._timer = None

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Decide the step's way before its forward, from what every rank holds alike."""
        if (self.way is not None  # decided already
                or not torch.is_grad_enabled()  # an evaluation
                or not module.require_backward_grad_sync):  # inside the user's no_sync()
            return
        if self.hooked or not self.state.next_step_plain():
            if not self.hooked:
                self._register_hook()
            self.way = Way.HOOK
        else:
            self.state.plain.begin_in_ddp(self._device)
            self.way = Way.DDP

    def end_backward(self) -> None:
        """Finish the step after its backward: the control values' all-reduce, the count and
        a statistics step's norms (DDP's way); nothing more (the hook's)."""
        way, self.way = self.way, None
        if way is None:
            return  # no forward with gradients decided this step: DDP reduced it on its own
        self.steps[way] += 1
        if way is Way.DDP:
            self.state.plain.end_in_ddp(self._grads_ready or time.perf_counter())
        self._grads_ready = 0.0
