"""DDP's buckets under raycomp's hook (raycomp/_internal/ddp/buckets.py): about eight, so that most of a
step's communication is handed to the hook while backward is still computing."""

from __future__ import annotations

import pytest
import torch

from jobs.baselines import ddp_options
from jobs.config import BenchmarkSection
from jobs.workloads import model_of
from raycomp import CompressionState, Plan, bucket_cap_mb, compression_hook
from raycomp._internal.ddp.buckets import MAX_CAP_MB, MIN_CAP_MB, ddp_kwargs
from raycomp.config import CompressionSection
from tests.distributed import run_distributed


def _buckets_and_means(rank: int, world_size: int, auto: bool) -> tuple[list[int], list[torch.Tensor]]:
    """What DDP hands raycomp's hook at the second step (buckets are rebuilt after the first):
    the elements of each bucket in the order they arrive, and the int4 means of every layer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model_of("gpt_kjv")
    ddp = DDP(model, **(ddp_kwargs(CompressionSection(), model) if auto else {}))
    state = CompressionState(ddp, Plan.uniform("int4"), async_comm=False)
    sizes: list[int] = []

    def counting(s: CompressionState, bucket):  # unannotated: DDP checks hook annotations
        sizes.append(bucket.buffer().numel())
        return compression_hook(s, bucket)

    ddp.register_comm_hook(state, counting)
    for step in range(2):
        sizes.clear()
        ddp.zero_grad()
        tokens = torch.randint(0, 63, (2, 128), generator=torch.Generator().manual_seed(10 * rank + step))
        ddp(tokens).logsumexp(-1).mean().backward()
    state.close()
    return sizes, [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def runs() -> dict[str, list[tuple[list[int], list[torch.Tensor]]]]:
    """Both ranks' buckets and means, with auto buckets and with DDP's default."""
    return {"auto": run_distributed(_buckets_and_means, 2, True),
            "ddp_default": run_distributed(_buckets_and_means, 2, False)}


@pytest.mark.parametrize("kind", ["auto", "ddp_default"])
def test_auto_buckets_hand_most_gradients_to_the_hook_before_backward_ends(runs, kind):
    (sizes, means), (other_sizes, other_means) = runs[kind]
    assert sizes == other_sizes  # both ranks see the same buckets in the same order
    total = sum(p.numel() for p in model_of("gpt_kjv").parameters())
    assert sum(sizes) == total
    # the last bucket's communication is the part that cannot overlap backward
    if kind == "auto":
        assert 6 <= len(sizes) <= 16, sizes
        assert sizes[-1] <= 0.25 * total, sizes
    else:  # DDP's default: a 1 MB first bucket, then everything else in one
        assert len(sizes) <= 2 and sizes[-1] >= 0.9 * total, sizes
    for mine, theirs in zip(means, other_means, strict=True):
        assert torch.equal(mine, theirs)


def test_buckets_change_when_a_layer_travels_not_what_it_carries(runs):
    for (_, a), (_, b) in zip(runs["auto"], runs["ddp_default"], strict=True):
        for x, y in zip(a, b, strict=True):  # int4 codes a layer on its own, whatever shares its bucket
            assert torch.equal(x, y)


def test_the_cap_stays_between_ddps_first_bucket_and_its_default():
    assert bucket_cap_mb(torch.nn.Linear(10, 10)) == MIN_CAP_MB  # a tiny model: one 1 MB bucket
    huge = torch.nn.Linear(10_000, 10_000, device="meta")  # 400 MB of fp32, nothing allocated
    assert bucket_cap_mb(huge) == MAX_CAP_MB
    frozen = torch.nn.Linear(10_000, 10_000, device="meta").requires_grad_(False)
    assert bucket_cap_mb(frozen) == MIN_CAP_MB  # only gradients travel
    assert ddp_kwargs(CompressionSection(), huge) == {}  # DDP's default, its 1 MB first bucket kept
    with pytest.raises(ValueError, match=r"^buckets: must be >= 1, got 0$"):
        bucket_cap_mb(huge, buckets=0)


def test_torch_baselines_take_their_own_cap_only_when_one_is_set():
    model = model_of("gpt_kjv")
    auto = bucket_cap_mb(model)
    assert 1.5 < auto < 1.7  # 12.9 MB / 8
    for fields, cap in [({}, auto), ({"bucket_cap_mb": 4}, 4.0)]:  # raycomp's own hook
        assert ddp_kwargs(CompressionSection(**fields), model) == {"bucket_cap_mb": cap}, fields
    cases = [  # a torch hook (jobs.baselines): its own cap when one is set, else raycomp's buckets
        ({"baseline": "torch_allreduce"}, {}, auto),
        ({"baseline": "torch_allreduce"}, {"bucket_cap_mb": 4}, 4.0),
        ({"baseline": "torch_powersgd", "bucket_cap_mb": 16.0}, {}, 16.0),
        ({"baseline": "torch_powersgd", "bucket_cap_mb": 16.0}, {"bucket_cap_mb": 4}, 16.0),
    ]
    for bench, fields, cap in cases:
        got = ddp_options(BenchmarkSection(**bench), CompressionSection(**fields), model)
        assert got == {"bucket_cap_mb": cap}, (bench, fields)
