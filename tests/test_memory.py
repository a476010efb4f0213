"""Error-feedback memories: mass is conserved, DGC's corrections behave as in the paper."""

from __future__ import annotations

import pytest
import torch

from raycomp._internal.reduce.memory import DGCMemory, NoMemory, ResidualMemory
from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp.compressors import make_compressor
from raycomp.plan import Plan


def _running_gaps(name: str, memory, steps: int = 200, **params) -> tuple[float, float]:
    """Relative gap ||sum of gradients - sum of what was sent|| / ||sum of gradients|| after
    ``steps // 2`` and ``steps`` steps of gradients = fixed signal + noise (like SGD's)."""
    compressor = make_compressor(name, **params)
    gen = torch.Generator().manual_seed(0)
    signal = 0.1 * torch.randn(64, 48, generator=gen)
    true_sum, sent_sum = torch.zeros(64, 48), torch.zeros(64, 48)
    gaps = []
    for step in range(steps):
        grad = signal + 0.3 * torch.randn(64, 48, generator=gen)
        compensated = memory.compensate("w", grad)
        sent = compressor.decompress(compressor.compress(compensated))
        memory.update("w", compensated, sent, compressor.sparse)
        true_sum += grad
        sent_sum += sent
        if step + 1 in (steps // 2, steps):
            gaps.append(float((true_sum - sent_sum).norm() / true_sum.norm()))
    return gaps[0], gaps[1]


# The relative gap at T = 100 -> 200 steps (seeded). Bounds sit just outside the measured
# gaps (docs/benchmarks/history.md): gap at T with EF below, its shrink factor T/2 -> T
# below, gap without EF above
EF_BOUNDS = {
    "topk": (0.21, 0.6, 0.9, {}),
    "dgc_topk": (0.21, 0.6, 0.9, {}),
    "threshold": (0.013, 0.6, 0.5, {"threshold": 0.5}),
    "randomk": (0.6, 0.8, 0.97, {}),
    "sign": (0.027, 0.7, 0.36, {}),
    "powersgd": (0.18, 0.6, 0.94, {}),
}


@pytest.mark.parametrize("name", EF_BOUNDS)
def test_error_feedback_delays_dropped_mass_but_never_loses_it(name):
    # sum of sent == sum of gradients - current residual: with a bounded residual the
    # relative gap falls like 1/T; without memory what was dropped is gone for good
    max_gap, shrink, min_lost, params = EF_BOUNDS[name]
    half, full = _running_gaps(name, ResidualMemory(), **params)
    _, lost = _running_gaps(name, NoMemory(), **params)
    print(f"{name}: with EF {half:.3f} -> {full:.3f}, without {lost:.3f}")
    assert full < max_gap
    assert full < shrink * half
    assert lost > min_lost


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_unbiased_quantizers_stay_bounded_under_the_default_memory(name):
    # QSGD's variance at its defaults (sqrt(512)/7 ~ 3.2 x ||x||^2 per bucket) is not a
    # contraction: fed back as error feedback, the residual grew geometrically, by orders of
    # magnitude past the gradient's norm. Unbiased compressors need no error
    # feedback, so the reducer keeps none for them (Compressor.error_feedback).
    reducer = CompressedReducer(Plan.uniform(name), min_compress_numel=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        grad = 0.1 * torch.randn(64, 48, generator=gen)
        (mean,) = reducer.reduce(["w"], [grad])
        reducer.end_step()
    # one rank: the mean is this rank's decompressed gradient; unbiased quantizers are a few
    # times the gradient's norm (measured: qsgd 2.1x, terngrad 1.9x)
    assert float(mean.norm() / grad.norm()) < 4.0
    assert reducer.memory.residual("w") is None


def test_dense_send_clears_the_residual_and_state_round_trips():
    memory = ResidualMemory()
    grad = torch.randn(10)
    compensated = memory.compensate("w", grad)
    memory.update("w", compensated, torch.zeros(10), sparse=True)
    assert torch.equal(memory.residual("w"), grad)
    restored = ResidualMemory()
    restored.load_state_dict(memory.state_dict())
    assert torch.equal(restored.residual("w"), grad)
    again = memory.compensate("w", grad)
    memory.update("w", again, again, sparse=False)  # sent in full
    assert memory.residual("w") is None


def test_dgc_momentum_correction_and_masking():
    m = 0.9
    memory = DGCMemory(momentum=m)
    g1, g2 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 1.0])
    v1 = memory.compensate("w", g1)  # u = g1, v = g1
    assert torch.equal(v1, g1)
    sent = torch.tensor([0.0, 0.0, 3.0])  # top-1 sent
    memory.update("w", v1, sent, sparse=True)
    # momentum-factor masking: the sent coordinate's velocity is reset
    assert torch.equal(memory.velocity["w"], torch.tensor([1.0, 2.0, 0.0]))
    v2 = memory.compensate("w", g2)  # u = m*u + g2; v = (v1 - sent) + u
    expected_u = torch.tensor([m * 1 + 1, m * 2 + 1, 1.0])
    torch.testing.assert_close(v2, torch.tensor([1.0, 2.0, 0.0]) + expected_u)
    # mass: v_new + sent == v_old + u
    memory.update("w", v2, torch.zeros(3), sparse=True)
    torch.testing.assert_close(memory.residual("w"), v2)


def test_dgc_dense_layers_keep_plain_momentum():
    memory = DGCMemory(momentum=0.5)
    for g in (torch.ones(4), torch.ones(4)):
        v = memory.compensate("b", g)
        memory.update("b", v, v, sparse=False)
    # second step sends u = 0.5 * 1 + 1 (momentum SGD), nothing accumulates
    torch.testing.assert_close(v, torch.full((4,), 1.5))
    assert memory.residual("b") is None


def test_dgc_local_clipping_scales_with_world_size():
    memory = DGCMemory(momentum=0.0, clip_norm=2.0, world_size=4)
    v = memory.compensate("w", torch.full((4,), 10.0))
    assert float(v.norm()) == pytest.approx(2.0 / 4**0.5)


def test_memory_bad_input_and_no_memory():
    with pytest.raises(ValueError, match=r"momentum: must be in \[0, 1\)"):
        DGCMemory(momentum=1.0)
    with pytest.raises(ValueError, match="clip_norm: must be positive"):
        DGCMemory(clip_norm=0)
    grad = torch.randn(3)
    assert NoMemory().compensate("w", grad) is grad


def test_reset_forgets_everything():
    for memory in (ResidualMemory(), DGCMemory()):
        v = memory.compensate("w", torch.ones(3))
        memory.update("w", v, torch.zeros(3), sparse=True)
        assert memory.residual("w") is not None
        memory.reset()
        assert memory.residual("w") is None
        assert torch.equal(memory.compensate("w", torch.ones(3)), torch.ones(3))
