"""Compressors (raycomp.compressors) and their wire payloads (raycomp._internal.wire.payload).

Everything is single-process and deterministic: compressors draw their random numbers
from their own seeded generators, and test data comes from seeded generators too.
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

from raycomp._internal.wire.bitpack import unpack_bits
from raycomp._internal.wire.payload import Payload, pack, unpack_like
from raycomp.compressors import (
    COMPRESSORS,
    Compressor,
    PowerSGD,
    compressor_parameters,
    make_compressor,
)
from raycomp.compressors.minmax import MinMaxInt4
from raycomp.plan import CompressorSpec

NAMES = sorted(COMPRESSORS)
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(1000,), (64, 33), (8, 4, 3, 3)]
STATEFUL = ["powersgd", "randomk", "dgc_topk", "qsgd", "terngrad"]


def randn(
    shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def assert_payloads_equal(a: Payload, b: Payload) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype, name
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.meta.keys() == b.meta.keys()
    for key, value in a.meta.items():
        other = b.meta[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def round_trip(compressor: Compressor, x: torch.Tensor) -> torch.Tensor:
    return compressor.decompress(compressor.compress(x))


# --- registry -------------------------------------------------------------------------


def test_registry_names() -> None:
    assert set(COMPRESSORS) == {
        "none", "fp16", "bf16", "topk", "dgc_topk", "randomk", "threshold",
        "qsgd", "terngrad", "sign", "int8", "int4", "powersgd", "sparseloco",
    }  # fmt: skip
    for name, cls in COMPRESSORS.items():
        assert cls.name == name
        assert isinstance(make_compressor(name), cls)


@pytest.mark.parametrize("name", NAMES)
def test_params_rebuild_an_equal_compressor(name: str) -> None:
    compressor = make_compressor(name)
    assert set(compressor.params()) == set(compressor_parameters(name))
    rebuilt = make_compressor(name, **compressor.params())
    assert rebuilt.params() == compressor.params()
    assert repr(rebuilt) == repr(compressor)


# --- shape, dtype, values ---------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_keeps_shape_and_dtype(name: str, dtype: torch.dtype, shape: tuple) -> None:
    compressor = make_compressor(name)
    x = randn(shape, seed=1, dtype=dtype)
    payload = compressor.compress(x)
    assert payload.shape == x.shape and payload.dtype == dtype
    assert payload.numel == x.numel()
    assert payload.dense_nbytes == x.numel() * x.element_size()
    y = compressor.decompress(payload)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    assert torch.equal(x, randn(shape, seed=1, dtype=dtype)), "compress modified its input"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_all_zero_input_gives_all_zero_output(name: str, dtype: torch.dtype) -> None:
    compressor = make_compressor(name)
    for shape in [(1000,), (64, 33)]:
        for _ in range(2):  # twice: stateful compressors must stay sane after a zero step
            y = round_trip(compressor, torch.zeros(shape, dtype=dtype))
            assert torch.isfinite(y).all(), f"{name} produced non-finite values for zeros"
            assert (y == 0).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dense_and_casts_values(dtype: torch.dtype) -> None:
    x = randn((64, 33), seed=2, dtype=dtype)
    assert torch.equal(round_trip(make_compressor("none"), x), x)
    for name, wire in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        compressor = make_compressor(name)
        assert compressor.compress(x).tensors["values"].dtype == wire
        assert torch.equal(round_trip(compressor, x), x.to(wire).to(dtype))


# not dgc_topk: its sampled threshold may drop up to `tolerance` of k even at ratio 1 (documented)
@pytest.mark.parametrize("name", ["topk", "randomk"])
def test_sparsifiers_with_ratio_one_are_lossless(name: str) -> None:
    x = randn((64, 33), seed=3)
    assert torch.equal(round_trip(make_compressor(name, ratio=1.0), x), x)


def test_sparse_values_are_the_input_values() -> None:
    x = randn((2000,), seed=4)
    for compressor in (
        make_compressor("topk", ratio=0.05),
        make_compressor("threshold", threshold=1.0),
    ):
        y = round_trip(compressor, x)
        kept = y != 0
        assert torch.equal(y[kept], x[kept])
    y = round_trip(make_compressor("threshold", threshold=1.0), x)
    assert torch.equal(y != 0, x.abs() >= 1.0)


@pytest.mark.parametrize(("name", "steps"), [("int8", 255), ("int4", 15)])
@pytest.mark.parametrize("chunk_size", [8, 100, 2048])
def test_minmax_error_is_at_most_half_a_step_per_chunk(name: str, steps: int, chunk_size: int) -> None:
    x = randn((1000,), seed=5) * torch.linspace(0.01, 10, 1000)  # chunks of different ranges
    y = round_trip(make_compressor(name, chunk_size=chunk_size), x)
    for start in range(0, 1000, chunk_size):
        chunk, approx = x[start : start + chunk_size], y[start : start + chunk_size]
        step = (chunk.max() - chunk.min()) / steps
        assert (chunk - approx).abs().max() <= step / 2 * (1 + 1e-4) + 1e-6
        assert approx.min() >= chunk.min() - 1e-6 and approx.max() <= chunk.max() + 1e-5


@pytest.mark.parametrize(("name", "bits"), [("int8", 8), ("int4", 4)])
@pytest.mark.parametrize(("n", "chunk_size"), [(600_001, 2048), (600_001, 9), (9, 9), (7, 8)])
def test_minmax_bytes_hold_each_elements_nearest_code(name: str, bits: int, n: int, chunk_size: int) -> None:
    # several cache-sized encoding blocks, an odd count, odd chunks: every code lands where
    # the bit layout (raycomp._internal.wire.bitpack) puts it, and the codes past the last element are zeros
    x = randn((n,), seed=11) * torch.linspace(0.01, 10, n)
    payload = make_compressor(name, chunk_size=chunk_size).compress(x)
    packed = payload.tensors["codes"]
    codes = unpack_bits(packed, bits, packed.numel() * (8 // bits)).float()
    padded = torch.cat([x, x[-1:].expand((-n) % chunk_size)]).view(-1, chunk_size)
    low, high = padded.amin(1, keepdim=True), padded.amax(1, keepdim=True)
    exact = ((padded - low) / (high - low) * (2**bits - 1)).reshape(-1)[:n]
    assert (codes[:n] - exact).abs().max() <= 0.5 + 1e-3
    assert not codes[n:].any()
    assert torch.equal(payload.tensors["bounds"], torch.cat([low, high], dim=1))


def test_terngrad_and_sign_value_sets() -> None:
    x = randn((1000,), seed=6)
    y = round_trip(make_compressor("terngrad"), x)
    scale = x.abs().max()
    assert set(y.unique().tolist()) <= {-scale.item(), 0.0, scale.item()}
    assert ((y == 0) | (torch.sign(y) == torch.sign(x))).all()
    y = round_trip(make_compressor("sign"), x)
    scale = x.abs().mean()
    torch.testing.assert_close(y, torch.where(x >= 0, scale, -scale))


@pytest.mark.parametrize("points", [1, 7, 127])
def test_qsgd_values_are_points_of_the_bucket_norm(points: int) -> None:
    x = randn((300,), seed=7)
    bucket = 100
    y = round_trip(make_compressor("qsgd", points=points, bucket_size=bucket), x)
    for start in range(0, 300, bucket):
        norm = torch.linalg.vector_norm(x[start : start + bucket])
        multiples = y[start : start + bucket] / (norm / points)
        torch.testing.assert_close(multiples, multiples.round(), rtol=0, atol=1e-3)
        # |x| lies between the point below and the point above: never further than one apart
        assert (
            (x[start : start + bucket] - y[start : start + bucket]).abs() <= norm / points + 1e-5
        ).all()
        assert (
            (y[start : start + bucket] == 0)
            | (torch.sign(y[start : start + bucket]) == torch.sign(x[start : start + bucket]))
        ).all()


# --- exact wire sizes -----------------------------------------------------------------


def _k(ratio: float, n: int) -> int:
    return max(1, min(n, math.ceil(ratio * n)))


def _wire_cases() -> list[tuple[str, dict[str, Any], tuple, torch.dtype, Any]]:
    cases: list[tuple[str, dict[str, Any], tuple, torch.dtype, Any]] = []
    for shape in SHAPES:
        n = numel(shape)
        cases += [
            ("none", {}, shape, torch.float32, lambda x: 4 * x.numel()),
            ("none", {}, shape, torch.bfloat16, lambda x: 2 * x.numel()),
            ("fp16", {}, shape, torch.float32, lambda x: 2 * x.numel()),
            ("fp16", {}, shape, torch.float64, lambda x: 2 * x.numel()),
            ("bf16", {}, shape, torch.float32, lambda x: 2 * x.numel()),
            ("terngrad", {}, shape, torch.float32, lambda x: math.ceil(x.numel() / 4) + 4),
            ("sign", {}, shape, torch.float32, lambda x: math.ceil(x.numel() / 8) + 4),
            ("sign", {}, shape, torch.float16, lambda x: math.ceil(x.numel() / 8) + 4),
            (
                "threshold",
                {"threshold": 0.5},
                shape,
                torch.float32,
                lambda x: int((x.abs() >= 0.5).sum()) * (4 + 4),
            ),
        ]
        for ratio in (0.01, 0.1, 0.37, 1.0):
            k = _k(ratio, n)
            cases += [
                ("topk", {"ratio": ratio}, shape, torch.float32, lambda x, k=k: k * (4 + 4)),
                ("topk", {"ratio": ratio}, shape, torch.bfloat16, lambda x, k=k: k * (2 + 4)),
                ("randomk", {"ratio": ratio}, shape, torch.float32, lambda x, k=k: 4 * k),
                (
                    "randomk",
                    {"ratio": ratio, "scale": True},
                    shape,
                    torch.float32,
                    lambda x, k=k: 4 * k,
                ),
                ("randomk", {"ratio": ratio}, shape, torch.bfloat16, lambda x, k=k: 2 * k),
            ]
        for points, bits in ((1, 2), (2, 4), (7, 4), (8, 8), (127, 8)):
            for bucket in (512, 64, 100):
                expected = math.ceil(n * bits / 8) + 4 * math.ceil(n / bucket)
                params = {"points": points, "bucket_size": bucket}
                cases.append(("qsgd", params, shape, torch.float32, lambda x, e=expected: e))
        for chunk in (2048, 100, 8):
            expected = n + 8 * math.ceil(n / chunk)
            cases.append(
                ("int8", {"chunk_size": chunk}, shape, torch.float32, lambda x, e=expected: e)
            )
            expected = math.ceil(n / 2) + 8 * math.ceil(n / chunk)  # two 4-bit codes a byte
            cases.append(
                ("int4", {"chunk_size": chunk}, shape, torch.float32, lambda x, e=expected: e)
            )
        if len(shape) > 1:
            a, rest = shape[0], numel(shape[1:])
            for rank in (1, 4, 50):
                expected = 4 * (a + rest) * min(rank, a, rest)
                params = {"rank": rank}
                cases.append(("powersgd", params, shape, torch.float32, lambda x, e=expected: e))
                cases.append(("powersgd", params, shape, torch.bfloat16, lambda x, e=expected: e))
    return cases


WIRE_CASES = _wire_cases()


@pytest.mark.parametrize(
    ("name", "params", "shape", "dtype", "expected"),
    WIRE_CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}".replace(" ", "") for c in WIRE_CASES],
)
def test_wire_bytes_match_formula(
    name: str, params: dict, shape: tuple, dtype: torch.dtype, expected: Any
) -> None:
    x = randn(shape, seed=8, dtype=dtype)
    payload = make_compressor(name, **params).compress(x)
    # the tensors that would travel, counted from the tensors themselves, against the
    # documented size; then nbytes and the packed buffer must agree with them
    on_wire = sum(t.numel() * t.element_size() for t in payload.tensors.values())
    assert on_wire == expected(x)
    assert payload.nbytes == on_wire
    assert pack([payload]).numel() == on_wire


# (dtype, elements) of every wire tensor for concrete shapes, worked out by hand from the
# "Wire:" line of each docstring
HAND_COMPUTED = [
    ("sign", {}, (64, 33), {"bits": (torch.uint8, 264), "scale": (torch.float32, 1)}),  # 2112 / 8
    ("terngrad", {}, (1000,), {"codes": (torch.uint8, 250), "scale": (torch.float32, 1)}),  # 1000 / 4
    # 7 points -> 15 codes -> 4 bits: 1000 * 4 / 8 = 500 bytes; buckets of 512 -> 2 norms
    ("qsgd", {"points": 7, "bucket_size": 512}, (1000,), {"codes": (torch.uint8, 500), "norms": (torch.float32, 2)}),
    ("qsgd", {"points": 1, "bucket_size": 100}, (64, 33), {"codes": (torch.uint8, 528), "norms": (torch.float32, 22)}),
    # 2112 codes, ceil(2112 / 256) = 9 chunks of (min, max)
    ("int8", {"chunk_size": 256}, (64, 33), {"codes": (torch.uint8, 2112), "bounds": (torch.float32, 18)}),
    # 1001 codes, two a byte -> 501 bytes; ceil(1001 / 100) = 11 chunks of (min, max)
    ("int4", {"chunk_size": 100}, (1001,), {"codes": (torch.uint8, 501), "bounds": (torch.float32, 22)}),
    ("topk", {"ratio": 0.01}, (64, 33), {"values": (torch.float32, 22), "indices": (torch.int32, 22)}),
    ("dgc_topk", {"ratio": 0.5}, (1000,), {"values": (torch.float32, 500), "indices": (torch.int32, 500)}),
    ("randomk", {"ratio": 0.1}, (1000,), {"values": (torch.float32, 100)}),  # indices stay local
    ("fp16", {}, (8, 4, 3, 3), {"values": (torch.float16, 288)}),
    ("bf16", {}, (8, 4, 3, 3), {"values": (torch.bfloat16, 288)}),
    ("none", {}, (1000,), {"values": (torch.float32, 1000)}),
    ("powersgd", {"rank": 2}, (64, 33), {"p": (torch.float32, 128), "q": (torch.float32, 66)}),
]


@pytest.mark.parametrize(("name", "params", "shape", "tensors"), HAND_COMPUTED, ids=[c[0] for c in HAND_COMPUTED])
def test_wire_tensors_hand_computed(name: str, params: dict, shape: tuple, tensors: dict) -> None:
    payload = make_compressor(name, **params).compress(randn(shape, seed=12))
    assert {k: (t.dtype, t.numel()) for k, t in payload.tensors.items()} == tensors


def test_sparse_payload_layout() -> None:
    x = randn((1000,), seed=9, dtype=torch.bfloat16)
    topk = make_compressor("topk", ratio=0.1).compress(x)
    assert topk.tensors["values"].dtype == torch.bfloat16  # values keep the input dtype
    assert topk.tensors["indices"].dtype == torch.int32
    randomk = make_compressor("randomk", ratio=0.1).compress(x)
    assert set(randomk.tensors) == {"values"}  # indices are regenerated, never sent
    assert randomk.meta["indices"].numel() == 100


# --- Top-K ------------------------------------------------------------------------------


def _distinct_magnitudes(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.randperm(n, generator=gen).float() + 1
    signs = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    return magnitudes * signs


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.5])
def test_topk_picks_exactly_the_largest_magnitudes(ratio: float) -> None:
    x = _distinct_magnitudes(10_000, seed=10).reshape(100, 100)
    payload = make_compressor("topk", ratio=ratio).compress(x)
    k = _k(ratio, x.numel())
    indices = payload.tensors["indices"].long()
    expected = torch.argsort(x.reshape(-1).abs(), descending=True)[:k]
    assert set(indices.tolist()) == set(expected.tolist())
    assert torch.equal(payload.tensors["values"], x.reshape(-1)[indices])


@pytest.mark.parametrize(
    ("ratio", "tolerance", "max_retries", "seed"),
    [
        (0.01, 0.1, 3, 0),
        (0.01, 0.1, 3, 1),
        (0.001, 0.1, 3, 2),
        (0.01, 0.001, 3, 3),
        (0.01, 0.001, 0, 4),
    ],
)
def test_dgc_topk_keeps_a_top_set_of_nearly_k(
    ratio: float, tolerance: float, max_retries: int, seed: int
) -> None:
    n = 1_000_000
    x = randn((n,), seed=100 + seed)  # continuous: no ties among magnitudes
    compressor = make_compressor(
        "dgc_topk", ratio=ratio, tolerance=tolerance, max_retries=max_retries, seed=seed
    )
    k = _k(ratio, n)
    order = torch.argsort(x.abs(), descending=True)
    for _ in range(2):
        indices = compressor.compress(x).tensors["indices"].long()
        kept = indices.numel()
        assert (1 - tolerance) * k <= kept <= k
        assert indices.unique().numel() == kept
        # the kept set is exactly the `kept` largest magnitudes: nothing smaller sneaks in
        assert set(indices.tolist()) == set(order[:kept].tolist())


def test_dgc_topk_small_tensor_is_exact_topk() -> None:
    x = _distinct_magnitudes(300, seed=11)
    indices = make_compressor("dgc_topk", ratio=0.1).compress(x).tensors["indices"]
    assert set(indices.tolist()) == set(torch.argsort(x.abs(), descending=True)[:30].tolist())


# --- unbiasedness -----------------------------------------------------------------------


def _unbiasedness_violations(compressor: Compressor, x: torch.Tensor, draws: int) -> int:
    """Elements whose mean over ``draws`` decompressions is not within noise of ``x``.

    Per element the tolerance is 5 standard errors of the empirical mean (for M=2000 the
    mean is near-normal; P(|z|>5) ~ 6e-7) plus 10 * (largest decompressed magnitude) / M,
    which covers elements whose rounding probability is so small that a run of M draws
    may never round them (then the empirical std is 0 while the bias is at most p * step
    with p <~ 10 / M). A biased compressor is off by O(|x|), far above both terms.
    """
    samples = torch.stack([compressor.decompress(compressor.compress(x)) for _ in range(draws)])
    samples = samples.double()
    mean, std = samples.mean(0), samples.std(0)
    tolerance = 5 * std / math.sqrt(draws) + 10 * samples.abs().max() / draws
    return int(((mean - x.double()).abs() > tolerance).sum())


def _bounded_away_from_zero(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.rand(n, generator=gen) * 0.5 + 0.5
    return magnitudes * (torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1)


UNBIASED_CASES = [
    ("none", {}),
    ("qsgd", {}),
    ("qsgd", {"points": 1, "bucket_size": 64}),
    ("qsgd", {"points": 127, "bucket_size": 64, "seed": 3}),
    ("terngrad", {}),
    ("randomk", {"ratio": 0.25, "scale": True}),
    ("randomk", {"ratio": 0.05, "scale": True, "seed": 5}),
]


@pytest.mark.parametrize(("name", "params"), UNBIASED_CASES, ids=str)
def test_unbiased_compressors_are_unbiased(name: str, params: dict) -> None:
    compressor = make_compressor(name, **params)
    assert compressor.unbiased
    x = _bounded_away_from_zero(256, seed=12)
    assert _unbiasedness_violations(compressor, x, draws=2000) == 0


@pytest.mark.parametrize(
    ("name", "params"), [("sign", {}), ("topk", {"ratio": 0.25}), ("randomk", {"ratio": 0.25})]
)
def test_unbiasedness_check_catches_biased_compressors(name: str, params: dict) -> None:
    # negative control: the same check must flag a biased compressor on most elements
    compressor = make_compressor(name, **params)
    assert not compressor.unbiased
    x = _bounded_away_from_zero(256, seed=12)
    assert _unbiasedness_violations(compressor, x, draws=2000) > 256 // 2


def test_unbiased_flag_is_declared_where_expected() -> None:
    declared = {name for name in NAMES if make_compressor(name).unbiased}
    assert declared == {"none", "qsgd", "terngrad"}  # randomk only with scale=True
    assert make_compressor("randomk", scale=True).unbiased


# --- Random-K shared randomness ---------------------------------------------------------


def test_randomk_indices_shared_by_seed_and_fresh_per_call() -> None:
    ranks = [make_compressor("randomk", ratio=0.1, seed=7) for _ in range(2)]
    other_seed = make_compressor("randomk", ratio=0.1, seed=8)
    previous: list[torch.Tensor] = []
    for step in range(4):
        # each "rank" compresses its own gradient; the indices must agree anyway
        indices = [
            c.compress(randn((1000,), seed=step * 10 + r)).meta["indices"]
            for r, c in enumerate(ranks)
        ]
        assert torch.equal(indices[0], indices[1])
        assert indices[0].unique().numel() == 100  # sampled without replacement
        assert not torch.equal(other_seed.compress(randn((1000,))).meta["indices"], indices[0])
        for earlier in previous:
            assert not torch.equal(earlier, indices[0])
        previous.append(indices[0])


def test_randomk_values_and_scale() -> None:
    x = randn((1000,), seed=13)
    plain = make_compressor("randomk", ratio=0.1, seed=1).compress(x)
    scaled = make_compressor("randomk", ratio=0.1, scale=True, seed=1).compress(x)
    indices = plain.meta["indices"]
    assert torch.equal(plain.tensors["values"], x[indices])
    torch.testing.assert_close(scaled.tensors["values"], x[indices] * 10)
    y = make_compressor("randomk", ratio=0.1).decompress(plain)
    assert torch.equal(y[indices], x[indices])
    assert int((y != 0).sum()) == 100


@pytest.mark.parametrize("name", NAMES)
def test_compress_leaves_global_rng_untouched(name: str) -> None:
    compressor = make_compressor(name)
    x = randn((64, 33), seed=14)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    for _ in range(2):
        round_trip(compressor, x)
    assert torch.equal(torch.get_rng_state(), before)


# --- state round trip -------------------------------------------------------------------


STATE_PARAMS = {
    "powersgd": {"rank": 2},
    "randomk": {"ratio": 0.1},
    "dgc_topk": {"ratio": 0.01},
    "qsgd": {"points": 7, "bucket_size": 128},
    "terngrad": {},
}


def _through_checkpoint(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", STATEFUL)
def test_state_round_trip_reproduces_next_payload(name: str) -> None:
    params = STATE_PARAMS[name]
    shape = (100_000,) if name == "dgc_topk" else (64, 33)  # dgc samples only on big tensors
    original = make_compressor(name, **params)
    for step in range(3):
        original.compress(randn(shape, seed=20 + step))
    restored = make_compressor(name, **params)
    restored.load_state_dict(_through_checkpoint(original.state_dict()))
    assert _through_checkpoint(restored.state_dict()).keys() == original.state_dict().keys()

    fresh = make_compressor(name, **params)
    fresh_payload = fresh.compress(randn(shape, seed=30))
    for step in range(2):
        x = randn(shape, seed=30 + step)
        expected = original.compress(x)
        assert_payloads_equal(restored.compress(x), expected)
    if name != "dgc_topk":  # dgc's exact top-k payload rarely depends on the random sample
        with pytest.raises(AssertionError):
            assert_payloads_equal(fresh_payload, original.compress(randn(shape, seed=30)))


@pytest.mark.parametrize("name", STATEFUL)
def test_state_dict_is_a_snapshot(name: str) -> None:
    compressor = make_compressor(name, **STATE_PARAMS[name])
    shape = (100_000,) if name == "dgc_topk" else (64, 33)
    compressor.compress(randn(shape, seed=1))
    state = compressor.state_dict()
    frozen = _through_checkpoint(state)
    compressor.compress(randn(shape, seed=2))
    assert str(state) == str(frozen)  # later steps do not mutate a taken state dict
    assert str(compressor.state_dict()) != str(frozen)


@pytest.mark.parametrize("name", sorted(set(NAMES) - set(STATEFUL)))
def test_stateless_compressors_reject_state(name: str) -> None:
    compressor = make_compressor(name)
    assert compressor.state_dict() == {}
    compressor.load_state_dict({})
    with pytest.raises(ValueError, match=rf"compressor {name!r} holds no state"):
        compressor.load_state_dict({"q": torch.zeros(1)})


# --- PowerSGD -----------------------------------------------------------------------------


def test_powersgd_orthogonalize_zero_column_stays_zero() -> None:
    compressor = PowerSGD(rank=3)
    p = randn((20, 3), seed=40)
    p[:, 1] = 0
    out = compressor.orthogonalize(p.clone())
    assert torch.isfinite(out).all()
    assert (out[:, 1] == 0).all()
    kept = out[:, [0, 2]]
    torch.testing.assert_close(kept.T @ kept, torch.eye(2), atol=1e-5, rtol=0)


def test_powersgd_orthogonalize_all_zero_and_tiny() -> None:
    compressor = PowerSGD(rank=2)
    assert (compressor.orthogonalize(torch.zeros(10, 2)) == 0).all()
    tiny = torch.full((10, 2), 1e-12)  # below epsilon: zeroed, not divided by ~0
    out = compressor.orthogonalize(tiny)
    assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize(("rows", "rank"), [(50, 1), (50, 4), (200, 16)])
def test_powersgd_orthogonalize_gives_orthonormal_columns(rows: int, rank: int) -> None:
    p = randn((rows, rank), seed=41)
    out = PowerSGD(rank=rank).orthogonalize(p.clone())
    torch.testing.assert_close(out.T @ out, torch.eye(rank), atol=1e-5, rtol=0)
    # same column space: each column of P is a combination of the orthonormal columns
    torch.testing.assert_close(out @ (out.T @ p), p, atol=1e-4, rtol=1e-4)


def test_powersgd_orthogonalize_dependent_columns() -> None:
    # column 1 is a multiple of column 0 and column 3 a combination of 0 and 2: after
    # Gram-Schmidt their residuals are rounding noise, which must not come back as a unit
    # column that overlaps the earlier ones
    p = randn((30, 4), seed=48)
    p[:, 1] = 3 * p[:, 0]
    p[:, 3] = p[:, 0] - 2 * p[:, 2]
    out = PowerSGD(rank=4).orthogonalize(p.clone())
    assert torch.isfinite(out).all()
    gram = out.T @ out
    torch.testing.assert_close(
        gram - torch.diag(gram.diagonal()), torch.zeros(4, 4), atol=1e-5, rtol=0
    )
    assert all(abs(d) < 1e-5 or abs(d - 1) < 1e-5 for d in gram.diagonal().tolist())
    torch.testing.assert_close(out[:, [0, 2]].T @ out[:, [0, 2]], torch.eye(2), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("true_rank", "rank"), [(1, 2), (1, 4), (2, 3)])
def test_powersgd_rank_deficient_gradient_is_reconstructed(true_rank: int, rank: int) -> None:
    # e.g. a linear layer's gradient from a single sample is an outer product (rank 1)
    m = randn((40, true_rank), seed=49) @ randn((true_rank, 25), seed=50)
    compressor = PowerSGD(rank=rank)
    for _ in range(4):
        payload = compressor.compress(m)
        y = compressor.decompress(payload)
        torch.testing.assert_close(y, m, atol=1e-4, rtol=1e-4)
        p = payload.tensors["p"]
        gram = p.T @ p
        torch.testing.assert_close(
            gram - torch.diag(gram.diagonal()), torch.zeros(rank, rank), atol=1e-5, rtol=0
        )


def test_powersgd_all_zero_gradient_is_finite_and_recovers() -> None:
    compressor = PowerSGD(rank=2)
    zero = compressor.compress(torch.zeros(20, 10))
    assert all(torch.isfinite(t).all() for t in zero.tensors.values())
    assert (compressor.decompress(zero) == 0).all()
    # warm start must not get stuck on the zero factor left by the zero gradient
    m = randn((20, 1), seed=42) @ randn((1, 10), seed=43)
    for _ in range(2):
        y = round_trip(compressor, m)
        torch.testing.assert_close(y, m, atol=1e-4, rtol=1e-4)
    compressor.compress(torch.zeros(20, 10))
    m = randn((20, 2), seed=44) @ randn((2, 10), seed=45)
    for _ in range(2):
        y = round_trip(compressor, m)
        torch.testing.assert_close(y, m, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("shape", "rank", "accepted"),
    [
        ((1000,), 1, False),
        ((4, 4), 2, False),  # (4 + 4) * 2 == 16: factors are not smaller
        ((4, 4), 1, True),
        ((3, 100), 3, False),  # (3 + 100) * 3 = 309 >= 300
        ((10, 10), 2, True),
        ((10, 10), 5, False),
        ((64, 33), 50, False),  # effective rank 33
        ((8, 4, 3, 3), 1, True),  # seen as 8 x 36
        ((8, 4, 3, 3), 8, False),  # (8 + 36) * 8 = 352 >= 288
        ((0, 5), 1, False),
    ],
)
def test_powersgd_accepts(shape: tuple, rank: int, accepted: bool) -> None:
    compressor = PowerSGD(rank=rank)
    assert compressor.accepts(torch.Size(shape)) is accepted
    if len(shape) >= 2 and numel(shape):
        rows, cols = shape[0], numel(shape[1:])
        r = min(rank, rows, cols)
        assert accepted == ((rows + cols) * r < rows * cols)


def test_powersgd_exact_low_rank_matrix_is_recovered() -> None:
    m = randn((50, 3), seed=44) @ randn((3, 30), seed=45)
    compressor = PowerSGD(rank=3)
    errors = []
    for _ in range(4):
        errors.append(
            float(torch.linalg.norm(round_trip(compressor, m) - m) / torch.linalg.norm(m))
        )
    assert errors[-1] < 1e-5 and errors[1] < 1e-5


def _matrix_with_spectrum(singular_values: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    cols = singular_values.numel()
    u, _ = torch.linalg.qr(torch.randn(rows, cols, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen))
    return (u * singular_values) @ v.T


def test_powersgd_warm_start_converges_to_best_rank_r() -> None:
    singular_values = torch.tensor([10.0, 5.0] + [0.5**i for i in range(1, 39)])
    m = _matrix_with_spectrum(singular_values, rows=60, seed=46)
    best = float(torch.linalg.norm(singular_values[2:]))  # Eckart-Young optimum for rank 2

    def errors(warm_start: bool) -> list[float]:
        compressor = PowerSGD(rank=2, warm_start=warm_start)
        return [float(torch.linalg.norm(round_trip(compressor, m) - m)) for _ in range(12)]

    warm = errors(True)
    assert all(e >= best * (1 - 1e-4) for e in warm)  # sanity: nothing beats the SVD
    assert all(abs(e - best) <= 1e-3 * best for e in warm[4:])  # power iteration converged
    cold = errors(False)
    # without warm start it does not: 5.1x the optimum on average here (seeded, deterministic)
    assert sum(cold[4:]) / len(cold[4:]) > 4.5 * best


def test_powersgd_payload_is_orthonormal_p_and_projection_q() -> None:
    m = randn((64, 33), seed=47)
    payload = PowerSGD(rank=4).compress(m)
    p, q = payload.tensors["p"], payload.tensors["q"]
    assert p.shape == (64, 4) and q.shape == (33, 4)
    torch.testing.assert_close(p.T @ p, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(q, m.T @ p, atol=1e-5, rtol=1e-5)


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["topk", "randomk", "dgc_topk"])
@pytest.mark.parametrize("ratio", [0, 1.5, -0.1, "a", True, float("nan"), None])
def test_bad_ratio(name: str, ratio: Any) -> None:
    with pytest.raises(ValueError, match=r"^ratio: .*\(0, 1\], got "):
        make_compressor(name, ratio=ratio)


@pytest.mark.parametrize("rank", [0, -1, 1.5, True])
def test_bad_powersgd_rank(rank: Any) -> None:
    with pytest.raises(ValueError, match=r"^rank: .*>= 1"):
        make_compressor("powersgd", rank=rank)


@pytest.mark.parametrize("points", [0, 200, 128, 2.0])
def test_bad_qsgd_points(points: Any) -> None:
    with pytest.raises(ValueError, match=r"^points: .*1"):
        make_compressor("qsgd", points=points)
    if isinstance(points, int):
        with pytest.raises(ValueError, match=r"^points: must be in \[1, 127\], got "):
            make_compressor("qsgd", points=points)


def test_qsgd_levels_is_refused_in_one_line_naming_points():
    # QSGD's option was "levels" up to 0.2: that word names the two-level topology now
    with pytest.raises(ValueError) as info:
        make_compressor("qsgd", levels=7, bucket_size=64)
    assert str(info.value) == ("compressor 'qsgd': parameter 'levels' is now 'points'; write points: 7 "
                               "(the same value, the same meaning)")
    with pytest.raises(ValueError, match=r"^compressor 'qsgd': parameter 'levels' is now 'points'"):
        CompressorSpec.of("qsgd", levels=3)


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("qsgd", {"bucket_size": 0}, "bucket_size"),
        ("int8", {"chunk_size": 4}, "chunk_size"),
        ("threshold", {"threshold": 0}, "threshold"),
        ("threshold", {"threshold": float("inf")}, "threshold"),
        ("randomk", {"scale": "yes"}, "scale"),
        ("randomk", {"seed": -1}, "seed"),
        ("powersgd", {"warm_start": 1}, "warm_start"),
        ("dgc_topk", {"max_retries": 17}, "max_retries"),
        ("dgc_topk", {"sample_ratio": 0}, "sample_ratio"),
    ],
)
def test_other_bad_parameters_name_their_field(name: str, params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        make_compressor(name, **params)


def test_unknown_compressor_name_lists_allowed_names() -> None:
    with pytest.raises(ValueError, match=r"unknown name 'nope'; allowed: ") as info:
        make_compressor("nope")
    message = str(info.value)
    assert all(name in message for name in NAMES)


def test_unknown_parameter_lists_allowed_parameters() -> None:
    with pytest.raises(ValueError, match=r"'topk': unknown parameter 'rank'; allowed: ratio$"):
        make_compressor("topk", rank=2)
    with pytest.raises(
        ValueError,
        match=r"'powersgd': unknown parameter 'ratio'; allowed: rank, warm_start, epsilon, seed",
    ):
        make_compressor("powersgd", ratio=0.1)
    with pytest.raises(ValueError, match=r"'sign': unknown parameter 'levels'; allowed: \(none\)"):
        make_compressor("sign", levels=3)
    # classes without their own __init__ must not advertise object's *args / **kwargs
    assert compressor_parameters("none") == []
    with pytest.raises(ValueError, match=r"'none': unknown parameter 'args'; allowed: \(none\)"):
        make_compressor("none", args=1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(10),
        torch.arange(12, dtype=torch.int32).reshape(3, 4),
        torch.ones(8, dtype=torch.bool),
    ],
    ids=["int64", "int32", "bool"],
)
def test_non_float_tensor_is_rejected(name: str, tensor: torch.Tensor) -> None:
    with pytest.raises(
        ValueError, match=rf"tensor: dtype {tensor.dtype} is not supported; allowed: floating-point"
    ):
        make_compressor(name).compress(tensor)


@pytest.mark.parametrize("name", NAMES)
def test_non_tensor_is_rejected(name: str) -> None:
    with pytest.raises(ValueError, match=r"tensor: expected a torch.Tensor, got list"):
        make_compressor(name).compress([1.0, 2.0])


# --- payload packing ----------------------------------------------------------------------


def _mixed_payloads(seed: int) -> list[Payload]:
    # (compressor, shape, dtype), chosen so byte sizes are odd and wide dtypes follow them
    layout = [
        (make_compressor("terngrad", seed=1), (10,), torch.float32),
        (make_compressor("none"), (10,), torch.float32),
        (make_compressor("sign"), (13,), torch.float32),
        (make_compressor("fp16"), (7,), torch.float32),
        (make_compressor("topk", ratio=0.1), (101,), torch.float64),
        (make_compressor("qsgd", points=3, bucket_size=16, seed=2), (37,), torch.float32),
        (make_compressor("int8", chunk_size=16), (101,), torch.float32),
        (make_compressor("powersgd", rank=2, seed=3), (16, 8), torch.float32),
        (make_compressor("randomk", ratio=0.2, seed=4), (50,), torch.bfloat16),
        (make_compressor("bf16"), (3,), torch.float32),
    ]
    return [
        c.compress(randn(shape, seed=seed + i, dtype=dt)) for i, (c, shape, dt) in enumerate(layout)
    ]


def test_pack_unpack_round_trip_across_compressors() -> None:
    local = _mixed_payloads(seed=50)
    buffer = pack(local)
    assert buffer.dtype == torch.uint8
    assert buffer.numel() == sum(p.nbytes for p in local)
    for original, unpacked in zip(local, unpack_like(buffer, local), strict=True):
        assert_payloads_equal(unpacked, original)


def test_unpack_a_peers_buffer_with_local_templates() -> None:
    local, peer = _mixed_payloads(seed=60), _mixed_payloads(seed=70)
    received = unpack_like(pack(peer), local)
    for mine, theirs, got in zip(local, peer, received, strict=True):
        assert got.shape == mine.shape and got.dtype == mine.dtype
        for name in theirs.tensors:
            assert torch.equal(got.tensors[name], theirs.tensors[name])


def test_unpack_from_an_offset_buffer() -> None:
    local = _mixed_payloads(seed=80)
    buffer = torch.cat([torch.zeros(3, dtype=torch.uint8), pack(local)])[3:]
    for original, unpacked in zip(local, unpack_like(buffer, local), strict=True):
        assert_payloads_equal(unpacked, original)


def test_pack_of_nothing() -> None:
    assert pack([]).numel() == 0
    assert unpack_like(torch.empty(0, dtype=torch.uint8), []) == []
    empty_sparse = make_compressor("threshold", threshold=10.0).compress(torch.zeros(5))
    assert empty_sparse.nbytes == 0 and pack([empty_sparse]).numel() == 0
    (unpacked,) = unpack_like(pack([empty_sparse]), [empty_sparse])
    assert (make_compressor("threshold").decompress(unpacked) == 0).all()


@pytest.mark.parametrize("delta", [-1, 1, -4, 8])
def test_unpack_like_rejects_wrong_size_buffer(delta: int) -> None:
    local = _mixed_payloads(seed=90)
    buffer = pack(local)
    size = buffer.numel()
    wrong = buffer[: size + delta] if delta < 0 else torch.cat([buffer, buffer.new_zeros(delta)])
    with pytest.raises(
        ValueError,
        match=rf"payload buffer holds {size + delta} bytes but the layout describes {size}",
    ):
        unpack_like(wrong, local)


# --- many layers at once (raycomp.compressors.batched) ---------------------------------------
#: small and large layers, odd sizes (a half byte of int4 left over), one under a chunk,
#: a constant one (a chunk without range), mixed dtypes
TOGETHER_SHAPES = [(1,), (7,), (64, 33), (2048,), (2049,), (3, 5, 7), (300,), (301,), (128, 512), (33,)]


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("chunk_size", [8, 64, 2048])
def test_quantizing_layers_together_gives_each_layer_its_own_bytes_and_values(name, chunk_size):
    c = make_compressor(name, chunk_size=chunk_size)
    tensors = [randn(s, i, FLOAT_DTYPES[i % 4]) for i, s in enumerate(TOGETHER_SHAPES)]
    tensors[-1] = torch.full((33,), 2.5)
    together, alone = c._compress_together(tensors), [c.compress(t) for t in tensors]
    for t, a, b in zip(tensors, together, alone, strict=True):
        assert (a.shape, a.dtype, a.nbytes) == (b.shape, b.dtype, b.nbytes)
        for key in b.tensors:  # the bytes on the wire, the unused half byte of an odd int4 layer too
            assert torch.equal(a.tensors[key], b.tensors[key]), (t.shape, key)
    for a, b in zip(c._decompress_together(alone), [c.decompress(p) for p in alone], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_int4_with_an_odd_chunk_is_compressed_one_layer_at_a_time():
    c = make_compressor("int4", chunk_size=9)  # a chunk would start inside a byte of codes
    tensors = [randn((30,), i) for i in range(3)]
    with pytest.raises(ValueError, match=r"^int4: chunk_size 9 does not start every chunk on a whole byte"):
        c._compress_together(tensors)
    many = c.compress_many(tensors)
    assert all(torch.equal(a.tensors["codes"], c.compress(t).tensors["codes"]) for a, t in zip(many, tensors, strict=True))


class CountedInt4(MinMaxInt4):
    """int4 that counts how many layers each call of compress_many/decompress_many gets."""

    name = "counted_int4"
    calls: list[tuple[str, int]] = []  # noqa: RUF012 - a test's record

    def compress_many(self, tensors):
        CountedInt4.calls.append(("compress", len(tensors)))
        return super()._compress_together(tensors) if len(tensors) > 1 else super().compress_many(tensors)

    def decompress_many(self, payloads):
        CountedInt4.calls.append(("decompress", len(payloads)))
        return super()._decompress_together(payloads) if len(payloads) > 1 else super().decompress_many(payloads)


def test_compress_each_takes_layers_of_one_setting_together_and_keeps_the_order():
    from raycomp.compressors.batched import compress_each, decompress_each

    CountedInt4.calls.clear()
    compressors = [CountedInt4(), make_compressor("topk", ratio=0.1), CountedInt4(), CountedInt4(chunk_size=64),
                   make_compressor("fp16"), CountedInt4()]
    tensors = [randn((200,), i) for i in range(len(compressors))]
    payloads = compress_each(compressors, tensors)
    assert CountedInt4.calls == [("compress", 3), ("compress", 1)]  # chunk 2048: layers 0, 2, 5; chunk 64: 3
    for c, t, p in zip(compressors, tensors, payloads, strict=True):
        alone = c.compress(t)
        assert all(torch.equal(p.tensors[k], alone.tensors[k]) for k in alone.tensors), type(c).__name__
    decoded = decompress_each(compressors, payloads)
    assert CountedInt4.calls[2:] == [("decompress", 3), ("decompress", 1)]
    for c, p, d in zip(compressors, payloads, decoded, strict=True):
        assert torch.equal(d, c.decompress(p))
    with pytest.raises(ValueError, match=r"^compressors: 2 for 1 tensors$"):
        compress_each(compressors[:2], tensors[:1])
