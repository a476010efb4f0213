"""How payloads travel: one function per transport, each batching all layers it is given.

Every function takes the layers of one bucket that share a transport and returns, per
layer, a :class:`Reduced`: the mean over ranks, what *this* rank contributed (for error
feedback) and the bytes this rank put on the wire for it.

Wire bytes are what this rank *transmits* under the bandwidth-optimal algorithm of each
collective (what a NIC counter sees, framing aside), with ``W`` ranks:

* all-reduce of ``B`` bytes (ring: reduce-scatter + all-gather): ``2 (W - 1) / W * B``
* all-gather of ``B`` bytes from each rank: ``(W - 1) * B``
* all-to-all: the bytes addressed to the other ``W - 1`` ranks

The dense-equivalent of a layer is the all-reduce of its uncompressed gradient. Bytes of
size headers and padding are charged to the pseudo-layer :data:`OVERHEAD`.

No collective is ever given an empty tensor (gloo rejects them).

Every function returns a :class:`Pending`: it runs the work up to its *last* collective,
issues that one asynchronously and returns; :meth:`Pending.wait` waits for it and does the
rest (decoding, averaging). Earlier rounds (PowerSGD's P, the all-to-all of the scalable
scheme, the element counts of variable-size payloads) are waited for inside the function,
so all collectives are issued by the caller's thread, in the caller's order. The DDP hook
uses the split to compress the next bucket while this one is on the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from raycomp.compressors import Compressor
from raycomp.compressors.powersgd import PowerSGD
from raycomp.compressors.sparse import scatter_dense
from raycomp.loss_scale import rescale
from raycomp.payload import Payload, pack, unpack_like

OVERHEAD = "(overhead)"
T = TypeVar("T")
U = TypeVar("U")


@dataclass
class Reduced:
    mean: torch.Tensor  # the mean over ranks of what was sent, shaped like the input
    sent: torch.Tensor  # this rank's own contribution, decompressed
    wire_bytes: float  # bytes this rank transmitted for this layer


class Pending(Generic[T]):
    """A reduction whose last collective is in flight.

    :meth:`wait` waits for that collective (``works``) and then runs ``finish``, which
    reads its output: decoding, averaging. Call it once. Nothing in ``finish`` issues a
    collective, so it may run on another thread than the one that issued the work.
    """

    def __init__(self, works: Sequence[dist.Work], finish: Callable[[], T]) -> None:
        self.works = list(works)
        self.finish = finish

    @classmethod
    def done(cls, value: T) -> Pending[T]:
        """A result with nothing in flight (one process, or nothing to send)."""
        return cls([], lambda: value)

    def then(self, step: Callable[[T], U]) -> Pending[U]:
        """The same collective in flight, with ``step`` applied to what it finishes with."""
        return Pending(self.works, lambda: step(self.finish()))

    def wait(self) -> T:
        for work in self.works:
            work.wait()
        return self.finish()


@dataclass
class Group:
    """A process group with its size and this rank's index (``None`` = default group)."""

    handle: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.handle) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.handle) if dist.is_initialized() else 0

    def allreduce_bytes(self, nbytes: int) -> float:
        w = self.size
        return 2 * (w - 1) / w * nbytes

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        for work in self.start_all_reduce(tensor):
            work.wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out, works = self.start_all_gather(tensor)
        for work in works:
            work.wait()
        return out

    def start_all_reduce(self, tensor: torch.Tensor) -> list[dist.Work]:
        """Issue a sum all-reduce of ``tensor`` in place; its work (none: nothing to do)."""
        if self.size > 1 and tensor.numel():
            return [dist.all_reduce(tensor, group=self.handle, async_op=True)]
        return []

    def start_all_gather(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Issue an all-gather: the output tensors (filled once the work is done), the work."""
        if self.size == 1:
            return [tensor], []
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        return out, [dist.all_gather(out, tensor, group=self.handle, async_op=True)]


def dense_allreduce(
    tensors: Sequence[torch.Tensor], group: Group, *, control: torch.Tensor | None = None,
    in_place: bool = False,
) -> Pending[list[Reduced]]:
    """Plain all-reduce mean; divides before summing, as DDP does, so results match it.

    ``control`` (optional, 1-D): a few floats that ride along and are *summed* over ranks in
    place — appended, after the division, to the collective of its dtype, or all-reduced on
    their own if no tensor has that dtype. The gradients' values are unaffected by it.
    ``in_place``: the inputs may be overwritten; tensors that already lie back to back (a
    DDP bucket's gradients) are then reduced where they are, without a flattening copy.
    """
    works: list[dist.Work] = []
    flats: list[tuple[list[int], torch.Tensor]] = []
    carried: tuple[torch.Tensor, torch.Tensor] | None = None  # (control, the buffer it rides in)
    for members in _by_dtype(tensors):
        flat = flat_view([tensors[i] for i in members]) if in_place else None
        if flat is None:
            flat = torch.cat([tensors[i].reshape(-1) for i in members])
        flat.div_(group.size)
        if control is not None and flat.dtype == control.dtype and flat.device == control.device:
            carried = (control, torch.cat([flat, control]))
            flat, control = carried[1], None
        works += group.start_all_reduce(flat)
        flats.append((members, flat))
    if control is not None:  # no tensor of its dtype: a collective of its own
        works += group.start_all_reduce(control)

    def finish() -> list[Reduced]:
        if carried is not None:
            carried[0].copy_(carried[1][-carried[0].numel():])
        out: list[Reduced | None] = [None] * len(tensors)
        for members, flat in flats:
            for i, mean in zip(members, _split(flat, [tensors[i] for i in members]), strict=True):
                t = tensors[i]
                out[i] = Reduced(mean, t, group.allreduce_bytes(t.numel() * t.element_size()))
        return out  # type: ignore[return-value]

    return Pending(works, finish)


def summable_allreduce(
    tensors: Sequence[torch.Tensor], compressors: Sequence[Compressor], group: Group
) -> Pending[list[Reduced]]:
    """Payloads that add up element-wise (casts, shared-index Random-K): one all-reduce.

    Inputs are divided by the world size before compression so the sum is the mean and a
    half-precision sum cannot overflow (as torch's ``fp16_compress_hook``).
    """
    w = group.size
    payloads = [c.compress(t / w) for t, c in zip(tensors, compressors, strict=True)]
    sent = [c.decompress(p) * w for p, c in zip(payloads, compressors, strict=True)]
    wire_tensors = [t for p in payloads for t in p.tensors.values()]
    works: list[dist.Work] = []
    flats: list[tuple[list[torch.Tensor], torch.Tensor]] = []
    for indices in _by_dtype(wire_tensors):
        members = [wire_tensors[i] for i in indices]
        flat = torch.cat([t.reshape(-1) for t in members])
        works += group.start_all_reduce(flat)
        flats.append((members, flat))

    def finish() -> list[Reduced]:
        for members, flat in flats:
            for t, total in zip(members, _split(flat, members), strict=True):
                t.copy_(total)  # payload tensors now hold the sums
        return [
            Reduced(c.decompress(p), s, group.allreduce_bytes(p.nbytes))
            for p, c, s in zip(payloads, compressors, sent, strict=True)
        ]

    return Pending(works, finish)


def sparse_allgather(
    tensors: Sequence[torch.Tensor], compressors: Sequence[Compressor], group: Group
) -> Pending[tuple[list[Reduced], float]]:
    """Sparse (values, indices) payloads: all-gather, then sum by scatter-add.

    If any payload can vary in size, every rank first all-gathers the element counts of
    its payload tensors, so all ranks know every peer's layout and the padded length.
    Finishes with the per-layer results and the overhead bytes (counts, padding).
    """
    w = group.size
    payloads = [c.compress(t) for t, c in zip(tensors, compressors, strict=True)]
    sent = [c.decompress(p) for p, c in zip(payloads, compressors, strict=True)]
    gathering, overhead = _gather_payloads(payloads, compressors, group)

    def merge(per_rank: list[list[Payload]]) -> tuple[list[Reduced], float]:
        results = []
        for i, payload in enumerate(payloads):
            merged = payload.with_tensors(
                {
                    name: torch.cat([rank_payloads[i].tensors[name] for rank_payloads in per_rank])
                    for name in payload.tensors
                }
            )
            mean = scatter_dense(merged).div_(w)
            results.append(Reduced(mean, sent[i], (w - 1) * payload.nbytes))
        return results, overhead

    return gathering.then(merge)


def gathered_mean(
    tensors: Sequence[torch.Tensor], compressors: Sequence[Compressor], group: Group
) -> Pending[tuple[list[Reduced], float]]:
    """Fixed-size payloads that decode to dense tensors: one all-gather, then every rank
    decodes every rank's payload and averages them in rank order.

    Every rank sums the same decoded tensors in the same order, so every rank holds the
    same mean. Each rank sends ``(W - 1) x`` its payload; the scalable scheme sends
    ``2 (W - 1) / W x`` it, so this is the cheaper route at ``W = 2`` only, where it also
    saves a round and a second quantization. Finishes with the per-layer results and the
    overhead bytes (none: fixed sizes need neither counts nor padding).
    """
    w, me = group.size, group.rank
    payloads = [c.compress(t) for t, c in zip(tensors, compressors, strict=True)]
    gathering, overhead = _gather_payloads(payloads, compressors, group)  # fixed sizes: no overhead

    def average(per_rank: list[list[Payload]]) -> tuple[list[Reduced], float]:
        results = []
        for i, (c, t) in enumerate(zip(compressors, tensors, strict=True)):
            decoded = [c.decompress(rank_payloads[i]) for rank_payloads in per_rank]
            total = decoded[0].float()
            for d in decoded[1:]:  # rank order, the same on every rank
                total = total + d.float()  # a new tensor: decoded[me] is this rank's `sent`
            mean = (total.div_(w) if w > 1 else total).to(t.dtype).reshape(t.shape)
            results.append(Reduced(mean, decoded[me], (w - 1) * payloads[i].nbytes))
        return results, overhead

    return gathering.then(average)


def _gather_payloads(
    payloads: Sequence[Payload], compressors: Sequence[Compressor], group: Group
) -> tuple[Pending[list[list[Payload]]], float]:
    """Every rank's payloads, in rank order, through one all-gather of packed bytes.

    If any payload can vary in size, every rank first all-gathers the element counts of
    its payload tensors (waited for here), so all ranks know every peer's layout and the
    padded length. Returns the all-gather in flight, which finishes with the payloads per
    rank, and the overhead bytes (counts, padding).
    """
    w = group.size
    overhead = 0.0
    if any(c.variable_size for c in compressors):
        counts = torch.tensor(
            [t.numel() for p in payloads for t in p.tensors.values()], dtype=torch.int64,
            device=next(iter(payloads[0].tensors.values())).device,  # NCCL has no CPU tensors
        )
        peer_counts = torch.stack(group.all_gather(counts)).tolist()  # one host sync
        overhead += (w - 1) * counts.numel() * counts.element_size()
        layouts = [_layout_with_counts(payloads, pc) for pc in peer_counts]
    else:
        layouts = [list(payloads)] * w
    sizes = [sum(p.nbytes for p in layout) for layout in layouts]
    padded = max(1, max(sizes))  # never an empty buffer
    own = pack(payloads)
    buffer = own
    if own.numel() != padded:  # a peer's payload is larger (or all are empty): pad with zeros
        buffer = torch.zeros(padded, dtype=torch.uint8, device=own.device)
        buffer[: own.numel()] = own
    gathered, works = group.start_all_gather(buffer)
    overhead += (w - 1) * (padded - own.numel())

    def unpack() -> list[list[Payload]]:
        return [
            unpack_like(buf[:size], layout)
            for buf, size, layout in zip(gathered, sizes, layouts, strict=True)
        ]

    return Pending(works, unpack), overhead


def _layout_with_counts(templates: Sequence[Payload], counts: Sequence[int]) -> list[Payload]:
    it = iter(counts)
    return [
        p.with_tensors({n: t.new_empty(next(it)) for n, t in p.tensors.items()}) for p in templates
    ]


class ScalableAllreduce:
    """Compressed all-reduce whose bytes per rank do not grow with the number of ranks.

    Each layer is cut into ``W`` chunks; chunk ``j`` of every rank goes to rank ``j``
    (one all-to-all for all layers), which decompresses and averages it, recompresses the
    average with its own ("server-side") error feedback, and all-gathers it back. This is
    the scheme of 1-bit Adam (Tang et al., ICML 2021) and Bagua's ByteGrad. Requires
    fixed-size payloads and at least ``W`` elements per layer. The server residuals are
    state (one chunk per layer on each rank).

    Two ranks are the exception, by default. Each rank then sends half its payload in
    the all-to-all and half of a recompressed one in the all-gather: its whole payload's
    bytes, the same as one all-gather of the payload (``(W - 1) x`` it, which is only no
    larger at ``W = 2``). :func:`gathered_mean` does that in one round instead of two, and
    quantizes once instead of twice. On the transformer over 100 Mbit/s (int8, 3.2 MB a
    rank, two gloo processes) the two rounds took 467 ms of a training step and the one
    all-gather 419 ms (about 305 ms with nothing else running); the step fell from
    874-924 ms to 769-859 ms (docs/benchmarks/e2e-gpt-100mbit-gather.md).

    Args:
        error_feedback: keep server-side residuals (the two-round scheme only).
        gather_two_ranks: at ``W = 2``, one all-gather (:func:`gathered_mean`) instead of
            the two rounds; False forces the two-round scheme at any size (tests compare).
    """

    def __init__(self, error_feedback: bool = True, gather_two_ranks: bool = True) -> None:
        self.error_feedback = error_feedback
        self.gather_two_ranks = gather_two_ranks
        self.server_residuals: dict[str, torch.Tensor] = {}

    def __call__(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        compressors: Sequence[Compressor],
        group: Group,
    ) -> Pending[tuple[list[Reduced], float]]:
        w, me = group.size, group.rank
        if w == 2 and self.gather_two_ranks:
            return gathered_mean(tensors, compressors, group)
        chunked = [_chunks(t.reshape(-1), w) for t in tensors]
        # payloads[i][j]: layer i, chunk j, compressed here
        payloads = [[c.compress(ch) for ch in chunks] for c, chunks in zip(compressors, chunked, strict=True)]
        sent = [
            torch.cat([c.decompress(p).reshape(-1) for p in row]).reshape(t.shape)
            for row, c, t in zip(payloads, compressors, tensors, strict=True)
        ]
        to_rank = [pack([row[j] for row in payloads]) for j in range(w)]
        split_bytes = [b.numel() for b in to_rank]
        mine = [row[me] for row in payloads]
        received = torch.empty(split_bytes[me] * w, dtype=torch.uint8, device=tensors[0].device)
        if w > 1:
            dist.all_to_all_single(
                received,
                torch.cat(to_rank),
                output_split_sizes=[split_bytes[me]] * w,
                input_split_sizes=split_bytes,
                group=group.handle,
            )
        else:
            received = to_rank[0]
        from_ranks = [unpack_like(buf, mine) for buf in received.split(split_bytes[me])]

        recompressed = []
        for i, (name, comp) in enumerate(zip(names, compressors, strict=True)):
            average = sum(comp.decompress(r[i]).float() for r in from_ranks) / w
            if self.error_feedback and comp.error_feedback:
                residual = self.server_residuals.get(name)
                if residual is not None and residual.shape == average.shape:
                    average = average + residual.to(average.device)
                payload = comp.compress(average)
                self.server_residuals[name] = average - comp.decompress(payload).float()
            else:
                payload = comp.compress(average)
            recompressed.append(payload)

        padded = max(split_bytes)
        buffer = torch.zeros(padded, dtype=torch.uint8, device=received.device)
        own = pack(recompressed)
        buffer[: own.numel()] = own
        gathered, works = group.start_all_gather(buffer)
        overhead = (w - 1) * (padded - own.numel())

        def decode() -> tuple[list[Reduced], float]:
            by_chunk = [
                unpack_like(buf[: split_bytes[j]], [row[j] for row in payloads])
                for j, buf in enumerate(gathered)
            ]
            results = []
            for i, (comp, t) in enumerate(zip(compressors, tensors, strict=True)):
                mean = torch.cat([comp.decompress(by_chunk[j][i]).reshape(-1) for j in range(w)])
                sent_to_others = sum(payloads[i][j].nbytes for j in range(w) if j != me)
                wire = sent_to_others + (w - 1) * recompressed[i].nbytes
                results.append(Reduced(mean.reshape(t.shape).to(t.dtype), sent[i], wire))
            return results, overhead

        return Pending(works, decode)

    def reset(self) -> None:
        self.server_residuals.clear()

    def rescale(self, factor: torch.Tensor) -> None:
        rescale(self.server_residuals.values(), factor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.server_residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.server_residuals = {k: v.clone() for k, v in state.items()}


def lowrank_allreduce(
    tensors: Sequence[torch.Tensor], compressors: Sequence[PowerSGD], group: Group
) -> Pending[list[Reduced]]:
    """PowerSGD's two rounds for all layers at once: all-reduce every P, orthogonalise,
    all-reduce every Q (two collectives per bucket, like torch's ``powerSGD_hook``). The
    P round is waited for here; the Q round is the one in flight."""
    w = group.size
    matrices = [
        t.detach().float().reshape(c.matrix_shape(t.shape))
        for t, c in zip(tensors, compressors, strict=True)
    ]
    ps = [c.project(m) for c, m in zip(compressors, matrices, strict=True)]
    p_flat = group.all_reduce_(torch.cat([p.reshape(-1) for p in ps])).div_(w)
    p_hats = [
        c.orthogonalize(p.reshape(ref.shape).clone())
        for c, p, ref in zip(compressors, _split(p_flat, ps), ps, strict=True)
    ]
    qs = [c.back_project(m, p) for c, m, p in zip(compressors, matrices, p_hats, strict=True)]
    sent = [(p @ q.T).reshape(t.shape).to(t.dtype) for p, q, t in zip(p_hats, qs, tensors, strict=True)]
    q_flat = torch.cat([q.reshape(-1) for q in qs])
    works = group.start_all_reduce(q_flat)

    def finish() -> list[Reduced]:
        q_flat.div_(w)
        results = []
        for c, p, q, s, t in zip(compressors, p_hats, _split(q_flat, qs), sent, tensors, strict=True):
            c.remember(q)
            wire = group.allreduce_bytes((p.numel() + q.numel()) * 4)
            results.append(Reduced((p @ q.T).reshape(t.shape).to(t.dtype), s, wire))
        return results

    return Pending(works, finish)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, groups in order of first appearance.

    One collective per group, issued in this order: it depends only on the order and dtypes
    of the tensors, so it is the same on every rank. (Iterating a ``set`` of dtypes is not:
    dtype hashes differ between processes, and ranks would then all-reduce different
    buffers against each other.)
    """
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _chunks(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``parts`` contiguous near-equal pieces (sizes differ by at most one)."""
    base, extra = divmod(flat.numel(), parts)
    return list(flat.split([base + (1 if j < extra else 0) for j in range(parts)]))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (control floats) on ``device`` without a host sync: on CUDA
    through pinned memory, asynchronously, ordered on the current stream."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def flat_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D view of the storage that holds ``tensors`` back to back, in order and
    contiguous (a DDP bucket's gradients, or their means split from one buffer); None if
    they do not lie so."""
    if not tensors:
        return None
    first = tensors[0]
    storage, end = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != end
                or t.untyped_storage().data_ptr() != storage):
            return None
        end += t.numel()
    return first.as_strided((end - first.storage_offset(),), (1,), first.storage_offset())


def _split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out
