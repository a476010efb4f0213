"""One collective order on every rank, whatever each process's hashing does.

Each run is a fresh pair of gloo processes with a different ``PYTHONHASHSEED`` per rank (and
different object addresses, hence different ``torch.dtype`` hashes). Gradients mix fp32,
bf16 and fp16, and the plan mixes transports (dense, casts, shared-index Random-K, Top-K,
PowerSGD, sign). Every rank must get bit-identical means, and the dense means must be
exactly right. With the order derived from a set of dtypes (the bug this guards against),
ranks all-reduced different buffers against each other: wrong means or a gloo abort.

``RAYCOMP_ORDER_RUNS`` sets the number of fresh pairs (default 6; 50 for the full check,
see docs/testing.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp.plan import CompressorSpec, Plan
from tests.distributed import run_distributed

RUNS = int(os.environ.get("RAYCOMP_ORDER_RUNS", "6"))

# (name, shape, dtype, compressor or None for the plan default = dense)
LAYERS = [
    ("a.weight", (64, 48), torch.float32, CompressorSpec.of("fp16")),
    ("a.norm", (2048,), torch.bfloat16, None),
    ("b.weight", (48, 64), torch.bfloat16, CompressorSpec.of("powersgd", rank=2)),
    ("b.bias", (4096,), torch.float16, CompressorSpec.of("randomk", ratio=0.1)),
    ("c.weight", (96, 32), torch.float32, CompressorSpec.of("topk", ratio=0.05)),
    ("c.scale", (3000,), torch.float32, None),
    ("d.weight", (32, 96), torch.float16, CompressorSpec.of("bf16")),
    ("e.weight", (40, 40), torch.float32, CompressorSpec.of("sign")),
]


def _grads(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=gen).to(dtype) for _, shape, dtype, _ in LAYERS]


def _reduce_mixed(rank: int, world_size: int) -> dict:
    names = [name for name, *_ in LAYERS]
    # dense plan: the exact mean is known (constants are exact in every dtype)
    dense = CompressedReducer(min_compress_numel=1)
    constants = [torch.full(shape, float((rank + 1) * (i + 1)), dtype=dtype)
                 for i, (_, shape, dtype, _) in enumerate(LAYERS)]
    dense_means = dense.reduce(names, constants)
    dense.end_step()
    # mixed transports, two steps (the second with error feedback in play)
    plan = Plan.per_layer({name: spec for name, _, _, spec in LAYERS if spec is not None})
    mixed = CompressedReducer(plan, min_compress_numel=1, seed=3)
    steps = []
    for _ in range(2):
        steps.append(mixed.reduce(names, _grads(rank)))
        mixed.end_step()
    return {"dense": dense_means, "mixed": steps, "wire": mixed.ledger.wire_total}


@pytest.mark.parametrize("run", range(RUNS))
def test_mixed_dtypes_and_transports_agree_on_every_rank(run):
    seeds = {0: str(17 + 2 * run), 1: str(9001 + 7 * run)}
    per_rank = run_distributed(
        _reduce_mixed, 2, timeout=90, pg_timeout_s=30,
        env_per_rank=lambda rank: {"PYTHONHASHSEED": seeds[rank]},
    )
    first, second = per_rank
    for i, (name, _, dtype, _) in enumerate(LAYERS):
        expected = torch.full_like(first["dense"][i], 1.5 * (i + 1))
        for r, result in enumerate(per_rank):
            assert result["dense"][i].dtype == dtype, name
            assert torch.equal(result["dense"][i], expected), (
                f"run {run}, rank {r}, dense {name}: mean {result['dense'][i].flatten()[0]} "
                f"!= {1.5 * (i + 1)}"
            )
    for step, (a, b) in enumerate(zip(first["mixed"], second["mixed"], strict=True)):
        for (name, *_), x, y in zip(LAYERS, a, b, strict=True):
            assert torch.equal(x, y), f"run {run}, step {step}, {name}: ranks got different means"
            assert torch.isfinite(x.float()).all()
    assert first["wire"] == second["wire"]
