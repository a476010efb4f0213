"""The FSDP2 counterpart of :class:`raycomp._internal.ddp.state.CompressionState`: one plan over the
``fully_shard`` units of a model, with the byte ledger, the controller's statistics and
the guard's control rows.

The training loop (:class:`raycomp._internal.train.loop.TrainLoop`) uses either state the same way:
``set_plan`` between steps, ``stage_control`` before a step, ``control_rows`` and
``gradient_norm`` after it, ``stats`` at control boundaries, ``state_dict`` in checkpoints.

A plan names *units* (a unit's module path; ``(root)`` for the root module), not
parameters: FSDP reduce-scatters one 1-D gradient per unit, and that is what a
:class:`~raycomp._internal.fsdp.reduce_scatter.CompressedReduceScatter` compresses. Only compressors with a fixed
row size fit (:func:`~raycomp._internal.fsdp.reduce_scatter.check_sharded_spec`); the adaptive policy is told so
at registration (``sharded=True``: int4, int8, bf16 or dense per unit, priced as a reduce-scatter).

No extra collective per step: the guard's control floats of every rank (non-finite flag,
the previous step's loss and worst error, and this step's squared gradient norm) ride in
the all-to-all of the step's last unit, as a few bytes appended to every row. Each rank
holds only its shard of the reduced gradient, so the norm the guard watches is the RMS of
the ranks' own (unreduced) gradient norms, the same number on every rank. When the units
that reduce-scatter are not the ones expected (a unit without gradients this step), the
rows go in one small all-reduce instead.

In two levels (``levels``: :mod:`raycomp._internal.fsdp.two_level`) the units shard over their node's
group, reduce-scatter there densely and reduce each shard across nodes as the plan says;
the ledger counts what crossed nodes, :attr:`ShardedState.intra_bytes` what stayed inside.
The all-to-all then spans one node only, so the control rows take their own small
all-reduce over every rank each step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from raycomp._internal import transports as collectives
from raycomp._internal.fsdp.reduce_scatter import CompressedReduceScatter, check_sharded_spec
from raycomp._internal.fsdp.two_level import CrossNodeShards
from raycomp._internal.reduce.stats import LayerStats, layer_stats
from raycomp._internal.topology import Levels
from raycomp._internal.wire.ledger import WireLedger
from raycomp.plan import DENSE, CompressorSpec, Plan

__all__ = ["ROOT", "ShardedState", "control_row", "unit_parameters"]

ROOT = "(root)"  # the root unit's name in plans and statistics (its module path is "")


def unit_parameters(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """The ``fully_shard`` units of ``model`` that own trainable parameters, by name (module
    path, :data:`ROOT` for the root), in module order, each with the parameters it owns:
    those of its subtree that no unit nested in it owns (what its reduce-scatter carries)."""
    units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    owned: dict[str, list[torch.nn.Parameter]] = {}
    for name, module in units.items():
        nested = {id(p) for other, m in units.items()
                  if other != name and (not name or other.startswith(name + ".")) for p in m.parameters()}
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in nested]
        if params:
            owned[name or ROOT] = params
    return owned


def control_row(values: Sequence[float], norm_sq: torch.Tensor) -> torch.Tensor:
    """This rank's row of the guard's control floats, ``[non-finite flag, *values, squared
    gradient norm]``, on the norm's device and built there: on CUDA the staged values go
    over pinned and asynchronously, so the row rides with the last unit without a
    device-to-host wait (the rows are read once, on arrival). Built on the CPU it cost two
    more such waits a step on an H100 (reading the norm, copying the row back; docs/gpu.md)."""
    norm_sq = norm_sq.float().reshape(1)
    staged = collectives.to_device(torch.tensor(list(values), dtype=torch.float32), norm_sq.device)
    return torch.cat([(~torch.isfinite(norm_sq)).float(), staged, norm_sq])


class ShardedState:
    """Plan, ledger, statistics and control rows for a ``fully_shard`` model.

    Args:
        model: the model after ``fully_shard`` (its units and the root); a
            :class:`~raycomp._internal.fsdp.reduce_scatter.CompressedReduceScatter` is installed on every unit
            that owns parameters.
        plan: initial plan over unit names (default: everything dense).
        min_compress_numel: units with fewer gradient elements always go dense (fp32).
        seed: base seed of random compressors' draws.
        stats_every: measure :class:`~raycomp._internal.reduce.stats.LayerStats` per unit on the step before
            every multiple of this (0: never), as the DDP path does.
        error_feedback: keep each biased compressor's unsent part per unit (its memory is
            one fp32 copy of the unit's unsharded gradient).
        install: ``False`` leaves the units' reduce-scatter as it is (FSDP's own): plans are
            then not applied and nothing is counted on the wire, while statistics, guard rows
            and checkpoints work as with raycomp's comms.
        control_group: the group of the control rows' fallback all-reduce (CPU tensors: a
            gloo group when the gradients travel on NCCL; None: the default group).
        levels: the node's group and this position's cross-node group
            (:func:`raycomp._internal.topology.node_groups`) when ``model`` was sharded over its node's
            group (:func:`raycomp._internal.fsdp.two_level.node_mesh`): each unit then reduce-scatters
            densely inside the node and its shard crosses nodes compressed as the plan says.
            None: one level, every rank its own node.
    """

    def __init__(self, model: torch.nn.Module, plan: Plan | None = None, *, min_compress_numel: int = 1024,
                 seed: int = 0, stats_every: int = 0, error_feedback: bool = True, install: bool = True,
                 control_group: Any = None, levels: Levels | None = None) -> None:
        if levels is not None and not install:
            raise ValueError("install: a model sharded per node needs raycomp's cross-node hop; "
                             "allowed: install=True with levels, or levels=None")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        units = unit_parameters(model)
        if not units:
            raise ValueError("model: no fully_shard unit owns parameters; apply "
                             "torch.distributed.fsdp.fully_shard to the model (and its blocks) first")
        self.sizes = {name: sum(p.numel() for p in params) for name, params in units.items()}
        self.min_compress_numel, self.stats_every = min_compress_numel, stats_every
        self.control_group = control_group
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        #: the cross-node hop of a model sharded per node (None: one level)
        self.cross = None if levels is None else CrossNodeShards(
            levels, memory="residual" if error_feedback else "none", min_compress_numel=min_compress_numel,
            seed=seed, stats_every=stats_every)
        self.comms: dict[str, CompressedReduceScatter] = {}
        for name in units:
            comm = CompressedReduceScatter(DENSE, name=name, rank=self.rank, error_feedback=error_feedback,
                                           seed=seed, observer=self)
            if install:
                unit = model.get_submodule("" if name == ROOT else name)
                unit.set_custom_reduce_scatter(comm)
                if self.cross is not None:
                    unit.set_all_reduce_hook(self.cross.hook(name))
            self.comms[name] = comm
        self.ledger = WireLedger() if self.cross is None else self.cross.ledger
        self.intra_bytes = 0.0  # bytes sent inside the node (two levels; 0 when flat)
        self.step = 0
        self.stats: list[LayerStats] = []
        self.stats_step = -1
        self._comm_seconds = 0.0  # in the units' reduce-scatters
        self.control_rows: torch.Tensor | None = None
        self.rank_norms: list[float] = []  # every rank's own gradient norm, this step
        self._plan = plan or Plan()
        self._pending: Plan | None = None
        self._in_step = False
        self._calls = 0
        self._control: list[float] | None = None  # staged: rides with the next step's last unit
        self._norm_sq: torch.Tensor | None = None  # this rank's squared gradient norm so far
        self._call_started = 0.0
        self._install(self._plan)

    # --- plan and step boundaries -----------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def comm_seconds(self) -> float:
        """Time spent reducing gradients, whole run: the reduce-scatters and, in two levels,
        the cross-node hops."""
        return self._comm_seconds + (0.0 if self.cross is None else self.cross.seconds)

    @property
    def per_node(self) -> int:
        """The ranks of a node when the units shard per node (two levels), else 1."""
        return 1 if self.cross is None else self.cross.levels.topology.per_node

    def time_node_link(self) -> float | None:
        """Seconds per byte of an all-reduce inside this rank's node
        (:func:`raycomp._internal.node_link.node_seconds_per_byte`), None when flat. Collective."""
        if self.cross is None:
            return None
        from raycomp._internal.node_link import node_seconds_per_byte

        first = self.parameters[0]
        local = first.to_local() if hasattr(first, "to_local") else first
        return node_seconds_per_byte(self.cross.levels, 4 * sum(self.sizes.values()), local.device)

    def spec_for(self, unit: str) -> CompressorSpec:
        """What ``unit`` sends under the current plan: dense below ``min_compress_numel``."""
        if self.sizes[unit] < max(1, self.min_compress_numel):
            return DENSE
        return check_sharded_spec(self._plan.spec_for(unit))

    def set_plan(self, plan: Plan) -> None:
        """Install ``plan`` at the start of the next step (now, if between steps)."""
        unknown = sorted({name for name, _ in plan.layers} - set(self.comms))
        if unknown:
            raise ValueError(f"plan: unknown unit {unknown[0]!r}; units: {', '.join(map(repr, self.comms))}")
        if self._in_step:
            self._pending = plan
        else:
            self._install(plan)

    def _install(self, plan: Plan) -> None:
        self._plan, self._pending = plan, None
        if self.cross is not None:  # the plan is the cross-node hop's; inside the node, dense
            for name in self.comms:
                self.spec_for(name)  # refuses what cannot compress a shard
            self.cross.set_plan(plan)
            return
        for name, comm in self.comms.items():
            spec = self.spec_for(name)
            if spec != comm.spec:
                comm.set_spec(spec)

    @property
    def collecting_stats(self) -> bool:
        return self.stats_every > 0 and (self.step + 1) % self.stats_every == 0

    def _begin(self) -> None:
        if self._in_step:
            return
        self._in_step, self._calls, self._norm_sq = True, 0, None
        self.control_rows, self.rank_norms = None, []
        if self.collecting_stats:
            self.stats, self.stats_step = [], self.step

    def end_backward(self) -> None:
        """After ``loss.backward()``: close the step's reduction. If the control floats did
        not ride (no unit reduce-scattered last as expected, or one process), exchange them."""
        if not self._in_step:
            self._begin()
        if self.cross is not None:
            self.cross.end_step()
            reducer = self.cross.reducer
            if reducer.stats_step == self.step:
                self.stats = list(reducer.stats)
        if self.control_rows is None and self._control is not None:
            row = control_row(self._control, self._local_norm_sq())
            rows = torch.zeros(self.world_size, row.numel())
            rows[self.rank] = row
            if self.world_size > 1:
                dist.all_reduce(rows, group=self.control_group)
            self._take_rows(rows)
        self._in_step = False
        self.step += 1
        if self._pending is not None:
            self._install(self._pending)

    def discard_step(self) -> None:
        """A skipped step: drop the residuals that folded its gradient in (as the DDP path)."""
        for comm in self.comms.values():
            comm.residual = None
        if self.cross is not None:
            self.cross.reducer.discard_step()

    # --- control rows (the guard's) ----------------------------------------------------
    #: every step carries the control values: they ride in the all-to-all that runs anyway
    control_skipped = False
    #: the guard judges each rank's own compression error, carried in the step's rows
    #: (raycomp._internal.reduce.mean_error measures the applied mean's on the DDP path)
    measures_mean_error = False

    def stage_control(self, values: Sequence[float], skippable: bool = False) -> None:
        """Carry ``[non-finite flag, *values, squared norm]`` of every rank with the next
        step (``skippable`` or not: the step's all-to-all runs anyway)."""
        self._control = [float(v) for v in values]

    def _take_rows(self, rows: torch.Tensor) -> None:
        self.control_rows = rows[:, :-1]
        self.rank_norms = [math.sqrt(v) if v >= 0 else v for v in rows[:, -1].tolist()]

    def _local_norm_sq(self) -> torch.Tensor:
        if self._norm_sq is not None:
            return self._norm_sq
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in self.parameters if p.grad is not None]
        return sum((g.float().pow(2).sum() for g in grads), torch.zeros(()))

    def gradient_norm(self, parameters: Sequence[torch.Tensor]) -> float:
        """What the guard compares with its window: the RMS over ranks of each rank's own
        gradient norm (non-finite if any rank's gradient is)."""
        if not self.rank_norms:
            return 0.0
        return math.sqrt(math.fsum(n * n for n in self.rank_norms) / len(self.rank_norms))

    # --- what the comms tell us (raycomp._internal.fsdp.reduce_scatter.CallObserver) -----------------------------
    def begin_call(self, comm: CompressedReduceScatter) -> bool:
        self._begin()
        self._call_started = time.perf_counter()
        return self.collecting_stats and self.cross is None  # two levels: the shards' statistics

    def control_bytes(self, comm: CompressedReduceScatter, grads: torch.Tensor) -> torch.Tensor | None:
        square = grads.pow(2).sum()
        self._norm_sq = square if self._norm_sq is None else self._norm_sq + square
        self._calls += 1
        if self._calls != len(self.comms) or self._control is None or self.cross is not None:
            return None  # in two levels the all-to-all spans one node: the rows go apart
        row = control_row(self._control, self._norm_sq)
        self.ledger.add(collectives.OVERHEAD, (self.world_size - 1) * row.numel() * 4)
        return row.view(torch.uint8)

    def received_control(self, rows: torch.Tensor) -> None:
        self._take_rows(rows.contiguous().cpu().view(torch.float32).view(self.world_size, -1))

    def reduced(self, comm: CompressedReduceScatter, grads: torch.Tensor, compensated: torch.Tensor,
                sent: torch.Tensor | None, wire: float, dense: float) -> None:
        self._comm_seconds += time.perf_counter() - self._call_started
        if self.cross is not None:  # the node's dense hop; statistics come from the shards'
            self.intra_bytes += wire
            return
        self.ledger.add(comm.name, wire, dense)
        if self.collecting_stats:
            lossy = not comm.spec.is_dense and sent is not None
            self.stats.append(layer_stats(comm.name, comm.spec.name if lossy else "none", grads, compensated,
                                          sent if lossy else compensated, comm.residual, wire, dense))

    # --- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "plan": self._plan.to_dict(),
                 "pending_plan": None if self._pending is None else self._pending.to_dict(),
                 "comms": {name: comm.state_dict() for name, comm in self.comms.items()},
                 "ledger": self.ledger.state_dict()}
        if self.cross is not None:
            state.update(cross=self.cross.state_dict(), intra_bytes=self.intra_bytes)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("cross") is None) != (self.cross is None):
            written = "two levels" if state.get("cross") is not None else "one level"
            raise ValueError(f"compression.levels: this checkpoint was written in {written}; allowed: "
                             "resume at the same nodes x ranks per node")
        if self.cross is not None:
            self.cross.load_state_dict(state["cross"])
            self.intra_bytes = float(state["intra_bytes"])
        self.step = int(state["step"])
        self._install(Plan.from_dict(state["plan"]))
        self._pending = None if state["pending_plan"] is None else Plan.from_dict(state["pending_plan"])
        for name, comm in self.comms.items():
            comm.load_state_dict(state["comms"][name])
        self.ledger.load_state_dict(state["ledger"])

    def close(self) -> None:
        """Nothing to release (no thread): FSDP calls the comms on its own schedule."""
