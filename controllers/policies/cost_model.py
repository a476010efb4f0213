"""The adaptive policy's cost model: from what the run measured to the predicted step time
of a candidate plan.

It learns three things from the controller's Timing reports (per rank and step): the
link's bandwidth and the compute time on dense intervals, and per collective family the
seconds an extra round costs on compressed intervals (all of their step that the compute
and the bytes do not explain). A plan is priced from what each
compressor declares (:class:`raycomp.compressors.Cost` and ``payload_bytes``)::

    predicted = compute + sum over layers of sent(layer) / bandwidth
                + sum over all-gather layers of W * payload(layer) / decode_rate
                + sum over the plan's families of rounds_f * overhead_f

(the decode term only with a ``decode_rate``; without one a family's measured round
overhead holds its decode, at the run's own W).

A two-level run (``RunState.per_node`` = L > 1: ``raycomp._internal.reduce.two_level``) sends a compressed
plan's layers across nodes as L pieces, one per rank of the node, over K = W / L nodes: its
bytes are the node's, L pieces of each layer at K ranks, on the node's one slow link, and
its rounds and decode are at K; its reduce-scatter and all-gather inside the node move what
an all-reduce of the whole gradient there does, priced at the node's own link as the run
timed it (``RunState.node_link``, :mod:`raycomp._internal.node_link`; untimed, they are learned as
part of the families' overhead). A plan dense everywhere stays one flat all-reduce at W.

The derivation and its measured grounds: ``docs/cost-model.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raycomp.compressors import Compressor, Transport, compressor_class, make_compressor
from raycomp.plan import DENSE, CompressorSpec

from ..state import RunState
from .layer_sizes import element_bytes, nearest_size, piece, piece_on_nodes
from .rounds import family_rounds

SMOOTHING = 0.5  # EMA weight of the newest measurement
DENSE_SHARE = 0.95  # an interval whose wire bytes are >= this share of dense bytes is dense


@dataclass
class CostState:
    """What a cost model has measured."""

    bw: float | None = None  # bytes/s per rank (the assumed bandwidth when one is given)
    overhead: dict[str, float] = field(default_factory=dict)  # family -> seconds of an extra round
    compute: float | None = None  # seconds a step computes
    seen_step: int = -1  # latest Timing step taken into the estimates
    #: layer -> bytes per gradient element, from the latest statistics of it sent dense (a
    #: two-level compressed step counts only its piece's dense bytes)
    element: dict[str, float] = field(default_factory=dict)
    #: bytes per gradient element over the whole model, from a dense interval's own bytes
    #: (what a dense step sends, whatever statistics were taken): the size of a layer whose
    #: dense statistics have not been seen
    model_element: float | None = None


class CostModel:
    """Measurements and predictions of one run.

    Args:
        round_seconds: what an extra round of a family costs until it is measured
            (optimistic, so that every family gets tried once).
        bandwidth: bytes per second per rank to price plans with (None: measured on dense steps).
        sharded: the run reduce-scatters (FSDP): each element is sent (W-1)/W times instead
            of an all-reduce's 2(W-1)/W, in one all-to-all a unit whatever it carries.
            Sharded per node (``RunState.per_node`` > 1, :mod:`raycomp._internal.fsdp.two_level`),
            every plan goes in two levels, the dense one too: a reduce-scatter inside the
            node, then each rank's 1/L shard all-reduced across the K nodes by the
            ordinary transports, the node's L shards sharing its link, priced as a
            two-level DDP step's pieces.
        decode_rate: bytes of all-gathered payload one rank decodes per second. With W
            ranks an all-gather layer (Top-K, DGC) hands every rank W payloads to decode
            (scatter-add each rank's sparse values into one dense tensor), so its decode
            grows with W as its bytes do; given, each all-gather layer adds
            ``W * payload / decode_rate`` seconds, and what a measured interval's
            all-gather layers are predicted to decode is taken out of its residual before
            the families' round overheads are learned from it, so it is not counted
            twice. Set it from a benchmark of the decompressor (payload bytes over
            decompress seconds, ``docs/benchmarks/kernels.json``) to price a W the run
            is not at, as ``python -m jobs.projection`` does. None: no term of its own; the
            decode is then part of the family's measured round overhead, measured at the
            run's own W and forgotten on a resize (:meth:`forget`), so the run's own
            predictions stay consistent but do not extrapolate to another W.
    """

    def __init__(self, round_seconds: float, bandwidth: float | None = None, sharded: bool = False,
                 decode_rate: float | None = None) -> None:
        self.prior = float(round_seconds)
        self.assumed_bw = bandwidth
        self.sharded = sharded
        self.decode_rate = decode_rate
        #: what it measured; part of its policy's state (the policy hands it a loaded one)
        self.state = CostState(bw=bandwidth)
        self._compressors: dict[CompressorSpec, Compressor] = {}

    @property
    def bw(self) -> float | None:
        return self.state.bw

    @property
    def compute(self) -> float | None:
        return self.state.compute

    @property
    def overhead(self) -> dict[str, float]:
        """collective family -> seconds an extra round of it costs, measured"""
        return self.state.overhead

    @property
    def ready(self) -> bool:
        """Whether a dense interval has timed the link (and the compute)."""
        return self.bw is not None and self.compute is not None

    # --- measuring ----------------------------------------------------------------------
    def measure(self, run: RunState) -> None:
        """Take the Timing reports not seen yet into the estimates."""
        s = self.state
        timings = [t for t in run.timings if t.step > s.seen_step]
        if not timings:
            return
        index = len(run.timings) - len(timings)
        previous = run.timings[index - 1] if index > 0 else None
        per_rank = max(1, run.world_size)
        for t in timings:
            if previous is not None and previous.world_size != t.world_size:
                previous, s.seen_step = t, t.step  # a resize between them: no sample spans it
                continue
            if previous is None:  # the run's first report: totals count from zero
                steps, wire, dense = t.step + 1, t.wire_bytes, t.dense_bytes
            else:
                steps = t.step - previous.step
                wire, dense = t.wire_bytes - previous.wire_bytes, t.dense_bytes - previous.dense_bytes
            previous = t
            s.seen_step = t.step
            if steps <= 0 or wire < 0 or dense <= 0:
                continue  # a restart reset the totals, or nothing was sent: no sample
            wire, dense = wire / (per_rank * steps), dense / (per_rank * steps)
            if wire >= DENSE_SHARE * dense:
                # the compute is a dense step's: what a compressed step adds to it (its
                # codec, the overlap it loses, its rounds) is its families' overhead
                s.compute = ema(s.compute, max(0.0, t.compute_seconds))
                numel = sum(h.numel for h in run.layers.values())
                if numel and per_rank > 1:  # a dense step's bytes are a flat ring's
                    s.model_element = nearest_size(dense / (self._dense_share(run, per_rank) * numel))
                if self.assumed_bw is None and t.comm_seconds > 0:
                    # average seconds per byte, not bytes per second: one slow interval
                    # after a fast one must weigh as much as the other way round; sharded
                    # per node, the node's L shards cross its link at once, after the
                    # reduce-scatter inside it
                    shards = max(1, run.per_node) if self.sharded else 1
                    crossing = max(t.comm_seconds - self._inside(run, shards), 0.1 * t.comm_seconds)
                    per_byte = ema(None if s.bw is None else 1 / s.bw, crossing / (shards * wire))
                    s.bw = 1 / per_byte
                if t is run.timings[-1]:  # the layers' statistics are this interval's
                    for name, h in run.layers.items():
                        if h.compressor == DENSE.name and h.dense_bytes > 0:
                            s.element[name] = element_bytes(h, per_rank, self._dense_share(run, per_rank))
                continue
            if s.compute is None:  # until a dense interval times it, this interval's own compute
                s.compute = max(0.0, t.compute_seconds)
            if s.bw is not None and t is run.timings[-1]:
                # the layers' compressor names are those of this (the latest) interval
                in_force = self._in_force(run)
                ranks, per_node = self.levels(run, in_force)
                rounds = self.rounds({h.compressor for h in run.layers.values()}, ranks, per_node)
                if rounds:
                    decode = self._traffic(run, in_force)[1] if self.decode_rate else 0.0
                    # the whole step beyond a dense step's compute and this plan's bytes (a
                    # two-level rank's share its node's link with the node's other ranks):
                    # the codec runs in what the rank counts as compute, so the
                    # communication's wait alone would price a compressed plan too cheap
                    # where the link is fast and go back and forth between it and dense
                    inside = self._inside(run, per_node)
                    extra = t.step_seconds - s.compute - per_node * wire / s.bw - decode - inside
                    self.measure_rounds(rounds, max(0.0, extra))

    def measure_rounds(self, rounds: dict[str, int], residual: float) -> None:
        """Share one interval's step beyond its compute and bytes (``residual``) among the
        collective families that ran in it (``rounds``: family -> extra rounds), in
        proportion to what each is expected to cost. A family not measured yet is expected
        to cost what a round of the measured ones does on average (``round_seconds`` before
        any), so that one arriving beside measured ones is not taken for free. With a
        ``decode_rate`` the caller has taken the predicted decode out of ``residual``."""
        seed = mean(list(self.overhead.values())) or self.prior
        expected = {f: r * self.overhead.get(f, seed) for f, r in rounds.items()}
        total = sum(expected.values())
        for f, r in rounds.items():
            share = expected[f] / total if total > 0 else r / sum(rounds.values())
            self.state.overhead[f] = ema(self.overhead.get(f), share * residual / r)

    # --- predicting ---------------------------------------------------------------------
    def predict(self, run: RunState, chosen: dict[str, CompressorSpec]) -> tuple[float, dict[str, int]]:
        """The predicted step of the plan that puts each layer on ``chosen`` (dense where it
        names none), and its collective families' extra rounds."""
        total, decode = self._traffic(run, chosen)
        assert self.bw is not None and self.compute is not None
        ranks, per_node = self.levels(run, chosen)
        rounds = self.rounds({chosen.get(name, DENSE).name for name in run.layers}, ranks, per_node)
        seconds = sum(r * self.overhead.get(f, self.prior) for f, r in rounds.items())
        inside = self._inside(run, per_node)
        return self.compute + total / self.bw + decode + seconds + inside, rounds

    def node_allreduce(self, run: RunState) -> float:
        """Seconds an all-reduce of the whole dense gradient inside a node takes, at the
        node's link as timed (``RunState.node_link``): what a two-level compressed step's
        reduce-scatter and all-gather there move, and what every inner step of local steps
        between nodes sends. 0 when flat or not timed."""
        per_node = max(1, run.per_node)
        if per_node == 1 or run.node_link is None:
            return 0.0
        sizes = self._elements(run)
        dense = sum(h.numel * sizes[name] for name, h in run.layers.items())
        return 2 * (per_node - 1) / per_node * dense * run.node_link

    def _inside(self, run: RunState, per_node: int) -> float:
        """What a step spends inside its node: nothing in one level; a two-level DDP step's
        reduce-scatter and all-gather (:meth:`node_allreduce`); a model sharded per node,
        its reduce-scatter only (FSDP all-gathers the parameters there whatever the plan)."""
        if per_node == 1:
            return 0.0
        full = self.node_allreduce(run)
        return full / 2 if self.sharded else full

    def _elements(self, run: RunState) -> dict[str, float]:
        """Bytes per gradient element of each layer: as a dense step measured it, else from
        its latest statistics. Those of a two-level compressed step count each layer's 1/L
        piece on a ring of the K nodes (every layer is cut, the dense ones too): read as a
        flat ring's whole layers, fp32 would be priced as 4/3 bytes an element at 2 x 2,
        and a dense step at a third of its bytes, until a dense interval with statistics
        had run."""
        w = max(1, run.world_size)
        allreduce = self._dense_share(run, w)
        in_pieces = run.per_node > 1 and not self.sharded and any(x.compressor != DENSE.name
                                                                   for x in run.layers.values())
        share = piece_on_nodes(run) / allreduce if in_pieces else 1.0
        return {name: self.state.element.get(name) or self.state.model_element
                or element_bytes(h, w, allreduce, share=share) for name, h in run.layers.items()}

    def levels(self, run: RunState, chosen: dict[str, CompressorSpec]) -> tuple[int, int]:
        """(ranks a layer's collectives span, ranks sharing one slow link): (K, L) for a
        two-level run's compressed plan and every plan of a model sharded per node, else
        (W, 1)."""
        w, per_node = max(1, run.world_size), max(1, run.per_node)
        if per_node == 1:
            return w, 1
        if not self.sharded and all(chosen.get(name, DENSE).name == DENSE.name for name in run.layers):
            return w, 1  # a dense DDP step is DDP's own flat all-reduce
        return run.nodes, per_node

    def _traffic(self, run: RunState, chosen: dict[str, CompressorSpec]) -> tuple[float, float]:
        """One rank's bytes on the wire per step under ``chosen`` (a two-level run: its
        node's, the bytes of the slow link it shares), and its seconds decoding all-gathered
        payloads (0 without a ``decode_rate``)."""
        w = max(1, run.world_size)
        allreduce = self._allreduce(w)
        ranks, parts = self.levels(run, chosen)
        over = 2 * (ranks - 1) / ranks if parts > 1 else allreduce  # at the ranks the collectives span
        total = decoded = 0.0
        sizes = self._elements(run)
        for name, h in run.layers.items():
            compressor = self._compressor(chosen.get(name, DENSE))
            per_byte = (ranks - 1) if compressor.transport is Transport.ALLGATHER else over
            numel, shape = piece(h, parts)
            payload = compressor.payload_bytes(numel, shape, sizes[name])
            total += parts * per_byte * payload
            if compressor.transport is Transport.ALLGATHER:
                decoded += ranks * payload  # every rank's payload, its own included
        return total, decoded / self.decode_rate if self.decode_rate else 0.0

    def _allreduce(self, world_size: int) -> float:
        """Times a dense step sends each element: a ring all-reduce's 2(W-1)/W, a sharded
        run's reduce-scatter (W-1)/W."""
        w = world_size
        return (w - 1) / w if self.sharded else 2 * (w - 1) / w

    def _dense_share(self, run: RunState, world_size: int) -> float:
        """Times a dense step's bytes count each element, per rank: :meth:`_allreduce`'s,
        or, sharded per node, a ring of the K nodes over the rank's 1/L shard."""
        if self.sharded and run.per_node > 1:
            return piece_on_nodes(run)
        return self._allreduce(world_size)

    def _in_force(self, run: RunState) -> dict[str, CompressorSpec]:
        """Each layer's compressor in the latest interval: the plan's spec where the layer
        reported that compressor, else the reported name at its default parameters (dense
        for a name this process cannot resolve)."""
        chosen = {}
        for name, h in run.layers.items():
            spec = run.plan.spec_for(name)
            if spec.name != h.compressor:
                try:
                    compressor_class(h.compressor)
                    spec = CompressorSpec.of(h.compressor)
                except ValueError:
                    spec = DENSE
            chosen[name] = spec
        return chosen

    def rounds(self, families: set[str], world_size: int, per_node: int = 1) -> dict[str, int]:
        """Collective rounds beyond dense's per family; none on the flat sharded path (one
        all-to-all a unit). Sharded per node the shards take the ordinary transports."""
        return {} if self.sharded and per_node == 1 else family_rounds(families, world_size)

    def on_prior(self, rounds: dict[str, int]) -> set[str]:
        """The families among ``rounds`` still priced at the assumed round_seconds."""
        return {f for f in rounds if f not in self.overhead}

    def _compressor(self, spec: CompressorSpec) -> Compressor:
        compressor = self._compressors.get(spec)
        if compressor is None:
            compressor = self._compressors[spec] = make_compressor(spec.name, **dict(spec.params))
        return compressor

    def forget(self) -> None:
        """Forget what was measured (the link's bandwidth unless it was given, the compute,
        each family's round overhead): the run restarted at another world size, where a
        step computes and a ring or an all-gather moves different amounts, so the figures
        are measured again, as at a run's start (the chooser keeps the plan dense until a
        dense interval has timed the link). Timings already seen stay seen."""
        self.state.bw, self.state.compute = self.assumed_bw, None
        self.state.overhead.clear()

    def skip_to(self, step: int) -> None:
        """Take no Timing report up to ``step`` into the estimates (they timed something
        other than per-step reductions: local steps' inner steps and syncs)."""
        self.state.seen_step = max(self.state.seen_step, step)


def ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


__all__ = ["CostModel", "CostState", "ema", "family_rounds", "mean"]
