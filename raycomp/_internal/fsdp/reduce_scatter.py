"""Compressed reduce-scatter for sharded data parallel (FSDP2, ``fully_shard``).

FSDP reduce-scatters each unit's gradients after its backward: every rank holds the whole
unsharded gradient of the unit and keeps the mean of one shard. PyTorch can only cast it to
fp16/bf16 for that (``MixedPrecisionPolicy(reduce_dtype=...)``). Here each *destination
shard* is compressed on its own, the compressed shards travel in one all-to-all, and every
rank decompresses the shards addressed to it and sums them in fp32 — the pattern of ZeRO++'s
quantized gradients (qgZ, Wang et al., ICLR 2024) and of Megatron's quantized
reduce-scatter, with two additions: any fixed-size raycomp compressor (``int8`` min-max
chunks, ``qsgd``, ``terngrad``, ``sign``, the ``bf16``/``fp16`` casts), and error feedback
for the biased ones, kept per rank over the whole unit gradient it sends::

    compensated = grad + residual                 (the unit's input to reduce-scatter)
    sent[r]     = C(compensated[r])               (r: destination rank, one row each)
    residual    = compensated - decompress(sent)  (what this rank has not sent yet)
    shard       = sum over sources s of decompress(received[s])   (/ W for the mean)

Wire, per rank and unit of ``N`` unsharded gradient elements over ``W`` ranks: ``(W-1)/W``
of the bytes of the ``W`` compressed rows (e.g. ``int8``: ``N`` bytes plus two fp32 per
2,048-element chunk), against ``(W-1)/W * 4N`` for an fp32 reduce-scatter that sends only
what it must (gloo's own ``reduce_scatter_tensor`` sends more: it is built on all-reduce).

Memory: the residual is as large as the unit's unsharded gradient (fp32), on every rank,
and exists only for compressors that use error feedback; that is the price of error
feedback under sharding (ZeRO++ keeps none). Use a cast or an unbiased quantizer to avoid it.

Use::

    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    comms = compress_fsdp(model, CompressorSpec.of("int8"))   # unit name -> comm
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

# FSDP2's comm interface (``set_custom_reduce_scatter`` takes one); torch 2.13 does not
# export it from torch.distributed.fsdp, and older torch has neither: this module needs a
# torch with ``FSDPModule.set_custom_reduce_scatter`` (the rest of raycomp does not import it)
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from raycomp._internal.wire.payload import pack, unpack_like
from raycomp.compressors import ROW_TRANSPORTS, fits_a_shard, shardable
from raycomp.plan import CompressorSpec


def check_sharded_spec(spec: CompressorSpec) -> CompressorSpec:
    """``spec`` if it can compress a reduce-scatter row, else ValueError naming it."""
    if not fits_a_shard(spec.name):
        raise ValueError(
            f"compressor: {spec.name!r} cannot compress a reduce-scatter shard (its payload "
            f"size is not fixed, or it needs a second round); allowed: {', '.join(shardable())}"
        )
    return spec


class CallObserver(Protocol):
    """What a :class:`CompressedReduceScatter` tells its owner during a call."""

    def begin_call(self, comm: CompressedReduceScatter) -> bool:
        """A call starts; returns whether :meth:`reduced` needs what was sent (statistics)."""

    def control_bytes(self, comm: CompressedReduceScatter, grads: torch.Tensor) -> torch.Tensor | None:
        """uint8 bytes to send to every rank with this call's rows, or None."""

    def received_control(self, rows: torch.Tensor) -> None:
        """Every source's control bytes (one row per source rank), after the all-to-all."""

    def reduced(self, comm: CompressedReduceScatter, grads: torch.Tensor, compensated: torch.Tensor,
                sent: torch.Tensor | None, wire: float, dense: float) -> None:
        """After the call: this rank's unit gradient (W rows), the compensated rows, what
        they decompress to (None unless error feedback or :meth:`begin_call` asked), the payload
        bytes this rank put on the wire and what an fp32 reduce-scatter would have sent."""


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter for one ``fully_shard`` unit, compressed per destination shard.

    Args:
        spec: the compressor of every row. ``none`` sends fp32 rows (all-to-all): the exact
            mean, and the byte baseline of the benchmark. Chosen per unit, so a transformer
            sharded per block gets one choice per block; :meth:`set_spec` swaps it between
            steps (the same step on every rank, like a DDP plan).
        name: the unit's module path (for seeds and state; ``""`` for the root).
        rank: this process's rank in the reduce-scatter group (seeds of random compressors
            differ per rank, as in the DDP path).
        error_feedback: keep the unsent part for the next step when the compressor is
            lossy and biased (``Compressor.error_feedback``); ``False`` turns it off.
        seed: base seed of random compressors' draws (with the unit name and the rank).
        observer: told about every call (:class:`CallObserver`): the training loop's
            :class:`raycomp._internal.fsdp.state.ShardedState` keeps the byte ledger and
            statistics there, and rides its control floats on the all-to-all.
    """

    def __init__(self, spec: CompressorSpec, name: str = "", rank: int = 0,
                 error_feedback: bool = True, seed: int = 0, observer: CallObserver | None = None) -> None:
        self.name, self.rank, self.use_error_feedback, self.seed = name, rank, error_feedback, seed
        self.observer = observer
        self.residual: torch.Tensor | None = None
        self.sent_bytes = 0.0  # this rank's bytes on the wire, whole run
        self.dense_bytes = 0.0  # what an fp32 reduce-scatter of the same inputs would send
        self.calls = 0
        self.set_spec(spec)

    def set_spec(self, spec: CompressorSpec) -> None:
        """Compress with ``spec`` from the next call on. The residual stays: it is gradient
        not yet sent, whatever compressor dropped it, and goes out with the next call (in
        full, if the new compressor keeps no residual of its own)."""
        self.spec = check_sharded_spec(spec)
        self.compressor = spec.build(f"fsdp:{self.name}", self.rank, self.seed)

    @property
    def error_feedback(self) -> bool:
        return self.use_error_feedback and self.compressor.error_feedback

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        watching = self.observer is not None and self.observer.begin_call(self)
        world = dist.get_world_size(group)
        divisor = _divisor(op, world)
        grads = input_tensor.view(world, -1).float()
        if grads.shape[1] != output_tensor.numel():
            raise ValueError(f"reduce-scatter of {self.name!r}: input of {input_tensor.numel()} "
                             f"elements is not {world} x the output's {output_tensor.numel()}")
        rows = grads
        if self.residual is not None:
            if self.residual.shape != rows.shape:
                raise ValueError(f"reduce-scatter of {self.name!r}: the unit's gradient changed "
                                 f"size ({tuple(self.residual.shape)} -> {tuple(rows.shape)})")
            rows = rows + self.residual.to(rows.device)  # compensate (a CPU-loaded checkpoint's too)
        payloads = self.compressor.compress_many(list(rows))  # compress, one per destination
        sent = (torch.stack([d.float() for d in self.compressor.decompress_many(payloads)])
                if self.error_feedback or watching else None)
        self.residual = rows - sent if self.error_feedback else None  # update memory
        send = torch.stack([pack([p]) for p in payloads])  # W rows of equal byte size
        payload_bytes = send.shape[1]
        control = self.observer.control_bytes(self, grads) if self.observer is not None else None
        if control is not None:  # the same few bytes to every destination: an all-gather inside
            send = torch.cat([send, control.to(send.device).expand(world, -1)], dim=1)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        if control is not None:
            self.observer.received_control(received[:, payload_bytes:])
        template = payloads[0]
        total = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
        from_sources = [unpack_like(received[source, :payload_bytes], [template])[0] for source in range(world)]
        for decoded in self.compressor.decompress_many(from_sources):
            total += decoded.float()
        if divisor != 1:
            total /= divisor
        output_tensor.copy_(total)
        wire, dense = (world - 1) * payload_bytes, (world - 1) * rows.shape[1] * 4
        self.sent_bytes += wire
        self.dense_bytes += dense
        self.calls += 1
        if self.observer is not None:
            self.observer.reduced(self, grads, rows, sent, wire, dense)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.to_dict(), "compressor": self.compressor.state_dict(),
                "residual": None if self.residual is None else self.residual.clone(),
                "sent_bytes": self.sent_bytes, "dense_bytes": self.dense_bytes, "calls": self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.set_spec(CompressorSpec.from_dict(state["spec"]))
        self.compressor.load_state_dict(dict(state["compressor"]))
        residual = state["residual"]
        self.residual = None if residual is None else residual.clone()
        self.sent_bytes, self.dense_bytes = float(state["sent_bytes"]), float(state["dense_bytes"])
        self.calls = int(state["calls"])


def _divisor(op: Any, world: int) -> int:
    """What FSDP's reduce op asks us to divide the sum by: SUM -> 1, AVG -> W."""
    if op == dist.ReduceOp.SUM:
        return 1
    if op == dist.ReduceOp.AVG:
        return world
    raise ValueError(f"reduce-scatter op: {op!r} is not supported; allowed: SUM, AVG "
                     "(FSDP uses PREMUL_SUM only with set_gradient_divide_factor)")


