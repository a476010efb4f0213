"""Record the collectives a process issues and what they put on the wire (test-only).

:class:`WireRecorder` is a context manager for use *inside* a worker process (after
``init_process_group``). While it is active, every call of the ``torch.distributed``
collectives listed in :data:`COLLECTIVES` is recorded as a :class:`Call`: the operation,
the dtype and element count of the tensor this rank contributes, the all-to-all split
sizes, the broadcast source and the group. The wrappers are installed on the module
attributes ``torch.distributed.<fn>`` and ``torch.distributed.distributed_c10d.<fn>``
(code that calls ``dist.all_reduce(...)`` looks the function up there at call time) and
the originals are restored on exit. Calls from every thread of the process are recorded
(the DDP hook communicates on a background thread).

Each call is converted into the bytes this rank *transmits* by :func:`transmitted_bytes`,
under the traffic model documented in ``raycomp._internal.transports`` — it depends only on the
collective, its tensor and the group size, never on what the bytes encode:

=========================  ==========================================================
all_reduce of ``B`` bytes  ``2 (W - 1) / W * B`` (ring: reduce-scatter + all-gather)
all_gather(_into_tensor)   ``(W - 1) * B``, ``B`` = this rank's input
all_to_all(_single)        the bytes addressed to the other ``W - 1`` ranks
reduce_scatter(_tensor)    the input bytes of the other ranks' shards (ring; gloo in
                           fact runs ``reduce_scatter_tensor`` as a full all-reduce)
broadcast                  ``(W - 1) * B`` on the source (flat: it sends to every
                           rank), ``0`` elsewhere
=========================  ==========================================================

A Python-level wrapper cannot see collectives issued some other way (a function imported
before the recorder started, a direct ``ProcessGroup`` call, DDP's own C++ broadcasts).
For that, :meth:`WireRecorder.unrecorded` compares the recorded calls with gloo's flight
recorder, which logs every collective the process group runs at the C++ level; it needs
:data:`FLIGHT_RECORDER_ENV` in the worker's environment before the process group is
created.
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: The collectives recorded (every one raycomp issues, and their close relatives).
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "reduce_scatter_single",  # torch >= 2.12: FSDP2's default reduce-scatter
    "all_gather_single",  # torch >= 2.12: FSDP2's default all-gather
)

#: Environment that enables gloo's flight recorder (set before ``init_process_group``).
FLIGHT_RECORDER_ENV = {"TORCH_FR_BUFFER_SIZE": "100000"}

# the flight recorder's names for a recorded op and for dtypes
_FR_OPS = {
    "all_reduce": "gloo:all_reduce",
    "all_gather": "gloo:all_gather",
    "all_gather_into_tensor": "gloo:all_gather",  # gloo's _allgather_base
    "all_to_all_single": "gloo:all_to_all",
    "all_to_all": "gloo:all_to_all",
    "broadcast": "gloo:broadcast",
    "reduce_scatter_tensor": "gloo:all_reduce",  # gloo runs it as an all-reduce
    "reduce_scatter": "gloo:reduce_scatter",
    "reduce_scatter_single": "gloo:all_reduce",  # as reduce_scatter_tensor
    "all_gather_single": "gloo:all_gather",
}
_FR_DTYPES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.uint8: "Byte",
    torch.int8: "Char",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
}


@dataclass(frozen=True)
class Call:
    """One collective call, as this rank issued it.

    Attributes:
        op: the ``torch.distributed`` function name (one of :data:`COLLECTIVES`).
        dtype: dtype of the tensor(s) this rank contributes.
        numel: elements this rank contributes (the input; for list inputs, their sum).
        element_size: bytes per element of ``dtype``.
        world_size: size of the group the call ran on.
        rank: this process's rank in that group.
        group: the group's name (``"0"`` is the default group).
        splits: all-to-all / reduce-scatter only: elements of the input addressed to each
            rank of the group, in rank order; ``None`` for other collectives.
        src_rank: broadcast only: the source's rank in the group.
    """

    op: str
    dtype: torch.dtype
    numel: int
    element_size: int
    world_size: int
    rank: int
    group: str
    splits: tuple[int, ...] | None = None
    src_rank: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor(s) this rank hands to the collective."""
        return self.numel * self.element_size

    @property
    def transmitted(self) -> float:
        """Bytes this rank puts on the wire for this call (see :func:`transmitted_bytes`)."""
        return transmitted_bytes(self)


def transmitted_bytes(call: Call) -> float:
    """The bytes ``call`` makes this rank transmit, under the documented traffic model."""
    w = call.world_size
    if w <= 1:
        return 0.0
    if call.op == "all_reduce":
        return 2 * (w - 1) / w * call.nbytes
    if call.op in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
        return float((w - 1) * call.nbytes)
    if call.op in ("all_to_all_single", "all_to_all", "reduce_scatter_tensor", "reduce_scatter",
                   "reduce_scatter_single"):
        assert call.splits is not None
        return float(sum(s for j, s in enumerate(call.splits) if j != call.rank) * call.element_size)
    if call.op == "broadcast":
        return float((w - 1) * call.nbytes) if call.rank == call.src_rank else 0.0
    raise ValueError(f"no traffic model for collective {call.op!r}")


def _group_info(group: Any) -> tuple[int, int, str]:
    pg = group if group is not None else c10d._get_default_group()
    return dist.get_world_size(pg), dist.get_rank(pg), str(getattr(pg, "group_name", pg))


