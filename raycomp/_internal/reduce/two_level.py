"""Two levels: gradients meet densely inside each node, and only each node's mean, split by
position on the node, crosses nodes compressed.

A node of ``L`` ranks on a fast link, ``K`` nodes on a slow one (:mod:`raycomp._internal.topology`).
Each reduction of a two-level step takes three hops, as Horovod's hierarchical all-reduce
and BytePS lay them out, with raycomp's compression on the middle one only:

1. **inside the node, dense**: every layer is cut into ``L`` pieces (:class:`ShardLayout`);
   an all-to-all hands piece ``i`` of every rank to the node's ``i``-th rank, which sums
   them into the node's mean of its pieces (a reduce-scatter in one round);
2. **across nodes, compressed**: rank ``i`` of every node reduces its pieces with the
   ordinary compressed reduction (:class:`~raycomp._internal.reduce.reducer.CompressedReducer`'s steps:
   compensate, compress, communicate, decompress, update memory) over its cross-node group,
   so the ``L`` positions of a node cross in parallel, each with ``1/L`` of the bytes, and
   error feedback keeps a residual per piece on the rank that sends it;
3. **inside the node, dense**: an all-gather brings every position's mean back to every rank.

So a step quantizes at most once, whatever ``W`` is, and a node's slow link carries what one
flat rank would send (an all-gather method's pieces are gathered from ``K - 1`` nodes, not
``W - 1`` ranks). Every rank ends with the same mean: a piece's mean is computed on one
rank of each node, identically on every node (the cross-node transports agree across their
group), and handed to the rest of its node as bytes.

Control values (a step's non-finite flags and the caller's staged values) are summed over
the node beside the all-to-all, then ride the cross-node reduction as they ride a flat one.
A step watches every layer's gradient for NaN/Inf before the node's exchange, since after
it a rank's NaN sits in one rank's piece only.

The :attr:`~raycomp._internal.reduce.reducer.CompressedReducer.ledger` counts what crosses nodes, each piece
beside its share of a flat dense ring's bytes; :attr:`TwoLevelReducer.intra_ledger` counts
the bytes that stay inside the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from raycomp._internal.reduce.memory import PER_LAYER_STATE, Memory, make_memory
from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp._internal.reduce.routing import Router
from raycomp._internal.topology import Levels
from raycomp._internal.transports import Pending
from raycomp._internal.wire.ledger import WireLedger
from raycomp.plan import Plan

__all__ = ["INTRA", "ShardLayout", "TwoLevelReducer", "cut", "piece_of"]

#: the intra-node ledger's one entry: the bytes of the node's exchange and all-gather
INTRA = "(intra-node)"


class ShardLayout:
    """Where each layer's ``parts`` pieces lie in the node's exchange buffer.

    A layer with at least ``parts`` rows is cut between rows (a piece is a matrix of whole
    rows, so low-rank compressors still see matrices); a smaller one is cut as a vector. Pieces are
    contiguous in the layer. Segment ``i`` of the buffer (``width`` elements, zero-padded)
    holds piece ``i`` of every layer, back to back, and goes to position ``i``.
    """

    def __init__(self, shapes: Sequence[torch.Size], parts: int) -> None:
        self.parts = parts
        self.shapes = [torch.Size(s) for s in shapes]
        #: per position: (layer index, offset in the segment, piece shape) of each non-empty piece
        self.pieces: list[list[tuple[int, int, torch.Size]]] = [[] for _ in range(parts)]
        cursor = [0] * parts
        spans: list[tuple[int, int, int, int]] = []  # (start in the layers back to back, size, position, offset)
        start = 0
        for layer, shape in enumerate(self.shapes):
            for position, (offset, size, piece) in enumerate(cut(shape, parts)):
                if size:
                    self.pieces[position].append((layer, cursor[position], piece))
                    spans.append((start + offset, size, position, cursor[position]))
                    cursor[position] += size
            start += shape.numel()
        self.width = max(1, *cursor)  # no collective is given an empty tensor
        self.numel = start
        #: the buffer index of each element of the layers, flattened back to back
        self.positions = torch.empty(start, dtype=torch.long)
        for begin, size, position, offset in spans:
            base = position * self.width + offset
            self.positions[begin:begin + size] = torch.arange(base, base + size)

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The exchange buffer, ``parts x width``, flattened."""
        joined = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) != 1 else tensors[0].reshape(-1)
        out = joined.new_zeros(self.parts * self.width)
        return out.index_copy_(0, self.positions.to(out.device), joined)

    def unpack(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The layers from a gathered buffer (views of one new 1-D tensor, back to back)."""
        joined = buffer.index_select(0, self.positions.to(buffer.device))
        out, offset = [], 0
        for shape in self.shapes:
            out.append(joined[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
        return out

    def mine(self, segment: torch.Tensor, position: int) -> list[tuple[int, torch.Tensor]]:
        """(layer index, view of ``segment``) of each of position's pieces."""
        return [(layer, segment[offset:offset + piece.numel()].view(piece))
                for layer, offset, piece in self.pieces[position]]


def cut(shape: torch.Size, parts: int) -> list[tuple[int, int, torch.Size]]:
    """(offset, size, shape) of each of ``parts`` contiguous pieces of a layer: whole rows
    where it has at least ``parts`` rows, else as a vector; the first pieces one larger."""
    by_rows = len(shape) > 0 and shape[0] >= parts
    rows, row = (shape[0], shape.numel() // max(shape[0], 1)) if by_rows else (shape.numel(), 1)
    out, offset = [], 0
    for i in range(parts):
        count = rows // parts + (1 if i < rows % parts else 0)
        out.append((offset, count * row, torch.Size((count, *shape[1:])) if by_rows else torch.Size((count,))))
        offset += count * row
    return out


def piece_of(tensor: torch.Tensor, parts: int, position: int) -> torch.Tensor | None:
    """Position's piece of a whole layer's tensor (a copy), None where it is empty."""
    offset, size, shape = cut(tensor.shape, parts)[position]
    return tensor.reshape(-1)[offset:offset + size].view(shape).clone() if size else None


class TwoLevelReducer(CompressedReducer):
    """A :class:`~raycomp._internal.reduce.reducer.CompressedReducer` whose step crosses nodes once per piece.

    Args:
        levels: the node's group and this position's cross-node group
            (:func:`raycomp._internal.topology.node_groups`).
        plan, process_group, memory, min_compress_numel, seed, stats_every,
            profile_ratios, grad_scaler: as in :class:`~raycomp._internal.reduce.reducer.CompressedReducer`;
            ``process_group`` spans every rank (plain dense steps and control rows use it),
            and error feedback, compressors and routing live on the cross-node group, where
            the pieces are compressed. ``min_compress_numel`` applies to a piece.
    """

    def __init__(
        self, levels: Levels, plan: Plan | None = None, *, process_group: Any = None,
        memory: str | Memory = "residual", min_compress_numel: int = 1024, seed: int = 0,
        stats_every: int = 0, profile_ratios: tuple[float, ...] = (),
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__(plan, process_group=process_group, memory=memory, min_compress_numel=min_compress_numel,
                         seed=seed, stats_every=stats_every, profile_ratios=profile_ratios,
                         grad_scaler=grad_scaler)
        self.levels = levels
        self.send_group = levels.cross
        self.router = Router(levels.cross, min_compress_numel, seed)
        if isinstance(memory, str):
            self.memory = make_memory(memory, levels.cross.size)
        self.intra_ledger = WireLedger()
        self._layouts: dict[tuple, ShardLayout] = {}

    def layout(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> ShardLayout:
        key = (tuple(names), tuple(g.shape for g in grads))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = ShardLayout([g.shape for g in grads], self.levels.intra.size)
        return layout

    def start(self, names: Sequence[str], grads: Sequence[torch.Tensor], *,
              closes_step: bool = False, overwrite: bool = False,
              gather_on_wait: bool = False) -> Pending[list[torch.Tensor]]:
        """The three hops; the node's all-gather stays in flight. The node's exchange and
        the cross-node reduction are waited for here, on the caller's thread, since the
        next hop's collective must be issued from it.

        ``gather_on_wait``: leave the cross-node reduction in flight instead; the returned
        :class:`~raycomp._internal.transports.Pending`'s ``wait()`` waits for it, then issues the
        node's all-gather and waits for that too. So ``wait()`` issues a collective: call
        it on the thread that started, at the same point on every rank (a sync of local
        steps does, ``delay`` inner steps later, which then run beside the slow hop)."""
        self.begin_step()
        self.signals.watch(grads)
        control = self.signals.take(grads[0].device if grads else torch.device("cpu")) if closes_step else None
        intra, layout = self.levels.intra, self.layout(names, grads)
        send = layout.pack(grads)
        received = torch.empty_like(send)
        works = [dist.all_to_all_single(received, send, group=intra.handle, async_op=True)]
        if control is not None:  # summed over the node here, over nodes with the pieces
            works += intra.start_all_reduce(control)
        for work in works:
            work.wait()
        segment = _node_mean(received.view(intra.size, layout.width))
        mine = layout.mine(segment, intra.rank)
        flat_dense = [self.group.allreduce_bytes(g.numel() * g.element_size()) for g in grads]
        crossing = self._send(
            [names[i] for i, _ in mine], [piece for _, piece in mine], closes_step=closes_step, overwrite=True,
            control=control, dense_bytes=[flat_dense[i] * piece.numel() / grads[i].numel() for i, piece in mine],
        )

        def gather() -> tuple[Any, torch.Tensor]:
            """After the cross-node reduction: this position's means into the segment, and
            the node's all-gather of every position's, issued."""
            means = crossing.finish()
            for (_, piece), mean in zip(mine, means, strict=True):
                if mean.data_ptr() != piece.data_ptr():
                    piece.copy_(mean)
            gathered = segment.new_empty(intra.size * layout.width)
            work = dist.all_gather(list(gathered.view(intra.size, -1).unbind(0)), segment, group=intra.handle,
                                   async_op=True)  # into one buffer: the list names its rows
            self._count_intra(segment, control)
            return work, gathered

        if gather_on_wait:
            def finish_later() -> list[torch.Tensor]:
                work, gathered = gather()
                work.wait()
                return layout.unpack(gathered)

            return Pending(crossing.works, finish_later)
        for work in crossing.works:
            work.wait()
        work, gathered = gather()
        return Pending([work], lambda: layout.unpack(gathered))

    def _count_intra(self, segment: torch.Tensor, control: torch.Tensor | None) -> None:
        """The all-to-all and the all-gather each send ``L - 1`` segments; the control sum
        is an all-reduce."""
        intra = self.levels.intra
        nbytes = 2 * (intra.size - 1) * segment.numel() * segment.element_size()
        if control is not None:
            nbytes += intra.allreduce_bytes(control.numel() * control.element_size())
        self.intra_ledger.add(INTRA, nbytes)

    @property
    def place(self) -> dict[str, int]:
        """This reducer's layout (:attr:`raycomp._internal.topology.Levels.place`): its residuals are
        pieces of it, the scalable route's server residuals chunks of those."""
        return self.levels.place

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "levels": self.place, "intra_ledger": self.intra_ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume bit for bit at the same place. A merged state (``merged``:
        :mod:`raycomp._internal.train.resize`, every rank the same owed mean over whole layers) is cut
        to this rank's pieces. Any other layout (flat, other nodes x ranks) is refused: its
        residuals are other pieces, or one rank's own share of the mean."""
        if state.get("merged"):
            state = self._cut_merged(state)
        self.levels.check_place(state.get("levels"))
        super().load_state_dict(state)
        self.intra_ledger.load_state_dict(state["intra_ledger"])

    def _cut_merged(self, state: dict[str, Any]) -> dict[str, Any]:
        """A merged state at this place: each per-layer memory tensor cut to this position's
        piece (the cross-node mean of equal pieces is that piece, so the owed mean is kept);
        server residuals were folded into the memory by the merge."""
        parts, position = self.levels.intra.size, self.levels.intra.rank
        memory = {}
        for key, value in state["memory"].items():
            if key in PER_LAYER_STATE:  # what this rank holds a piece of
                pieces = {name: piece_of(t, parts, position) for name, t in value.items()}
                value = {name: p for name, p in pieces.items() if p is not None}
            memory[key] = value
        servers = {c.state_key: {} for c in self.communicators.values() if c.state_key}
        return {**state, **servers, "memory": memory, "levels": self.place,
                "intra_ledger": state.get("intra_ledger") or WireLedger().state_dict()}


def _node_mean(segments: torch.Tensor) -> torch.Tensor:
    """The mean of the node's ``L`` segments of one position, summed in fp32 at least."""
    if segments.dtype in (torch.float16, torch.bfloat16):
        return segments.float().sum(0).div_(segments.shape[0]).to(segments.dtype)
    return segments.sum(0).div_(segments.shape[0])
