"""What every GPU test shares: each compressor's parameters, comparisons, sync counting.

Imports torch and raycomp's worker code only: a GPU machine may have nothing else
(no Ray, pydantic or PyYAML).
"""

from __future__ import annotations

import io
import os
import socket
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from raycomp._internal.wire.payload import Payload
from raycomp.plan import CompressorSpec

__all__ = [
    "CUDA",
    "DTYPES",
    "PARAMS",
    "TRANSPORT_PLANS",
    "build",
    "count_syncs",
    "cpu_copy",
    "free_port",
    "payload_tensors",
    "randn",
    "rel_err",
    "same",
    "same_on_every_rank",
    "sites",
    "to_device",
]

#: the device every GPU test runs on (two gloo ranks share it)
CUDA = torch.device("cuda", 0)

#: each registered compressor's parameters in these tests (tests/test_device.py requires
#: an entry for every registered compressor: a missing one fails every CUDA test it is in)
PARAMS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "topk": {"ratio": 0.01},
    "dgc_topk": {"ratio": 0.01},
    "randomk": {"ratio": 0.1},
    "threshold": {"threshold": 1.0},
    "qsgd": {"points": 7, "bucket_size": 512},
    "terngrad": {},
    "sign": {},
    "int8": {"chunk_size": 2048},
    "int4": {"chunk_size": 2048},
    "powersgd": {"rank": 2},
    "sparseloco": {"ratio": 0.05, "chunk_size": 256},
}

#: one compressor per transport family, plus the variable-size all-gathers
TRANSPORT_PLANS = {
    "dense": "none", "allreduce-fp16": "fp16", "allreduce-randomk": "randomk",
    "allgather-topk": "topk", "allgather-var-dgc": "dgc_topk", "allgather-var-threshold": "threshold",
    "scalable-int8": "int8", "scalable-int4": "int4", "scalable-qsgd": "qsgd", "scalable-sign": "sign",
    "scalable-terngrad": "terngrad", "lowrank-powersgd": "powersgd", "allgather-sparseloco": "sparseloco",
}

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def build(name: str, params: dict[str, Any] | None = None, layer: str = "layer"):
    """A compressor of ``name`` with this module's parameters (or ``params``)."""
    return CompressorSpec.of(name, **(PARAMS[name] if params is None else params)).build(layer, 0)


def randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal numbers drawn on the CPU (the same on every machine), cast to ``dtype``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """``|x - y| / |x|`` in float64 on the CPU."""
    x, y = x.double().cpu(), y.double().cpu()
    return float(torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(x).clamp_min(1e-30))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    """'' if every tensor is bit-identical, else the worst relative difference."""
    if all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
        return ""
    return f"differ (worst relative difference {max(rel_err(x, y) for x, y in zip(a, b, strict=True)):.2e})"


def same_on_every_rank(tensors: list[torch.Tensor]) -> bool:
    """Whether every rank holds these tensors bit for bit (flattened and all-gathered)."""
    world = dist.get_world_size()
    if world == 1:
        return True
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors]).contiguous()
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], t) for t in gathered)


def payload_tensors(p: Payload) -> list[torch.Tensor]:
    """Every tensor a payload holds, its metadata's included."""
    return list(p.tensors.values()) + [v for v in p.meta.values() if isinstance(v, torch.Tensor)]


def count_syncs(fn: Callable[[], Any]) -> tuple[int, list[str]]:
    """Synchronising CUDA calls made by ``fn`` (torch's sync debug mode), and their sites.
    Without CUDA (a check tried on CPU tensors) nothing can sync: ``fn`` runs, 0 is returned."""
    if not torch.cuda.is_available():
        fn()
        return 0, []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    hits = [w for w in caught if "called a synchronizing" in str(w.message)]
    return len(hits), [f"{os.path.relpath(w.filename)}:{w.lineno}" for w in hits]


def sites(msgs: list[str]) -> str:
    """Sync sites counted per source line, torch's own lumped together."""
    counts: dict[str, int] = {}
    for m in msgs:
        if "site-packages" in m or "dist-packages" in m or "/torch/" in m:
            m = "torch"
        counts[m] = counts.get(m, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_copy(state: Any) -> Any:
    """``state`` saved and loaded with ``map_location="cpu"``, as checkpoints often are."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def to_device(state: Any, device: torch.device) -> Any:
    """``state``'s tensors (nested in dicts) moved to ``device``."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: to_device(v, device) for k, v in state.items()}
    return state
