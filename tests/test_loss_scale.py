"""Error feedback under fp16 loss scaling: the hook told the GradScaler follows its scale.

Scales are powers of two, so a scaled gradient is the unscaled one times an exact factor,
and every compressor here is equivariant to it (Top-K picks the same entries, min-max
quantisation the same codes, PowerSGD's orthonormalisation divides the factor out; the
fixed threshold and DGC's clipping norm are scaled with the gradient they are compared
with). A run whose memory follows the scale is then the run without a scaler, bit for bit;
a memory that kept the old scale's units would add its residual at twice or half its weight.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp import Plan
from raycomp._internal.ddp.hook import CompressionState, compression_hook
from raycomp._internal.reduce.memory import DGCMemory
from tests.distributed import run_distributed

# the scale each step's backward runs under: growths and backoffs, and a change at step 6,
# where the resumed run starts
SCALES = [2.0**4, 2.0**4, 2.0**6, 2.0**6, 2.0**3, 2.0**3, 2.0**9, 2.0**5, 2.0**5, 2.0**2]
CASES = {  # plan, memory, world size
    "topk": (Plan.uniform("topk", ratio=0.01), "residual", 2),
    "dgc": (Plan.uniform("dgc_topk", ratio=0.01), "dgc", 2),
    "powersgd": (Plan.uniform("powersgd", rank=1), "residual", 2),
    "int8-server-residuals": (Plan.uniform("int8", chunk_size=512), "residual", 3),  # W=3: two rounds
    # an absolute threshold, in the loss's units: compared with the scaled gradient as it is,
    # it would send about everything at these scales
    "threshold": (Plan.uniform("threshold", threshold=0.01), "residual", 2),
    # DGC's local clipping at an absolute norm (in the loss's units) that most layers exceed
    "dgc-clipped": (Plan.uniform("dgc_topk", ratio=0.01), lambda: DGCMemory(clip_norm=0.2, world_size=2), 2),
}


def _train(rank: int, world_size: int, case: str, scaled: bool, resume_at: int | None):
    plan, memory_kind, _ = CASES[case]
    torch.manual_seed(0)

    def build():
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        ddp = DDP(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALES[0]) if scaled else None
        memory = memory_kind() if callable(memory_kind) else memory_kind
        state = CompressionState(ddp, plan, memory=memory, min_compress_numel=256, stats_every=1,
                                 grad_scaler=scaler)
        ddp.register_comm_hook(state, compression_hook)
        return model, ddp, scaler, state, torch.optim.SGD(model.parameters(), lr=0.1)

    model, ddp, scaler, state, opt = build()
    gen = torch.Generator().manual_seed(rank)
    norms = []
    for step, scale in enumerate(SCALES):
        if step == resume_at:  # a new process would do this: everything from the checkpoint
            saved = {"model": model.state_dict(), "opt": opt.state_dict(), "comm": state.state_dict(),
                     "scaler": scaler.state_dict() if scaler else None}
            state.close()
            model, ddp, scaler, state, opt = build()
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(saved["comm"])
            if scaler:
                scaler.load_state_dict(saved["scaler"])
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            assert scaler.get_scale() == scale
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update(SCALES[min(step + 1, len(SCALES) - 1)])
        norms.append([(s.grad_norm, s.residual_norm) for s in state.stats])
    state.close()
    return [p.detach() for p in model.parameters()], norms


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_feedback_follows_the_loss_scale_bit_for_bit(case):
    world = CASES[case][2]
    plain = run_distributed(_train, world, case, False, None)
    scaled = run_distributed(_train, world, case, True, None)
    for r in range(world):
        for a, b in zip(plain[r][0], scaled[r][0], strict=True):
            assert torch.equal(a, b), f"rank {r}: parameters differ by {float((a - b).abs().max()):.3g}"
        # statistics in the loss's units: the controller must not see the scale change
        assert scaled[r][1] == plain[r][1]
    assert any(n[1] > 0 for step in plain[0][1] for n in step), "no residual: nothing to follow"


def test_a_resumed_run_follows_the_scale_its_memory_was_saved_in():
    plain = run_distributed(_train, 2, "topk", False, None)
    resumed = run_distributed(_train, 2, "topk", True, 6)
    for r in range(2):
        for a, b in zip(plain[r][0], resumed[r][0], strict=True):
            assert torch.equal(a, b), f"rank {r}: parameters differ by {float((a - b).abs().max()):.3g}"


def test_a_grad_scaler_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match=r"^grad_scaler: expected a torch.amp.GradScaler or None, got float$"):
        CompressionState(nn.Linear(4, 4), grad_scaler=2.0**16)
