"""Error-feedback memories: mass is conserved, DGC's corrections behave as in the paper."""

from __future__ import annotations

import pytest
import torch

from raycomp.compressors import make_compressor
from raycomp.memory import DGCMemory, NoMemory, ResidualMemory


@pytest.mark.parametrize("name", ["topk", "sign", "randomk", "qsgd", "int8", "powersgd"])
def test_error_feedback_conserves_mass(name):
    memory, compressor = ResidualMemory(), make_compressor(name)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        grad = torch.randn(64, 48, generator=gen)
        old = memory.residual("w")
        old = torch.zeros_like(grad) if old is None else old.clone()
        compensated = memory.compensate("w", grad)
        sent = compressor.decompress(compressor.compress(compensated))
        memory.update("w", compensated, sent, compressor.sparse)
        # what was sent + new residual == gradient + old residual
        torch.testing.assert_close(sent + memory.residual("w"), grad + old, rtol=0, atol=1e-6)


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
