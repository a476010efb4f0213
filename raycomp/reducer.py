"""The compressed mean of gradients across ranks, layer by layer, under a Plan.

For every layer of a reduction call the reducer

1. looks up the layer's compressor in the current plan (tiny, 1-D-only-when-dense, or
   incompressible layers go dense — the same decision on every rank, since it depends only
   on the plan, the name, the shape and the world size);
2. adds the error-feedback memory to the gradient;
3. hands all layers of one transport to that transport's collective in one batch;
4. keeps what was not sent in memory, counts wire bytes, and on statistics steps
   measures per-layer statistics.

A plan set with :meth:`set_plan` is installed when the next step begins, never in the
middle of a step.

Non-finite gradients cost no host sync per layer: each reduction's :func:`all_finite` stays a
tensor, folded into one flag read once, at :meth:`end_step`. Only compressed layers are
checked: a dense layer's NaN/Inf reaches the mean itself, the same on every rank (the guard
reads it from the mean's norm), while compression may drop it (a threshold test such as
DGC's sampled Top-K is false for NaN) or hide which rank sent it. A step with a non-finite compressed gradient leaves the error-feedback memory
reset (it must not carry NaN/Inf into later steps), as :meth:`discard_step` does.

Control values (:meth:`stage_control`) ride inside the last reduction of the next step —
appended to its dense fp32 all-reduce, or a tiny all-reduce of their own — so that a
caller can learn a few numbers from every rank without a collective of its own. Each
rank's row also carries its local non-finite flag. See :mod:`raycomp.train.guard_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from raycomp import collectives
from raycomp.collectives import Group, Pending, Reduced
from raycomp.compressors import Compressor, Transport
from raycomp.ledger import WireLedger
from raycomp.loss_scale import ScaleFollower
from raycomp.memory import DGCMemory, Memory, NoMemory, ResidualMemory
from raycomp.plan import CompressorSpec, Plan
from raycomp.stats import LayerStats, layer_stats

MEMORIES = ("residual", "dgc", "none")


def make_memory(kind: str, world_size: int, **options: Any) -> Memory:
    if kind == "residual":
        return ResidualMemory()
    if kind == "dgc":
        return DGCMemory(world_size=world_size, **options)
    if kind == "none":
        return NoMemory()
    raise ValueError(f"memory: unknown kind {kind!r}; allowed: {', '.join(MEMORIES)}")


def _no_overhead(pending: Pending[list[Reduced]]) -> Pending[tuple[list[Reduced], float]]:
    return pending.then(lambda results: (results, 0.0))


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Whether every element of ``tensors`` is finite, as a 0-d bool tensor (no host sync);
    None when there is no element. A min and a max per tensor decide it: both propagate NaN
    and reach an infinity of their sign. ``isfinite(t).all()`` builds a boolean tensor first:
    12 ms against 2 ms a step for the 3.2M-parameter transformer on this machine's CPU, all
    of it on the hook's thread, next to backward."""
    bounds = [torch.stack(torch.aminmax(t)).float() for t in tensors if t.numel()]
    return torch.isfinite(torch.stack(bounds)).all() if bounds else None


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
            None. Error feedback keeps what was not sent in the units of its step; told the
            scaler, the memory follows each change of its scale (``raycomp.loss_scale``), and
            statistics are reported in the loss's units. Without it, every growth or backoff
            of the scale halves or doubles what the memory sends later.
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
        self.memory = make_memory(memory, self.group.size) if isinstance(memory, str) else memory
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        self.stats_every = stats_every
        self.profile_ratios = tuple(profile_ratios)
        self.scalable = collectives.ScalableAllreduce()
        self.ledger = WireLedger()
        self.step = 0
        self._plan = plan or Plan()
        self._pending: Plan | None = None
        self._in_step = False
        self._compressors: dict[str, tuple[CompressorSpec, Compressor]] = {}
        self.stats: list[LayerStats] = []  # of the latest statistics step
        self.stats_step = -1  # the step those statistics were measured at
        self.local_nonfinite = False  # this rank's compressed gradients held NaN/Inf at the last step
        self._finite: torch.Tensor | None = None  # all compressed gradients of this step finite so far
        self._control: torch.Tensor | None = None  # staged: rides with the next step's last reduction
        self.control_rows: torch.Tensor | None = None  # (world, n) rows of every rank, after that
        #: hold back the memory update of a lossy layer whose gradient is all zero on this
        #: rank, until :meth:`settle_unused` learns whether any rank used it (the DDP hook
        #: with ``find_unused_parameters``: DDP drops the mean of a layer no rank used)
        self.defer_unused = False
        self._unsettled: dict[str, tuple[torch.Tensor, torch.Tensor, bool]] = {}

    # --- plan and step boundaries -----------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._plan

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
        if self._unsettled:  # nothing settled the last step's (no backward ran it): as sent
            self.settle_unused(lambda name: True)
        factor = self.loss_scale.change()
        if factor is not None:  # the memory joins gradients scaled by this step's scale
            self.memory.rescale(factor)
            self.scalable.rescale(factor)
        self.memory.loss_scale = self.loss_scale.scale  # None without a GradScaler
        self._in_step = True
        self._finite = None
        self.control_rows = None
        if self.collecting_stats:
            self.stats = []
            self.stats_step = self.step

    def end_step(self) -> None:
        self._in_step = False
        self.step += 1
        # the step's one host sync for finiteness
        self.local_nonfinite = self._finite is not None and not bool(self._finite)
        if self.local_nonfinite:
            self.discard_step()
        if self._pending is not None:
            self._plan, self._pending = self._pending, None

    @property
    def collecting_stats(self) -> bool:
        # the step just before each multiple: statistics are fresh at a control boundary
        return self.stats_every > 0 and (self.step + 1) % self.stats_every == 0

    # --- the reduction ------------------------------------------------------------------
    def compressor_for(self, layer: str) -> Compressor:
        spec = self._plan.spec_for(layer)
        cached = self._compressors.get(layer)
        if cached is None or cached[0] != spec:
            cached = (spec, spec.build(layer, self.group.rank, self.seed))
            self._compressors[layer] = cached
        return cached[1]

    def transport_for(self, layer: str, shape: torch.Size) -> Transport:
        compressor = self.compressor_for(layer)
        numel = shape.numel()
        if numel < max(1, self.min_compress_numel) or not compressor.accepts(shape):
            return Transport.DENSE
        if compressor.transport is Transport.SCALABLE and numel < self.group.size:
            return Transport.DENSE
        return compressor.transport

    def stage_control(self, values: Sequence[float]) -> None:
        """Sum ``[local non-finite flag, *values]`` of every rank in the next step's last reduction.

        After that step :attr:`control_rows` holds one row per rank (rank ``r``'s values in
        row ``r``: a sum of one-hot rows is an all-gather). Every rank must stage the same
        number of values, every step it wants them; nothing staged, nothing carried.
        """
        n = 1 + len(values)
        row = torch.zeros(self.group.size * n, dtype=torch.float32)
        start = self.group.rank * n
        row[start + 1:start + n] = torch.tensor([float(v) for v in values], dtype=torch.float32)
        self._control = row

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
        """:meth:`reduce` in two halves: compensate, compress and issue every collective
        now; the returned :class:`~raycomp.collectives.Pending` waits for the last ones and
        finishes (decoding, error feedback, wire bytes, statistics).

        Collectives are issued only here, so calls of :meth:`start` must come in the same
        order on every rank; the ``wait()`` of one call may run on another thread while
        the next call starts (the DDP hook does), as long as each is waited for before its
        step ends and in the order started.
        """
        self.begin_step()
        routes: dict[Transport, list[int]] = {}
        compensated: list[torch.Tensor] = []
        compressors: list[Compressor] = []
        for i, (name, grad) in enumerate(zip(names, grads, strict=True)):
            if not grad.is_floating_point():
                raise ValueError(f"gradient {name!r}: dtype {grad.dtype} is not floating point")
            routes.setdefault(self.transport_for(name, grad.shape), []).append(i)
            compressors.append(self.compressor_for(name))
            compressors[-1].loss_scale = self.loss_scale.scale  # None without a GradScaler
            compensated.append(self.memory.compensate(name, grad))
        # only what compression may hide: a dense layer's NaN/Inf reaches the mean, which
        # every rank holds; a compressed layer's may be dropped or smeared. No host
        # sync here: read once per step, at end_step
        finite = all_finite([grads[i] for t, members in routes.items() if t is not Transport.DENSE
                             for i in members])
        if finite is not None:
            self._finite = finite if self._finite is None else self._finite & finite
        control = self._take_control(grads) if closes_step else None
        used_here = [g.any() for g in grads] if self.defer_unused else []  # read in finish()
        overhead = 0.0
        if control is not None:  # the carried floats are on the wire too: charge them as overhead
            overhead += self.group.allreduce_bytes(control.numel() * control.element_size())

        in_flight: list[tuple[list[int], Pending[tuple[list[Reduced], float]]]] = []
        for transport, members in routes.items():
            carry = control if transport is Transport.DENSE else None
            control = None if transport is Transport.DENSE else control
            # in place only in the caller's own gradients, never in a memory's buffer
            in_place = overwrite and not self.collecting_stats and all(compensated[i] is grads[i] for i in members)
            in_flight.append((members, self._start(transport, members, names, compensated, carry, in_place)))
        works = [work for _, pending in in_flight for work in pending.works]
        if control is not None:  # no dense layer in this reduction: a tiny collective of its own
            works += self.group.start_all_reduce(control)
        collecting_stats = self.collecting_stats

        def finish() -> list[torch.Tensor]:
            reduced: list[Reduced | None] = [None] * len(grads)
            total_overhead = overhead
            for members, pending in in_flight:
                results, extra = pending.finish()
                total_overhead += extra
                for i, result in zip(members, results, strict=True):
                    reduced[i] = result
            if total_overhead:
                self.ledger.add(collectives.OVERHEAD, total_overhead)
            idle = _none_true(used_here) if used_here else [False] * len(grads)
            unscale = self.loss_scale.unscale() if collecting_stats else 1.0
            for i, name in enumerate(names):
                result, compressor = reduced[i], compressors[i]
                assert result is not None
                dense = self.group.allreduce_bytes(grads[i].numel() * grads[i].element_size())
                self.ledger.add(name, result.wire_bytes, dense)
                lossy = result.sent is not compensated[i] and compressor.error_feedback
                sent = result.sent if lossy else compensated[i]
                if lossy and idle[i]:
                    self._unsettled[name] = (compensated[i], sent, compressor.sparse)
                else:
                    self.memory.update(name, compensated[i], sent, compressor.sparse)
                if collecting_stats:
                    kind = compressor.name if result.sent is not compensated[i] else "none"
                    self.stats.append(
                        layer_stats(name, kind, grads[i], compensated[i], result.sent,
                                    self.memory.residual(name), result.wire_bytes, dense,
                                    self.profile_ratios, unscale)
                    )
            return [r.mean for r in reduced]  # type: ignore[union-attr]

        return Pending(works, finish)

    def gradient_norm(self, parameters: Sequence[torch.Tensor]) -> float:
        """The norm of the reduced gradients of ``parameters``: the same on every rank (the
        same mean, the same ops in the same order); non-finite if any element is."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    def _take_control(self, grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The staged control row, with this rank's non-finite flag filled in (no sync)."""
        if self._control is None:
            return None
        control, self._control = self._control, None
        device = grads[0].device if grads else torch.device("cpu")
        control = collectives.to_device(control, device)  # no host sync on the hot path
        n = control.numel() // self.group.size
        if self._finite is not None:
            control[self.group.rank * n] = (~self._finite).to(control.dtype)
        self.control_rows = control.view(self.group.size, n)
        return control

    def _start(
        self, transport: Transport, members: list[int], names: Sequence[str], tensors: list[torch.Tensor],
        control: torch.Tensor | None = None, in_place: bool = False,
    ) -> Pending[tuple[list[Reduced], float]]:
        """Issue one transport's collectives for ``members``; finishes with (results, overhead bytes)."""
        group_tensors = [tensors[i] for i in members]
        if transport is Transport.DENSE:
            return _no_overhead(collectives.dense_allreduce(group_tensors, self.group, control=control,
                                                            in_place=in_place))
        compressors = [self.compressor_for(names[i]) for i in members]
        if transport is Transport.ALLREDUCE:
            return _no_overhead(collectives.summable_allreduce(group_tensors, compressors, self.group))
        if transport is Transport.LOWRANK:
            return _no_overhead(collectives.lowrank_allreduce(group_tensors, compressors, self.group))  # type: ignore[arg-type]
        if transport is Transport.ALLGATHER:
            return collectives.sparse_allgather(group_tensors, compressors, self.group)
        return self.scalable([names[i] for i in members], group_tensors, compressors, self.group)

    def settle_unused(self, used: Callable[[str], bool]) -> None:
        """Apply the held-back memory updates: as sent where ``used(layer)`` (some rank used
        the layer, so its mean reached the optimizer), else as if nothing had been sent
        (the residual keeps all it held: DDP dropped the mean of a layer no rank used)."""
        unsettled, self._unsettled = self._unsettled, {}
        for name, (compensated, sent, sparse) in unsettled.items():
            if used(name):
                self.memory.update(name, compensated, sent, sparse)
            else:
                self.memory.update(name, compensated, torch.zeros_like(sent), False)

    def discard_step(self) -> None:
        """Forget the error-feedback memory after a step the optimizer skipped.

        The skipped step's gradient (NaN-free but exploded, say) is already folded into the
        residuals; keeping them would re-send it on the next step. Dropping them also drops
        the small residual mass of earlier steps — bounded, and far better than replaying a
        bad gradient. Every rank calls this at the same step (the guard's decision is shared).
        """
        self.memory.reset()
        self._unsettled.clear()
        self.scalable.reset()

    # --- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-for-bit: step, plan, memory, compressor state."""
        if self._unsettled:  # held back by a step no backward closed: as sent, as the next step would
            self.settle_unused(lambda name: True)
        return {
            "step": self.step,
            "plan": self._plan.to_dict(),
            "pending_plan": None if self._pending is None else self._pending.to_dict(),
            "memory": self.memory.state_dict(),
            "server_residuals": self.scalable.state_dict(),
            "compressors": {
                name: {"spec": spec.to_dict(), "state": comp.state_dict()}
                for name, (spec, comp) in self._compressors.items()
            },
            "ledger": self.ledger.state_dict(),
            "loss_scale": self.loss_scale.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self._plan = Plan.from_dict(state["plan"])
        self._pending = None if state["pending_plan"] is None else Plan.from_dict(state["pending_plan"])
        self.memory.load_state_dict(state["memory"])
        self.scalable.load_state_dict(state["server_residuals"])
        self._compressors = {}
        for name, entry in state["compressors"].items():
            spec = CompressorSpec.from_dict(entry["spec"])
            compressor = spec.build(name, self.group.rank, self.seed)
            compressor.load_state_dict(entry["state"])
            self._compressors[name] = (spec, compressor)
        self.ledger.load_state_dict(state["ledger"])
        self.loss_scale.load_state_dict(state.get("loss_scale", {"scale": None}))


def _none_true(flags: Sequence[torch.Tensor]) -> list[bool]:
    """``not flag`` for each boolean scalar tensor, read in one host transfer."""
    return (~torch.stack([f.to(flags[0].device) for f in flags])).tolist()
