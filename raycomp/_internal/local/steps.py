"""Local steps with compressed pseudo-gradients: the DiLoCo family around an ordinary loop.

Each rank runs its own (inner) optimizer for ``sync_every`` steps without talking to the
others. Then the ranks average the pseudo-gradient ``global - local`` (how far this rank's
weights moved from the last synchronised ones), compressed with error feedback by
raycomp's reducer, and an outer optimizer steps the global weights with that mean as its
gradient; every rank then continues from the same new global weights.

With ``fragments > 1`` the model is synced in staggered pieces (Streaming DiLoCo), and with
``delay > 0`` a sync stays on the wire while that many inner steps run; the local weights
then keep the progress those steps made on top of the new global weights.

With ``levels`` (:func:`raycomp._internal.topology.node_groups`) a replica is a whole node: its ranks
train data-parallel among themselves (their gradients all-reduced inside the node every
inner step, so they hold the same weights), and a sync reduces in two levels
(:class:`raycomp._internal.reduce.two_level.TwoLevelReducer`): each rank of a node sends its ``1/L`` piece
of the node's pseudo-gradient across nodes, compressed, in parallel with the node's other
ranks. DiLoCo with data parallelism inside each worker, as INTELLECT-1 runs it. With
``delay > 0`` the cross-node hop runs beside the delay's inner steps, as a flat sync does;
the node's all-gather of the result follows when the sync is finished.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from raycomp._internal.local.replica_mean import first_rank, mean_in_place
from raycomp._internal.local.schedule import FragmentSchedule, split_fragments
from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp._internal.reduce.signals import all_finite
from raycomp._internal.reduce.two_level import TwoLevelReducer
from raycomp._internal.topology import Levels
from raycomp.plan import Plan

__all__ = ["BUFFER_MODES", "LocalSteps", "nesterov_outer"]

BUFFER_MODES = ("average", "local")


def nesterov_outer(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class _InFlight:
    """A fragment's sync between the start of its collectives and its outer step."""

    def __init__(self, fragment: int, finish_after: int, pending: Any, snapshot: list[torch.Tensor] | None):
        self.fragment, self.finish_after, self.pending, self.snapshot = fragment, finish_after, pending, snapshot


