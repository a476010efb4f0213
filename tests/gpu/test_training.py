"""50 steps of the char transformer on NCCL (world size 1) with each method: the loss is
finite and falls; the median time of a step is noted (at world size 1 nothing crosses a
network, so it is the hook's own cost)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from jobs.models import char_transformer, lm_loss
from raycomp.buckets import bucket_cap_mb
from raycomp.hook import CompressionState, compression_hook
from raycomp.plan import Plan
from tests.gpu.models import rule_tokens
from tests.gpu.support import CUDA

pytestmark = pytest.mark.gpu

VOCAB, BLOCK, BATCH, STEPS, TOKENS = 32, 64, 32, 50, 200_000
RUNS = {  # label: (plan, or None for plain DDP; raycomp.bucket_cap_mb's buckets; fp16 autocast + GradScaler)
    "plain-ddp": (None, False, False),
    "hook-dense": (Plan(), False, False),
    "hook-powersgd-r2": (Plan.uniform("powersgd", rank=2), False, False),
    "hook-topk-1%": (Plan.uniform("topk", ratio=0.01), False, False),
    "hook-int8": (Plan.uniform("int8"), False, False),
    "hook-int4": (Plan.uniform("int4"), False, False),
    "hook-bf16": (Plan.uniform("bf16"), False, False),
    "hook-int4-auto-buckets": (Plan.uniform("int4"), True, False),
    "plain-ddp-fp16-autocast": (None, False, True),
    "hook-topk-1%-fp16-autocast": (Plan.uniform("topk", ratio=0.01), False, True),
}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return rule_tokens(TOKENS, VOCAB, CUDA)


@pytest.mark.usefixtures("nccl_group")
@pytest.mark.parametrize("label", list(RUNS))
def test_char_transformer_trains(label: str, tokens: torch.Tensor, note: Callable[[str], None]) -> None:
    plan, auto_buckets, amp = RUNS[label]
    torch.manual_seed(0)
    model = char_transformer(VOCAB, block=BLOCK).to(CUDA)
    ddp = DDP(model, device_ids=[CUDA.index], **({"bucket_cap_mb": bucket_cap_mb(model)} if auto_buckets else {}))
    scaler = torch.amp.GradScaler("cuda") if amp else None
    state = None
    if plan is not None:
        state = CompressionState(ddp, plan, grad_scaler=scaler)
        ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(STEPS):
        offsets = torch.randint(0, TOKENS - BLOCK - 1, (BATCH,), generator=gen).to(CUDA)
        window = tokens[offsets[:, None] + torch.arange(BLOCK + 1, device=CUDA)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = lm_loss(ddp(window[:, :-1]), window[:, 1:])
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    if state is not None:
        state.close()
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    note(f"loss {first:.3f} -> {last:.3f}, {statistics.median(times[5:]) * 1e3:.2f} ms/step (median)")
    assert all(math.isfinite(v) for v in losses), "non-finite loss"
    assert last < first, f"loss did not decrease ({first:.3f} -> {last:.3f})"
