"""The plain step: a dense step that needs nothing of the compressed reduction.

A step whose plan sends every layer dense, with nothing held in error feedback, no Top-K
error profile to measure and no unused layers to settle (:meth:`PlainStep.ready`), has
nothing to route, encode or remember: its gradients are all-reduced as whole buffers
(:meth:`PlainStep.start_buffer`: the same division, sum and control values as a dense layer
of :class:`~raycomp._internal.reduce.reducer.CompressedReducer`'s compressed path), as
torch's all-reduce hook does. It goes one of two ways, decided the same on every rank
(:mod:`raycomp._internal.ddp.step_route` says which when):

* **in DDP** (:meth:`PlainStep.begin_in_ddp`, :meth:`PlainStep.end_in_ddp`): DDP's own
  reduction carries the gradients; the step adds the control values' all-reduce, counts
  the bytes and, on a statistics step, reads each rank's own gradient norms as backward
  hands the gradients to DDP;
* **in the hook**, bucket by bucket (:meth:`PlainStep.reduce_bucket`), once raycomp's hook
  is registered: each bucket all-reduced where it lies, a callback of the collective ending
  the step.

Either way the step counts every layer DDP's buckets hold once, and measures their norms
on a statistics step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp._internal.reduce.stats import LayerStats, layer_stats
from raycomp._internal.transports import OVERHEAD, mean_in_place

__all__ = ["PlainStep"]


class PlainStep:
    """The plain step of one :class:`~raycomp._internal.ddp.state.CompressionState`.

    Args:
        reducer: the state's reducer: its step, control values, ledger and statistics.
        bucketed: what DDP's buckets hold, each layer once, as (name, parameter).
        name_of: the state's name of a bucket's parameter (ValueError for a parameter of
            another model).
        end_step: ends the step and counts the wait since the time it is given as
            communication (:attr:`~raycomp._internal.ddp.state.CompressionState.comm_seconds`).
    """

    def __init__(self, reducer: CompressedReducer, bucketed: Sequence[tuple[str, torch.Tensor]],
                 name_of: Callable[[torch.Tensor], str], end_step: Callable[[float], None]) -> None:
        self.reducer = reducer
        self._bucketed = list(bucketed)
        #: each layer's (elements, gradient bytes)
        self._sizes = {name: (p.numel(), p.numel() * p.element_size()) for name, p in bucketed}
        self._wire: list[tuple[str, float]] | None = None  # (name, bytes on the wire) of each layer a step
        self._name_of = name_of
        self._end_step = end_step
        self._bucket_futures: list[torch.futures.Future] = []  # this step's buckets so far (in the hook)
        self._buckets_checked = False  # a step in the hook has seen every bucket hold the state's parameters
        self._control_works: list = []  # a step in DDP: its control values' all-reduce
        self._watches: list = []  # a statistics step in DDP: the hooks reading each gradient
        self._local_norms: dict[str, torch.Tensor] = {}  # what they read: this rank's norms

    def begin_step(self) -> None:
        """A new step: none of its buckets are in yet."""
        self._bucket_futures = []

    def ready(self) -> bool:
        """Whether this step may be a plain step, given a plan that sends every layer dense
        (the caller's to know: it depends on the layers): nothing held in error feedback, no
        Top-K error profile measured (statistics without one: :meth:`measure`), no unused
        layers to settle."""
        reducer = self.reducer
        idle = getattr(reducer.memory, "idle", None)  # a memory of the caller's own may lack it
        return (not (reducer.collecting_stats and reducer.profile_ratios) and not reducer.defer_unused
                and not reducer.holding_back and idle is not None and idle())

    def start_buffer(self, parts: Sequence[torch.Tensor], *, closes_step: bool = False) -> torch.futures.Future:
        """The reducer's :meth:`~raycomp._internal.reduce.reducer.CompressedReducer.start` for a plain step,
        on the 1-D ``parts`` back to back, one buffer (a DDP bucket's, or a whole step's
        gradients of one dtype): the same division, all-reduce and control values
        (:func:`~raycomp._internal.transports.mean_in_place`), without routing, error feedback or
        per-layer results. The layers' bytes are counted once a step (:meth:`count`). A
        future of the mean, one 1-D tensor."""
        reducer = self.reducer
        reducer.begin_step()
        control = reducer.signals.take(parts[0].device) if closes_step else None
        if control is not None:
            reducer.ledger.add(OVERHEAD, reducer.group.allreduce_bytes(control.numel() * control.element_size()))
        return mean_in_place(parts, reducer.group, control)

    def measure(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """A plain step's :class:`~raycomp._internal.reduce.stats.LayerStats` on a statistics step, from this
        rank's gradients before their reduction: what the reducer measures of a layer sent
        dense with nothing held (its norm; no compression error, no residual)."""
        unscale = self.reducer.loss_scale.unscale()
        for name, grad in zip(names, grads, strict=True):
            dense = self.reducer.group.allreduce_bytes(grad.numel() * grad.element_size())
            # sent as it is, nothing held back: compensated and sent are the gradient itself
            self.reducer.stats.append(layer_stats(name, "none", grad, grad, grad, None, dense, dense, unscale=unscale))

    def _wire_bytes(self) -> list[tuple[str, float]]:
        """Each layer's bytes on the wire a step, sent dense: the same every step (the
        group's size does not change), so computed once."""
        if self._wire is None:
            group = self.reducer.group
            self._wire = [(name, group.allreduce_bytes(nbytes)) for name, (_, nbytes) in self._sizes.items()]
        return self._wire

    def count(self) -> None:
        """Count the step's bytes: every layer DDP's buckets hold, sent dense."""
        add = self.reducer.ledger.add
        for name, dense in self._wire_bytes():
            add(name, dense, dense)

    def begin_in_ddp(self, device: torch.device) -> None:
        """A plain step that DDP's own reduction carries, begun before its forward: the
        control values go now, in an all-reduce of their own that finishes beside forward
        and backward (DDP's buckets take no extra values), unless they were staged as
        skippable: then the step has no collective of raycomp's at all. Their non-finite
        flag stays clear: a non-finite gradient anywhere shows in the mean every rank reads."""
        reducer = self.reducer
        reducer.begin_step()
        control = None if reducer.signals.drop() else reducer.signals.take(device)
        self._control_works = [] if control is None else reducer.group.start_all_reduce(control)
        if control is not None:
            reducer.ledger.add(OVERHEAD, reducer.group.allreduce_bytes(control.numel() * control.element_size()))
        if reducer.collecting_stats:
            self._watch_local_gradients()

    def _watch_local_gradients(self) -> None:
        """A statistics step in DDP: DDP's all-reduce overwrites each rank's own gradients in
        place, so their norms are read as backward hands them over, by a hook on each
        parameter's incoming gradient. What earlier micro-batches of the user's ``no_sync()``
        accumulated in ``.grad`` is added: the rank's own gradient of the whole step."""
        self._local_norms = {}

        def watch(name: str, p: torch.Tensor) -> Any:
            def note(grad: torch.Tensor) -> None:
                local = grad if p.grad is None else p.grad + grad
                self._local_norms[name] = torch.linalg.vector_norm(local.float())
            return p.register_hook(note)

        self._watches = [watch(name, p) for name, p in self._bucketed]

    def end_in_ddp(self, since: float) -> None:
        """End a step begun by :meth:`begin_in_ddp`, after DDP's reduction in backward: the
        control values are in, the layers counted, a statistics step's norms recorded; the
        wait since ``since`` (when backward computed its last gradient) is the step's
        communication."""
        works, self._control_works = self._control_works, []
        for work in works:
            work.wait()
        if self._watches:
            for handle in self._watches:
                handle.remove()
            self._watches = []
            self._record_local_norms()
        self.count()
        self._end_step(since)

    def _record_local_norms(self) -> None:
        """The statistics of a step in DDP: per layer this rank's own gradient norm, as
        :meth:`measure` has it (nothing compressed, nothing held), one host read for all."""
        reducer = self.reducer
        read, self._local_norms = self._local_norms, {}
        names = [name for name, _ in self._bucketed if name in read]
        if not names:
            return
        norms = torch.stack([read[name] for name in names]).tolist()
        unscale = reducer.loss_scale.unscale()
        wire = dict(self._wire_bytes())
        for name, norm in zip(names, norms, strict=True):
            reducer.stats.append(LayerStats(layer=name, compressor="none", numel=self._sizes[name][0],
                                            grad_norm=norm / unscale, compression_error=0.0, residual_norm=0.0,
                                            wire_bytes=wire[name], dense_bytes=wire[name]))

    def reduce_bucket(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> torch.futures.Future:
        """A bucket of a plain step in the hook: all-reduced where it lies (its gradients'
        norms first, on a statistics step). The last one counts the step's bytes (every layer
        DDP reduces, once) and ends the step once every bucket is in: gloo runs a group's
        collectives on several threads, so the last bucket (often the smallest) can be in
        before the buckets issued earlier."""
        handed_over, last = time.perf_counter(), bucket.is_last()
        if self.reducer.collecting_stats:
            self.measure([self._name_of(p) for p in bucket.parameters()], bucket.gradients())
        elif not self._buckets_checked:  # names are read on statistics steps only: a bucket of
            for p in bucket.parameters():  # another model than the state's fails at the first step
                self._name_of(p)
        self._buckets_checked |= last
        future = self.start_buffer([buffer], closes_step=last)
        self._bucket_futures.append(future)
        if not last:
            return future
        step_futures, self._bucket_futures = self._bucket_futures, []
        self.count()

        def after_every_bucket(_: torch.futures.Future) -> torch.Tensor:
            for done in step_futures:
                done.value()  # a failed collective raises here, before the step ends
            self._end_step(handed_over)  # what backward waited for
            return future.value()

        return torch.futures.collect_all(step_futures).then(after_every_bucket)