def compress_fsdp(model: torch.nn.Module, spec: CompressorSpec | Mapping[str, CompressorSpec],
                  error_feedback: bool = True) -> dict[str, CompressedReduceScatter]:
    """Install a :class:`CompressedReduceScatter` on every ``fully_shard`` unit of ``model``;
    returns them by unit name (module path, ``""`` for the root). A unit that owns no
    parameters of its own never reduce-scatters, so its comm is never called.

    ``spec``: one compressor for every unit, or a mapping unit name -> compressor (units
    not named stay dense, fp32 all-to-all). Call after ``fully_shard``, before training.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    units = {name: module for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    if not units:
        raise ValueError("model: no fully_shard unit found; apply torch.distributed.fsdp.fully_shard "
                         "to the model (and its blocks) first")
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(units))
        if unknown:
            raise ValueError(f"spec: unknown unit {unknown[0]!r}; units: {', '.join(map(repr, units))}")
    comms: dict[str, CompressedReduceScatter] = {}
    for name, module in units.items():
        chosen = spec.get(name, CompressorSpec("none")) if isinstance(spec, Mapping) else spec
        comm = CompressedReduceScatter(chosen, name=name, rank=rank, error_feedback=error_feedback)
        module.set_custom_reduce_scatter(comm)
        comms[name] = comm
    return comms


__all__ = ["CallObserver", "CompressedReduceScatter", "ROW_TRANSPORTS", "check_sharded_spec", "compress_fsdp"]