def _equal_splits(numel: int, parts: int) -> tuple[int, ...]:
    return tuple([numel // parts] * parts)


def _describe(op: str, args: dict[str, Any]) -> Call:
    world, rank, name = _group_info(args.get("group"))
    splits: tuple[int, ...] | None = None
    src_rank: int | None = None
    if op in ("all_reduce", "broadcast"):
        tensor = args["tensor"]
    elif op == "all_gather":
        tensor = args["tensor"]
    elif op in ("all_gather_into_tensor", "all_gather_single"):
        tensor = args["input_tensor"]
    elif op in ("all_to_all_single", "reduce_scatter_tensor", "reduce_scatter_single"):
        tensor = args["input"]
        sizes = args.get("input_split_sizes")
        if sizes:
            row = tensor.numel() // tensor.shape[0] if tensor.dim() and tensor.shape[0] else 0
            splits = tuple(int(s) * row for s in sizes)
        else:
            splits = _equal_splits(tensor.numel(), world)
    elif op in ("all_to_all", "reduce_scatter"):
        parts = args["input_tensor_list"] if op == "all_to_all" else args["input_list"]
        tensor = parts[0]
        splits = tuple(int(t.numel()) for t in parts)
    else:
        raise ValueError(f"cannot record collective {op!r}")
    numel = sum(splits) if splits is not None else int(tensor.numel())
    if op == "broadcast":
        if args.get("group_src") is not None:
            src_rank = int(args["group_src"])
        else:
            group = args.get("group")
            src = int(args["src"])
            src_rank = src if group is None else dist.get_group_rank(group, src)
    return Call(op, tensor.dtype, numel, tensor.element_size(), world, rank, name, splits, src_rank)


class WireRecorder:
    """Records every collective of :data:`COLLECTIVES` issued while it is active.

    Use inside a process whose process group is initialised::

        with WireRecorder() as wire:
            reducer.reduce(names, grads)
        wire.calls            # [Call, ...] in issue order
        wire.transmitted      # total bytes this rank transmitted

    :meth:`mark` returns a position in ``calls`` (e.g. per training step) and
    :meth:`since` the calls after it. Re-entering an active recorder is an error.
    """

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []
        self._fr_start: int | None = None

    # --- patching -----------------------------------------------------------------
    def __enter__(self) -> WireRecorder:
        if self._saved:
            raise RuntimeError("WireRecorder is already active")
        self._fr_start = _next_record_id()
        for op in COLLECTIVES:
            original = getattr(c10d, op, None)
            if original is None:  # not in this torch
                continue
            wrapper = self._wrap(op, original)
            for module in (dist, c10d):
                if getattr(module, op, None) is original:
                    self._saved.append((module, op, original))
                    setattr(module, op, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, op, original in reversed(self._saved):
            setattr(module, op, original)
        self._saved.clear()

    def _wrap(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            call = _describe(op, bound.arguments)
            with self._lock:
                self.calls.append(call)
            return original(*args, **kwargs)

        return recorded

    # --- reading --------------------------------------------------------------------
    def mark(self) -> int:
        """A position in :attr:`calls`; pass it to :meth:`since`."""
        with self._lock:
            return len(self.calls)

    def since(self, mark: int) -> list[Call]:
        with self._lock:
            return list(self.calls[mark:])

    @property
    def transmitted(self) -> float:
        """Total bytes this rank transmitted in the recorded calls."""
        return sum(c.transmitted for c in self.since(0))

    def executed(self) -> list[tuple[str, int, str]]:
        """Every collective the process group ran since the recorder was entered, from
        gloo's flight recorder: ``(name, input elements, dtype name)`` in order."""
        if self._fr_start is None:
            raise RuntimeError("the recorder was never entered")
        return [
            (e["profiling_name"], sum(math.prod(s) for s in e["input_sizes"]),
             e["input_dtypes"][0] if e["input_dtypes"] else "")  # a barrier has no input
            for e in flight_recorder_entries()
            if e["record_id"] >= self._fr_start
        ]

    def unrecorded(self) -> list[tuple[str, int, str]]:
        """Collectives the process group ran that this recorder did not see (as
        :meth:`executed` describes them); empty when the recording is complete.

        Raises RuntimeError if the flight recorder is off (see :data:`FLIGHT_RECORDER_ENV`).
        """
        if not flight_recorder_enabled():
            raise RuntimeError(
                "gloo's flight recorder is off: set FLIGHT_RECORDER_ENV in the worker's "
                "environment before the process group is created"
            )
        missing = collections.Counter(self.executed())
        missing.subtract(collections.Counter(fr_signature(c) for c in self.since(0)))
        return sorted(missing.elements())


def fr_signature(call: Call) -> tuple[str, int, str]:
    """How the flight recorder describes ``call``: (name, input elements, dtype name)."""
    return _FR_OPS[call.op], call.numel, _FR_DTYPES.get(call.dtype, str(call.dtype))


def flight_recorder_entries() -> list[dict[str, Any]]:
    """The entries of gloo's flight recorder in this process (empty when it is off)."""
    dump = torch._C._distributed_c10d._dump_fr_trace(True, False, False)
    return list(pickle.loads(dump).get("entries", []))


def flight_recorder_enabled() -> bool:
    """Whether gloo's flight recorder was configured for this process."""
    return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) > 0


def _next_record_id() -> int:
    entries = flight_recorder_entries()
    return entries[-1]["record_id"] + 1 if entries else 0
