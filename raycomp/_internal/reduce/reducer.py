"""The compressed mean of gradients across ranks, layer by layer, under a Plan.

Each reduction (:meth:`CompressedReducer.start`) takes the steps of error-feedback
compression (as GRACE's ``send``: compensate, compress, update memory):

1. **route**: each layer's compressor in the current plan, and the transport it declares
   (:mod:`raycomp._internal.reduce.routing`: the same decision on every rank);
2. **compensate**: add the error-feedback memory to the gradient;
3. **compress and communicate**: all layers of one transport in one batch (:mod:`raycomp._internal.transports`);
4. **decompress**: once the collectives are done, the mean, and what this rank sent;
5. **update memory**: keep what was not sent; count wire bytes; on statistics steps
   measure per-layer statistics.

A plan set with ``set_plan`` is installed when the next step begins, never in the middle
of a step. A step with a non-finite compressed gradient (:mod:`raycomp._internal.reduce.signals`, which also
carries the caller's control values) leaves the error-feedback memory reset: it must not
carry NaN/Inf into later steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from raycomp._internal.reduce.held_back import HeldBackUpdates
from raycomp._internal.reduce.loss_scale import ScaleFollower
from raycomp._internal.reduce.mean_error import sample
from raycomp._internal.reduce.memory import Memory, make_memory
from raycomp._internal.reduce.routing import Router
from raycomp._internal.reduce.signals import StepSignals
from raycomp._internal.reduce.stats import LayerStats, layer_stats
from raycomp._internal.transports import (
    OVERHEAD,
    Batch,
    Group,
    Pending,
    Reduced,
    communicate,
    communicators,
)
from raycomp._internal.wire.ledger import WireLedger
from raycomp.compressors import Compressor, Transport
from raycomp.plan import Plan

__all__ = ["CompressedReducer"]


class CompressedReducer:
    """Compressed all-reduce mean of named gradients, with state that checkpoints.

    Args:
        plan: initial plan (default: everything dense).
        process_group: the group to reduce over (default group if None).
        memory: ``"residual"`` (error feedback), ``"dgc"`` (momentum correction; run the
            optimizer without momentum) or ``"none"``; or a Memory object.
        min_compress_numel: layers with fewer elements always go dense (latency dominates).
        seed: base seed for compressors' random draws.
        stats_every: measure :class:`LayerStats` every this many steps (0: never).
        profile_ratios: on statistics steps also measure each layer's Top-K error at these
            ratios (for error-budget policies).
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss (fp16 training), or
            None. Error feedback keeps what was not sent in the units of its step: told the
            scaler, the memory follows each change of its scale (``raycomp._internal.reduce.loss_scale``);
            without it, every growth or backoff of the scale halves or doubles what the
            memory sends later. Statistics are reported in the loss's units.
    """

    def __init__(
        self,
        plan: Plan | None = None,
        *,
        process_group: Any = None,
        memory: str | Memory = "residual",
        min_compress_numel: int = 1024,
        seed: int = 0,
        stats_every: int = 0,
        profile_ratios: tuple[float, ...] = (),
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) or min_compress_numel < 0:
            raise ValueError(f"min_compress_numel: expected an integer >= 0, got {min_compress_numel!r}")
        if isinstance(stats_every, bool) or not isinstance(stats_every, int) or stats_every < 0:
            raise ValueError(f"stats_every: expected an integer >= 0, got {stats_every!r}")
        self.loss_scale = ScaleFollower(grad_scaler)
        self.group = Group(process_group)
        #: the group the compressed reduction's collectives travel on: the reducer's own (a
        #: two-level reducer's is the cross-node group of its position on the node)
        self.send_group = self.group
        self.memory = make_memory(memory, self.group.size) if isinstance(memory, str) else memory
        self.router = Router(self.group, min_compress_numel, seed)  # each layer's compressor and transport
        self.stats_every = stats_every
        self.profile_ratios = tuple(profile_ratios)
        self.communicators = communicators()  # one per transport kind: some keep state
        self.ledger = WireLedger()
        self.step = 0
        self._plan = plan or Plan()
        self._pending: Plan | None = None
        self._in_step = False
        self.stats: list[LayerStats] = []  # of the latest statistics step
        self.stats_step = -1  # the step those statistics were measured at
        #: per lossy layer of that step, this rank's sample of its input and of the applied
        #: mean (:func:`raycomp._internal.reduce.mean_error.sample`), and the plan that step ran under
        self.mean_samples: dict[str, torch.Tensor] = {}
        self.stats_plan: Plan | None = None
        self.local_nonfinite = False  # this rank's compressed gradients held NaN/Inf at the last step
        self.signals = StepSignals(self.group)  # the step's finiteness flag and control values
        #: memory updates of lossy layers idle on this rank, held back while
        #: :attr:`defer_unused` until :meth:`settle_unused` (:mod:`raycomp._internal.reduce.held_back`)
        self.held_back = HeldBackUpdates()

    # --- plan and step boundaries -----------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def in_step(self) -> bool:
        return self._in_step

    def set_plan(self, plan: Plan) -> None:
        """Install ``plan`` at the start of the next step (immediately if between steps)."""
        if self._in_step:
            self._pending = plan
        else:
            self._plan = plan

    def begin_step(self) -> None:
        if self._in_step:
            return
        if self._pending is not None:
            self._plan, self._pending = self._pending, None
        if self.holding_back:  # nothing settled the last step's (no backward ran it): as sent
            self.settle_unused(lambda name: True)
        factor = self.loss_scale.change()
        if factor is not None:  # the memory joins gradients scaled by this step's scale
            self.memory.rescale(factor)
            for communicator in self.communicators.values():
                communicator.rescale(factor)
        self.memory.loss_scale = self.loss_scale.scale  # None without a GradScaler
        self._in_step = True
        self.signals.begin_step()
        if self.collecting_stats:
            self.stats = []
            self.stats_step = self.step
            self.mean_samples, self.stats_plan = {}, self._plan

    def end_step(self) -> None:
        self._in_step = False
        self.step += 1
        self.local_nonfinite = self.signals.nonfinite()
        if self.local_nonfinite:
            self.discard_step()
        if self._pending is not None:
            self._plan, self._pending = self._pending, None

    @property
    def collecting_stats(self) -> bool:
        # the step just before each multiple: statistics are fresh at a control boundary
        return self.stats_every > 0 and (self.step + 1) % self.stats_every == 0

    # --- the reduction ------------------------------------------------------------------
    def reduce(self, names: Sequence[str], grads: Sequence[torch.Tensor], *,
               closes_step: bool = False, overwrite: bool = False) -> list[torch.Tensor]:
        """The mean over ranks of each gradient, compressed as the plan says.

        ``closes_step``: this is the step's last reduction (the DDP hook's last bucket):
        staged control values ride with it. ``overwrite``: ``grads`` may be overwritten (a
        DDP bucket, which the result replaces anyway); dense gradients that lie back to back
        there are then reduced in place, except on statistics steps, which still read them.
        """
        return self.start(names, grads, closes_step=closes_step, overwrite=overwrite).wait()

    def start(self, names: Sequence[str], grads: Sequence[torch.Tensor], *,
              closes_step: bool = False, overwrite: bool = False) -> Pending[list[torch.Tensor]]:
        """:meth:`reduce` in two halves: route, compensate, compress and issue every
        collective now; the returned :class:`~raycomp._internal.transports.Pending` waits for the last
        ones, decompresses and updates the memory (and counts bytes, measures statistics).

        Collectives are issued only here, so calls must come in the same order on every
        rank; the ``wait()`` of one call may run on another thread while the next call
        starts (the DDP hook does), as long as each is waited for before its step ends and
        in the order started.
        """
        self.begin_step()
        return self._send(names, grads, closes_step=closes_step, overwrite=overwrite)

    def _send(self, names: Sequence[str], grads: Sequence[torch.Tensor], *, closes_step: bool, overwrite: bool,
              control: torch.Tensor | None = None,
              dense_bytes: Sequence[float] | None = None) -> Pending[list[torch.Tensor]]:
        """Steps 1-5 over the reducer's own group, in an open step. ``control``: a control
        tensor to carry instead of the staged one (a two-level reduction relays its
        node's sum); ``dense_bytes``: each layer's dense equivalent in the ledger (default:
        the all-reduce of ``grads`` over the group)."""
        compressors, kinds = self.router.route(self._plan, names, grads, self.loss_scale.scale)  # 1. route
        compensated = [self.memory.compensate(n, g) for n, g in zip(names, grads, strict=True)]  # 2. compensate
        self.signals.watch([g for g, kind, c in zip(grads, kinds, compressors, strict=True)
                            if kind is not Transport.DENSE and not c.carries_nonfinite])
        used = self.held_back.used_flags(grads)  # before an in-place reduction
        if control is None and closes_step:
            control = self.signals.take(grads[0].device if grads else torch.device("cpu"))
        measuring = self.collecting_stats  # statistics read the gradients: never overwrite them then
        overwritable = [overwrite and not measuring and c is g for c, g in zip(compensated, grads, strict=True)]
        batch = Batch(list(names), compensated, compressors, overwritable, control, keep_sent=measuring)
        sending = communicate(kinds, batch, self.communicators, self.send_group)  # 3. compress, communicate

        def finish() -> list[torch.Tensor]:
            reduced, overhead = sending.finish()  # 4. decompress: the mean, and what this rank sent
            self.held_back.update(self.memory, names, compressors, compensated, reduced, used)  # 5. update memory
            self._count_bytes(names, grads, reduced, overhead, dense_bytes)
            if measuring:
                self._measure(names, compressors, grads, compensated, reduced)
            return [r.mean for r in reduced]

        return Pending(sending.works, finish)

    def compressor_for(self, layer: str) -> Compressor:
        return self.router.compressor_for(self._plan, layer)

    def transport_for(self, layer: str, shape: torch.Size) -> Transport:
        return self.router.transport_for(self._plan, layer, shape)

    def _count_bytes(self, names: Sequence[str], grads: Sequence[torch.Tensor], reduced: Sequence[Reduced],
                     overhead: float, dense_bytes: Sequence[float] | None = None) -> None:
        """Wire bytes into the ledger, each layer beside its dense all-reduce's."""
        if overhead:
            self.ledger.add(OVERHEAD, overhead)
        if dense_bytes is None:
            dense_bytes = [self.send_group.allreduce_bytes(g.numel() * g.element_size()) for g in grads]
        for name, dense, result in zip(names, dense_bytes, reduced, strict=True):
            self.ledger.add(name, result.wire_bytes, dense)

    def _measure(self, names: Sequence[str], compressors: Sequence[Compressor], grads: Sequence[torch.Tensor],
                 compensated: Sequence[torch.Tensor], reduced: Sequence[Reduced]) -> None:
        """This step's :class:`LayerStats`, in the loss's units."""
        unscale = self.loss_scale.unscale()
        for i, name in enumerate(names):
            result, grad = reduced[i], grads[i]
            kind = compressors[i].name if result.sent is not compensated[i] else "none"
            dense = self.send_group.allreduce_bytes(grad.numel() * grad.element_size())
            self.stats.append(layer_stats(name, kind, grad, compensated[i], result.sent, self.memory.residual(name),
                                          result.wire_bytes, dense, self.profile_ratios, unscale))
            if kind != "none" and compressors[i].error_feedback:  # an unbiased one is noisy by design
                self.mean_samples[name] = sample(compensated[i], result.mean)  # raycomp._internal.reduce.mean_error

    # --- control values ---------------------------------------------------------------
    def stage_control(self, values: Sequence[float], skippable: bool = False) -> None:
        """Sum ``[local non-finite flag, *values]`` of every rank in the next step's last
        reduction; after it, :attr:`control_rows` holds one row per rank
        (:meth:`raycomp._internal.reduce.signals.StepSignals.stage`). ``skippable``: a plain step that DDP's
        own reduction carries leaves them out (:attr:`control_skipped`)."""
        self.signals.stage(values, skippable)

    @property
    def control_skipped(self) -> bool:
        """Whether this step left the staged values out (no :attr:`control_rows` after it)."""
        return self.signals.skipped

    @property
    def control_rows(self) -> torch.Tensor | None:
        """(world, n): rank ``r``'s staged values in row ``r``, after the step that carried them."""
        return self.signals.rows

    @control_rows.setter
    def control_rows(self, rows: torch.Tensor | None) -> None:
        self.signals.rows = rows

    def gradient_norm(self, parameters: Sequence[torch.Tensor]) -> float:
        """The norm of the reduced gradients of ``parameters``: the same on every rank (the
        same mean, the same ops in the same order); non-finite if any element is."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return 0.0
        # fp32 gradients (the usual case) in one multi-tensor kernel: every op hands the GIL
        # over, and a worker's other threads make each handover cost; others in fp32, in turn
        fp32 = [g for g in grads if g.dtype == torch.float32]
        norms = list(torch._foreach_norm(fp32)) if fp32 else []
        norms += [torch.linalg.vector_norm(g.float()) for g in grads if g.dtype != torch.float32]
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    # --- held-back and discarded memory ------------------------------------------------
    @property
    def defer_unused(self) -> bool:
        """Hold back the memory update of a lossy layer whose gradient is all zero on this
        rank, until :meth:`settle_unused` learns whether any rank used it (the DDP hook
        with ``find_unused_parameters``: DDP drops the mean of a layer no rank used)."""
        return self.held_back.enabled

    @defer_unused.setter
    def defer_unused(self, on: bool) -> None:
        self.held_back.enabled = on

    @property
    def holding_back(self) -> bool:  # memory updates wait for settle_unused
        return self.held_back.holding

    def settle_unused(self, used: Callable[[str], bool]) -> None:
        """Apply the held-back memory updates: as sent where ``used(layer)`` (some rank used
        the layer), else as if nothing had been sent (:meth:`HeldBackUpdates.settle`)."""
        self.held_back.settle(self.memory, used)

    def discard_step(self) -> None:
        """Forget the error-feedback memory after a step the optimizer skipped.

        The skipped step's gradient (NaN-free but exploded, say) is already folded into the
        residuals; keeping them would re-send it on the next step. Dropping them also drops
        the small residual mass of earlier steps — bounded, and far better than replaying a
        bad gradient. Every rank calls this at the same step (the guard's decision is shared).
        """
        self.memory.reset()
        self.held_back.clear()
        for communicator in self.communicators.values():
            communicator.reset()

    # --- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-for-bit: step, plan, memory, compressor state."""
        if self.holding_back:  # held back by a step no backward closed: as sent, as the next step would
            self.settle_unused(lambda name: True)
        return {
            "step": self.step,
            "plan": self._plan.to_dict(),
            "pending_plan": None if self._pending is None else self._pending.to_dict(),
            "memory": self.memory.state_dict(),
            **{c.state_key: c.state_dict() for c in self.communicators.values() if c.state_key},
            "compressors": self.router.state_dict(),
            "ledger": self.ledger.state_dict(),
            "loss_scale": self.loss_scale.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("levels") is not None and type(self) is CompressedReducer:
            raise ValueError(f"compression.levels: this checkpoint was written by a two-level run "
                             f"{state['levels']}; allowed: resume it with two levels at the same nodes x ranks")
        self.step = int(state["step"])
        self._plan = Plan.from_dict(state["plan"])
        self._pending = None if state["pending_plan"] is None else Plan.from_dict(state["pending_plan"])
        self.memory.load_state_dict(state["memory"])
        for communicator in self.communicators.values():
            if communicator.state_key:
                communicator.load_state_dict(state[communicator.state_key])
        self.router.load_state_dict(state["compressors"])
        self.ledger.load_state_dict(state["ledger"])
        self.loss_scale.load_state_dict(state.get("loss_scale", {"scale": None}))