class LocalSteps:
    """Run ``model``'s ranks apart for ``sync_every`` steps, then merge them with an outer step.

    Call :meth:`step` after each inner ``optimizer.step()``; the model must not be wrapped in
    DDP (nothing is all-reduced in between). Every rank builds it at the same point; the
    constructor broadcasts rank 0's parameters and buffers, so all ranks start equal.

    Args:
        model: the model every rank trains (not DDP-wrapped).
        sync_every: H, inner steps between two syncs of a fragment. DiLoCo uses 500 with 8
            replicas on long runs; on short runs and few ranks smaller H (4-32) loses less.
        outer_optimizer: builds the outer optimizer over the global weights (default
            :func:`nesterov_outer`, DiLoCo's Nesterov SGD, lr 0.7, momentum 0.9, tuned for
            H=500: the published algorithm, as written). ``lambda p: torch.optim.SGD(p,
            lr=1.0)`` is plain model averaging (torch's PeriodicModelAverager): on short runs
            often the better choice, and the default of ``compression.local``
            (:class:`raycomp.config.LocalSection`), which builds this class for
            ``raycomp.train`` and the jobs with ``outer_lr``, ``outer_momentum`` and
            ``nesterov``.
        plan: how the pseudo-gradient travels, per parameter name (default: dense fp32).
            ``Plan.uniform("int8")`` is INTELLECT-1's choice; ``"int4"`` Streaming
            DiLoCo's; error feedback keeps what compression drops for the next sync.
        memory: the reducer's error-feedback memory (``"residual"`` or ``"none"``).
        fragments: F, pieces of the model synced in turn, ``sync_every / F`` steps apart.
        delay: inner steps a sync overlaps (0 .. sync_every // fragments - 1). Default 0,
            DiLoCo's; ``compression.local.delay`` defaults to "auto", one step where the
            syncs are two or more steps apart (:func:`raycomp._internal.local.resolve_delay`).
        buffers: ``"average"`` (floating-point buffers such as BatchNorm's running statistics
            are averaged, densely, whenever fragment 0 syncs) or ``"local"`` (each rank keeps
            its own; evaluate on one rank then).
        levels: the node's group and this rank's cross-node group, when a replica is a
            node (the caller keeps the node's ranks equal: DDP over the node's group, as
            :mod:`raycomp._internal.train.local_strategy` sets up). ``None``: every rank is a replica.
        process_group, seed, min_compress_numel: as for :class:`~raycomp._internal.reduce.reducer.CompressedReducer`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        sync_every: int,
        outer_optimizer: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer] = nesterov_outer,
        plan: Plan | None = None,
        memory: str = "residual",
        fragments: int = 1,
        delay: int = 0,
        buffers: str = "average",
        process_group: Any = None,
        seed: int = 0,
        min_compress_numel: int = 1024,
        levels: Levels | None = None,
    ) -> None:
        if buffers not in BUFFER_MODES:
            raise ValueError(f"buffers: must be one of {', '.join(BUFFER_MODES)}, got {buffers!r}")
        self.model, self.buffers, self.group = model, buffers, process_group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._broadcast_start()
        self._outer_factory = outer_optimizer
        options = dict(process_group=process_group, memory=memory, seed=seed, min_compress_numel=min_compress_numel)
        self.reducer = CompressedReducer(plan, **options) if levels is None else \
            TwoLevelReducer(levels, plan, **options)
        self.inner_steps = 0
        self.outer_steps = 0
        self.skipped_outer = 0  # syncs whose mean pseudo-gradient was not finite
        #: the control rows that rode with the latest finished sync (see :meth:`stage_control`)
        self.last_rows: torch.Tensor | None = None
        self._in_flight: _InFlight | None = None
        self.restart(sync_every, fragments, delay)

    def restart(self, sync_every: int, fragments: int = 1, delay: int = 0) -> None:
        """Start over from the model's current weights, which must be the same on every rank
        (after per-step training, say): a new schedule counted from this step, the global
        weights set to the current ones, a fresh outer optimizer and error-feedback memory.
        Only while :attr:`quiescent`."""
        if not self.quiescent:
            raise RuntimeError("LocalSteps.restart: a sync is on the wire; call quiesce() first")
        self.schedule = FragmentSchedule(sync_every, fragments, delay)
        self.fragment_members = split_fragments([p.numel() for p in self.params], fragments)
        self.origin = self.inner_steps  # the schedule counts inner steps from here
        #: per fragment, the inner step after which every rank last held the same weights for it
        #: (this restart, a sync without inner steps kept, a merge): see :attr:`merged`
        self.equal_at: list[int | None] = [self.inner_steps] * fragments
        self.global_params = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.outer = self._outer_factory(self.global_params)
        self.reducer.memory.reset()

    # --- the loop ---------------------------------------------------------------------
    def step(self) -> bool:
        """After an inner optimizer step: finish a sync that is due, start the fragments that
        are due. Returns whether an outer step was applied."""
        self.inner_steps += 1
        applied = False
        if self._in_flight is not None and self._in_flight.finish_after == self.inner_steps:
            applied = self._finish()
        for fragment in self.schedule.due(self.inner_steps - self.origin):
            self._start(fragment)
            if self.schedule.delay == 0:
                applied = self._finish() or applied
        return applied

    def starts_next(self) -> bool:
        """Whether the next :meth:`step` starts a sync (what :meth:`stage_control` stages
        rides with it)."""
        return bool(self.schedule.due(self.inner_steps + 1 - self.origin))

    @property
    def quiescent(self) -> bool:
        """No sync on the wire: the state can be checkpointed."""
        return self._in_flight is None

    def set_plan(self, plan: Plan) -> None:
        """How the next syncs' pseudo-gradients travel (from the next sync on)."""
        self.reducer.set_plan(plan)

    def stage_control(self, values: Sequence[float]) -> None:
        """Carry these floats of this rank to every rank with the next sync (its last
        collective); after that sync, :attr:`last_rows` holds one row per rank:
        ``[non-finite flag, *values]`` (:meth:`raycomp._internal.reduce.reducer.CompressedReducer.stage_control`)."""
        self.reducer.stage_control(values)

    def quiesce(self) -> None:
        """Finish a sync that is on the wire now, without waiting for its ``delay`` steps."""
        if self._in_flight is not None:
            self._finish()

    @property
    def merged(self) -> bool:
        """Every rank holds the same weights now: no inner step ran since each fragment was
        last left equal (a sync waited for at once, a merge, :meth:`restart`)."""
        return self._in_flight is None and all(at == self.inner_steps for at in self.equal_at)

    def merge_all(self) -> int:
        """Sync every fragment now (after finishing one on the wire): the ranks then hold
        the same weights, as they must to leave local steps and at the end of a run (DiLoCo's
        model is the one after the last outer step). A no-op where they hold them already
        (:attr:`merged`): an outer step on a zero pseudo-gradient would send a sync for
        nothing and still move the weights by the outer momentum. Returns the outer steps
        applied."""
        self.quiesce()
        if self.merged:
            return 0
        applied = 0
        for fragment in range(self.schedule.fragments):
            self._start(fragment)
            applied += self._finish()
        self.equal_at = [self.inner_steps] * self.schedule.fragments
        return applied

    def _start(self, fragment: int) -> None:
        members = self.fragment_members[fragment]
        pseudo = [self.global_params[i].detach() - self.params[i].detach().float() for i in members]
        snapshot = [self.params[i].detach().clone() for i in members] if self.schedule.delay else None
        self.reducer.begin_step()
        names = [self.names[i] for i in members]
        if isinstance(self.reducer, TwoLevelReducer):  # the cross-node hop beside the delay's inner steps
            pending = self.reducer.start(names, pseudo, closes_step=True, gather_on_wait=True)
        else:
            pending = self.reducer.start(names, pseudo, closes_step=True)
        self._in_flight = _InFlight(fragment, self.inner_steps + self.schedule.delay, pending, snapshot)

    def _finish(self) -> bool:
        """Wait for the sync on the wire and apply its outer step; False if it was skipped."""
        flight, self._in_flight = self._in_flight, None
        assert flight is not None
        means = flight.pending.wait()
        self.last_rows = self.reducer.control_rows
        self.reducer.end_step()
        members = self.fragment_members[flight.fragment]
        finite = all_finite(means)  # one host read below (the reducer's own flag is another)
        if finite is not None and not bool(finite):
            # NaN/Inf reached the mean (the same on every rank): no outer step, and every rank
            # goes back to the global weights, dropping the interval and its memory
            self.skipped_outer += 1
            self.reducer.discard_step()
            with torch.no_grad():
                for i in members:
                    self.params[i].copy_(self.global_params[i].detach())
            self.equal_at[flight.fragment] = self.inner_steps
            return False
        for i, mean in zip(members, means, strict=True):
            self.global_params[i].grad = mean.to(self.global_params[i].dtype)
        self.outer.step()  # parameters without a gradient (other fragments) are left alone
        with torch.no_grad():
            for k, i in enumerate(members):
                self.global_params[i].grad = None
                merged = self.global_params[i].detach()
                if flight.snapshot is not None:  # keep the inner steps that ran meanwhile
                    merged = merged + (self.params[i].detach().float() - flight.snapshot[k].float())
                self.params[i].copy_(merged)
        if flight.fragment == 0 and self.buffers == "average":
            self._average_buffers()
        if flight.snapshot is None:  # no inner step's progress kept on top: equal on every rank
            self.equal_at[flight.fragment] = self.inner_steps
        self.outer_steps += 1
        return True

    def _average_buffers(self) -> None:
        floats = [b for b in self.model.buffers() if b.is_floating_point() and b.numel()]
        if not floats:
            return
        buffer = mean_in_place(floats, self.group)
        sent = self.reducer.group.allreduce_bytes(buffer.numel() * buffer.element_size())
        self.reducer.ledger.add("buffers", sent, sent)  # dense: what was sent is what dense costs

    def _broadcast_start(self) -> None:
        with torch.no_grad():
            for t in [*self.params, *self.model.buffers()]:
                dist.broadcast(t.data, src=first_rank(self.group), group=self.group)

    # --- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global weights, the outer optimizer, the schedule's position and the
        reducer (error-feedback residuals, compressor state, wire bytes). Only between syncs
        (:attr:`quiescent`): a sync on the wire cannot be saved."""
        if not self.quiescent:
            raise RuntimeError("LocalSteps.state_dict: a sync is on the wire; checkpoint when "
                               "quiescent is True (at most delay steps later)")
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "skipped_outer": self.skipped_outer,
            "origin": self.origin,
            "equal_at": list(self.equal_at),
            "schedule": dataclasses.asdict(self.schedule),
            "global": [p.detach().clone() for p in self.global_params],
            "outer": self.outer.state_dict(),
            "reducer": self.reducer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, mine = state["schedule"], dataclasses.asdict(self.schedule)
        if saved != mine:
            raise ValueError(f"LocalSteps.load_state_dict: checkpoint schedule {saved} differs from {mine}")
        if len(state["global"]) != len(self.global_params):
            raise ValueError(f"LocalSteps.load_state_dict: {len(state['global'])} global tensors, "
                             f"model has {len(self.global_params)}")
        with torch.no_grad():
            for p, saved_p in zip(self.global_params, state["global"], strict=True):
                p.copy_(saved_p)
        self.outer.load_state_dict(state["outer"])
        self.reducer.load_state_dict(state["reducer"])
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        self.skipped_outer = int(state["skipped_outer"])
        self.origin = int(state["origin"])
        # absent from older checkpoints: taken as not equal (a merge then syncs once more)
        self.equal_at = list(state.get("equal_at", [None] * self.schedule.fragments))
