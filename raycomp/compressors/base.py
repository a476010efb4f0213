"""The compressor interface and the checks every compressor shares.

A compressor turns a floating-point tensor into a :class:`~raycomp._internal.wire.payload.Payload`
and back. It also declares its *transport*: how payloads from several ranks can be
combined, which decides the collective that carries them (see ``raycomp._internal.transports``).
Compressors are per layer and may hold state (warm-start factors, random draws); that
state round-trips through ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import enum
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from raycomp._internal.wire.payload import Payload
from raycomp.compressors.sparse import scatter_dense


class Transport(str, enum.Enum):
    """How payloads of one layer from all ranks are combined into the mean gradient."""

    DENSE = "dense"  # the tensor itself, all-reduced
    ALLREDUCE = "allreduce"  # payloads are summable element-wise (casts, shared-index Random-K)
    ALLGATHER = "allgather"  # sparse payloads, possibly of different sizes on each rank
    SCALABLE = "scalable"  # fixed-size quantized chunks: all-to-all, reduce, recompress, all-gather (W = 2: one all-gather)
    LOWRANK = "lowrank"  # PowerSGD: all-reduce P, orthogonalise, all-reduce Q


@dataclass(frozen=True)
class Cost:
    """What the adaptive policy needs to rank a compressor against the other candidates of
    a layer (with :meth:`Compressor.payload_bytes`; the model: ``docs/cost-model.md``).

    Args:
        near_lossless: with error feedback it keeps dense's per-step progress (quantizers,
            casts), so the policy may use it where a lossy one (low rank, sparsification)
            would cost accuracy: on critical layers, for optimizers like Adam, after a
            layer's error ran too high.
        rounds: collective rounds a plan with any layer on it adds beyond the dense
            all-reduce (latency the bytes do not show).
        rounds_at_two: the rounds at two ranks, where a transport takes a shortcut (the
            scalable transport: one all-gather); None: ``rounds``.
        family: compressors of one family share their rounds (int4 and int8 travel in one
            batch) and their measured round overhead; None: the compressor's name.
    """

    near_lossless: bool
    rounds: int
    rounds_at_two: int | None = None
    family: str | None = None


class Compressor(ABC):
    """Base class: validates input, flattens it, and defines the state protocol."""

    name: ClassVar[str]
    transport: ClassVar[Transport]
    #: E[decompress(compress(x))] == x for every x.
    unbiased: ClassVar[bool] = False
    #: Every rank must draw the same random numbers (seed shared, not per rank).
    shared_randomness: ClassVar[bool] = False
    #: The payload size depends on the values, not only on the number of elements.
    variable_size: ClassVar[bool] = False
    #: The payload keeps some elements exactly and drops the rest (DGC masks those).
    sparse: ClassVar[bool] = False
    #: Lossless (or cast-only) compressors need no error feedback.
    lossy: ClassVar[bool] = True
    #: A non-finite input element always reaches the mean (a cast keeps NaN and Inf, and
    #: the sum carries them): the reducer's step flag need not scan the layer, since the
    #: guard finds it in the reduced gradient, the same on every rank.
    carries_nonfinite: ClassVar[bool] = False
    #: The loss scale the tensors given to :meth:`compress` carry under fp16 loss scaling
    #: (a 0-d tensor; None without a ``torch.amp.GradScaler``), set by the reducer before
    #: each compression (``raycomp._internal.reduce.loss_scale``). A compressor that compares values with an
    #: absolute constant must scale the constant by it (``threshold``); one whose choices do
    #: not change when its input is multiplied by a constant (Top-K, the quantizers,
    #: PowerSGD, sign) ignores it.
    loss_scale: torch.Tensor | None = None
    #: how the adaptive policy ranks it (None: never one of its candidates)
    cost: ClassVar[Cost | None] = None
    #: One instance's :meth:`compress_many` and :meth:`decompress_many` serve every layer
    #: whose compressor has this class and the same :meth:`params` (no per-layer state):
    #: the transports then encode such layers together
    #: (:func:`raycomp.compressors.batched.compress_each`).
    batches_layers: ClassVar[bool] = False

    @property
    def error_feedback(self) -> bool:
        """Whether error feedback applies to this compressor: only lossy *biased* ones.

        Error feedback converges for contractive compressors, ``E||C(x) - x||^2 <= (1 - d)
        ||x||^2`` (Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019): Top-K,
        sign, PowerSGD, unscaled Random-K. An unbiased quantizer needs no correction (its
        error averages out), and with variance ``w > 1`` (QSGD at its defaults: w ~ 3.2)
        feeding the error back makes the residual grow geometrically: training diverges.
        """
        return self.lossy and not self.unbiased

    def compress(self, tensor: torch.Tensor) -> Payload:
        check_float_tensor(tensor)
        return self._compress(tensor.detach().reshape(-1), tensor.shape, tensor.dtype)

    @abstractmethod
    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        """Compress ``flat`` (1-D, contiguous, original dtype) of original ``shape``."""

    @abstractmethod
    def decompress(self, payload: Payload) -> torch.Tensor:
        """Rebuild a tensor of ``payload.shape`` and ``payload.dtype``."""

    def compress_many(self, tensors: Sequence[torch.Tensor]) -> list[Payload]:
        """:meth:`compress` of each tensor (a compressor that :attr:`batches_layers` does
        them together, with the same results)."""
        return [self.compress(t) for t in tensors]

    def decompress_many(self, payloads: Sequence[Payload]) -> list[torch.Tensor]:
        """:meth:`decompress` of each payload (together where :attr:`batches_layers`)."""
        return [self.decompress(p) for p in payloads]

    def sum_gathered(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """The sum of one layer's payloads from every rank, in rank order: how the all-gather
        transport (:attr:`Transport.ALLGATHER`) reduces them. By default the sparsifiers'
        (values, indices) payloads, concatenated and scatter-added together; a compressor
        whose all-gathered payload is laid out otherwise decodes it here."""
        first = payloads[0]
        merged = first.with_tensors({name: torch.cat([p.tensors[name] for p in payloads]) for name in first.tensors})
        return scatter_dense(merged)

    def accepts(self, shape: torch.Size) -> bool:
        """Whether compressing a tensor of this shape is meaningful (else it goes dense)."""
        return math.prod(shape) > 0

    def payload_bytes(self, numel: int, shape: tuple[int, ...], element_size: float) -> float:
        """The bytes of one rank's payload for a tensor of ``numel`` elements of
        ``element_size`` bytes (``shape``: its shape, or a matrix guessed from ``numel``).
        The cost model multiplies it by what the transport sends per payload byte. Needed
        by a compressor that declares a :attr:`cost`."""
        raise NotImplementedError(f"compressor {self.name!r} declares no payload size")

    def params(self) -> dict[str, Any]:
        """Constructor arguments, so a compressor can be rebuilt from a plan."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"compressor {self.name!r} holds no state, got keys {sorted(state)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


def check_float_tensor(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(
            f"tensor: dtype {tensor.dtype} is not supported; allowed: floating-point dtypes "
            "(float32, float16, bfloat16, float64)"
        )


def check_ratio(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field}: expected a number in (0, 1], got {value!r}")
    if not (0.0 < float(value) <= 1.0) or math.isnan(float(value)):
        raise ValueError(f"{field}: must be in (0, 1], got {value!r}")
    return float(value)


def check_int(field: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}: expected an integer >= {low}, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{field}: must be {allowed}, got {value!r}")
    return value


def check_positive(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{field}: expected a positive number, got {value!r}")
    if math.isinf(float(value)):
        raise ValueError(f"{field}: must be finite, got {value!r}")
    return float(value)


def mix_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SeededDraws:
    """Random numbers owned by a compressor: never the global RNG.

    Every call to :meth:`generator` returns a generator seeded from ``(seed, draw)``
    and advances ``draw``; two compressors with the same seed and draw count produce the
    same numbers on the same kind of device, which is what makes shared-index Random-K
    summable. The CPU and CUDA generators are different algorithms (Mersenne Twister,
    Philox): a CPU rank and a CUDA rank do *not* draw the same numbers, and CUDA kernels
    that draw many numbers size their grid by the GPU's multiprocessor count, so ranks on
    different GPU models may not either (see docs/gpu.md).
    """

    def __init__(self, seed: int) -> None:
        self.seed = check_int("seed", seed, 0)
        self.draws = 0
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        gen.manual_seed(mix_seed(self.seed, self.draws))
        self.draws += 1
        return gen

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.draws = int(state["draws"])


__all__ = ["Compressor", "Cost", "SeededDraws", "Transport", "check_float_tensor", "check_int", "check_positive",
           "check_ratio", "mix_seed"]
