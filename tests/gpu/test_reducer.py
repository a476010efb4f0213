"""``CompressedReducer`` on CUDA: one reduction per transport, the guard's control rows,
resuming from state loaded on the CPU, and the collectives it relies on."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp.plan import Plan
from tests.gpu.ranks import Check, Nccl, TwoRanks
from tests.gpu.support import (
    CUDA,
    PARAMS,
    TRANSPORT_PLANS,
    build,
    count_syncs,
    cpu_copy,
    payload_tensors,
    rel_err,
    same_on_every_rank,
    sites,
    to_device,
)

pytestmark = pytest.mark.gpu


def reduce_one_transport(device: torch.device, rank: int, world: int, name: str) -> str:
    """Three steps of a weight and a bias: means on the gradients' device, dtype and shape,
    finite, the same on every rank (and the true mean for the lossless casts); residuals on
    the device."""
    reducer = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
    g = torch.randn(256, 64, generator=torch.Generator().manual_seed(rank + 1)).to(device)
    b = torch.randn(64, generator=torch.Generator().manual_seed(rank + 7)).to(device)
    for step in range(3):
        means = reducer.reduce(["w", "b"], [g, b])
        reducer.end_step()
        for m, ref in zip(means, (g, b), strict=True):
            assert m.device == ref.device and m.dtype == ref.dtype and m.shape == ref.shape, (
                f"step {step}: mean {m.device}/{m.dtype}/{tuple(m.shape)}")
            assert torch.isfinite(m).all(), "non-finite mean"
        for t in getattr(reducer.memory, "residuals", {}).values():
            assert t.device == device, f"residual on {t.device}"
    assert same_on_every_rank([means[0]]), "ranks disagree on the mean"
    if world > 1 and name in ("none", "fp16"):
        true = g.clone()
        dist.all_reduce(true)
        e = rel_err(true / world, means[0])
        assert e < 1e-3, f"mean off by {e:.2e}"
    n_sync, msgs = count_syncs(lambda: (reducer.reduce(["w", "b"], [g, b]), reducer.end_step()))
    return f"syncs/reduce={n_sync} [{sites(msgs)}]"


CONTROL_CASES = {"carried-in-dense": (["w", "b"], False), "own-allreduce": (["w"], False),
                 "nan-on-last-rank": (["w", "b"], True)}


def control_rows(device: torch.device, rank: int, world: int, case: str) -> str:
    """The guard's control floats ride in the step's last reduction (in the dense all-reduce
    where there is a dense layer, else in an all-reduce of their own): every rank reads
    every rank's row, the means do not change, a NaN on one rank raises its flag everywhere."""
    names, nan = CONTROL_CASES[case]
    plan = Plan.uniform("int8", **PARAMS["int8"])
    gen = torch.Generator().manual_seed(rank + 1)
    grads = [torch.randn(256, 64, generator=gen).to(device), torch.randn(64, generator=gen).to(device)]
    grads = grads[: len(names)]
    if nan and rank == world - 1:
        grads[0][3, 5] = float("nan")
    with_control = CompressedReducer(plan, min_compress_numel=256)
    without = CompressedReducer(plan, min_compress_numel=256)
    with_control.stage_control([rank + 0.5, 7.0])
    means = with_control.reduce(names, [g.clone() for g in grads], closes_step=True)
    rows = with_control.control_rows
    assert rows is not None, "no control rows after the closing reduction"
    plain = without.reduce(names, [g.clone() for g in grads], closes_step=True)
    probe = CompressedReducer(plan, min_compress_numel=256)
    probe.stage_control([1.0, 2.0])
    k, msgs = count_syncs(lambda: probe.reduce(names, [g.clone() for g in grads], closes_step=True))
    got = rows.detach().cpu()
    flags = [1.0 if nan and r == world - 1 else 0.0 for r in range(world)]
    expected = torch.tensor([[flags[r], r + 0.5, 7.0] for r in range(world)])
    assert torch.equal(got, expected), f"control rows {got.tolist()} != {expected.tolist()}"
    if not nan:
        for a, b in zip(means, plain, strict=True):
            assert torch.equal(a, b), "the carried control changed a gradient's mean"
    with_control.end_step()
    assert with_control.local_nonfinite == (nan and rank == world - 1)
    return f"rows on {rows.device}, {got.tolist()}; syncs in reduce with control={k} [{sites(msgs)}]"


def gloo_op(device: torch.device, rank: int, world: int, op: str) -> str:
    """One collective gloo must run on CUDA tensors."""
    t = torch.arange(8, dtype=torch.float32, device=device) + rank
    if op == "all_reduce":
        dist.all_reduce(t.clone())
    elif op == "broadcast":
        dist.broadcast(t.clone(), 0)
    elif op == "all_gather":
        dist.all_gather([torch.empty_like(t) for _ in range(world)], t)
    elif op == "all_gather uint8":
        dist.all_gather([torch.empty(5, dtype=torch.uint8, device=device) for _ in range(world)],
                        torch.ones(5, dtype=torch.uint8, device=device))
    else:
        dist.all_to_all_single(torch.empty(8, device=device), t, [4] * world, [4] * world)
    return ""


OPS = ["all_reduce", "broadcast", "all_gather", "all_gather uint8", "all_to_all_single"]
REDUCE = {label: Check(reduce_one_transport, {"name": name}) for label, name in TRANSPORT_PLANS.items()}
CONTROL = {case: Check(control_rows, {"case": case}) for case in CONTROL_CASES}
GLOO_OPS = {op: Check(gloo_op, {"op": op}) for op in OPS}
TWO_RANKS = [*GLOO_OPS.values(), *REDUCE.values(), *CONTROL.values()]


@pytest.mark.parametrize("op", OPS)
def test_gloo_runs_the_collectives_on_cuda_tensors(two_ranks: TwoRanks, op: str) -> None:
    two_ranks.run(GLOO_OPS[op])


@pytest.mark.parametrize("label", list(TRANSPORT_PLANS))
def test_reduce_gives_every_rank_the_mean_on_the_device(ranks: Nccl | TwoRanks, label: str,
                                                        note: Callable[[str], None]) -> None:
    note(ranks.run(REDUCE[label]))


@pytest.mark.parametrize("case", list(CONTROL_CASES))
def test_control_rows_reach_every_rank_in_the_last_reduction(ranks: Nccl | TwoRanks, case: str,
                                                            note: Callable[[str], None]) -> None:
    note(ranks.run(CONTROL[case]))


@pytest.mark.usefixtures("nccl_group")
def test_nccl_refuses_cpu_tensors() -> None:
    """Why ``sparse_allgather`` keeps its element counts on the payloads' device (it built
    them on the CPU before the first GPU run)."""
    counts = torch.tensor([3, 4], dtype=torch.int64)  # on the CPU
    with pytest.raises(RuntimeError):
        dist.all_gather([torch.empty_like(counts)], counts)


@pytest.mark.usefixtures("nccl_group")
def test_timeout_of_reads_a_new_nccl_groups_timeout() -> None:
    """``raycomp._internal.ddp.torch_ddp.timeout_of``: the hook's own group takes DDP's timeout; on NCCL the
    options sit behind the CUDA device."""
    from raycomp._internal.ddp.torch_ddp import timeout_of

    wanted = datetime.timedelta(seconds=77)
    got = timeout_of(dist.new_group(timeout=wanted))
    assert got == wanted, f"timeout_of gave {got}, the group was created with {wanted}"


@pytest.mark.parametrize("name", ["powersgd", "randomk", "qsgd", "terngrad", "dgc_topk"])
def test_compressor_resumes_on_cuda_from_a_cpu_loaded_state(name: str) -> None:
    x = torch.randn(256, 129, device=CUDA)
    first = build(name)
    first.compress(x)
    resumed = build(name)
    resumed.load_state_dict(cpu_copy(first.state_dict()))
    p = resumed.compress(x)
    assert all(t.device == CUDA for t in payload_tensors(p))


@pytest.mark.usefixtures("nccl_group")
@pytest.mark.parametrize(("name", "on_cuda"), [("topk", "server_residuals"), ("int8", "memory")],
                         ids=["memory-on-cpu", "server-residuals-on-cpu"])
def test_reducer_resumes_with_one_part_of_its_state_on_the_cpu(name: str, on_cuda: str) -> None:
    g = torch.randn(256, 64, device=CUDA)
    first = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
    first.reduce(["w"], [g])
    first.end_step()
    state = cpu_copy(first.state_dict())
    state[on_cuda] = to_device(state[on_cuda], CUDA)  # only the other part stays on the CPU
    resumed = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
    resumed.load_state_dict(state)
    resumed.reduce(["w"], [g])


@pytest.mark.usefixtures("nccl_group")
@pytest.mark.parametrize(("label", "name"), [("powersgd", "powersgd"), ("residual-topk", "topk"),
                                             ("server-int8", "int8")])
def test_reducer_resumes_on_cuda_from_a_cpu_loaded_checkpoint(label: str, name: str) -> None:
    """A reducer state saved with map_location='cpu' (as Ray checkpoints often are)."""
    g = torch.randn(256, 64, device=CUDA)
    first = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
    first.reduce(["w"], [g])
    first.end_step()
    resumed = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
    resumed.load_state_dict(cpu_copy(first.state_dict()))
    (m,) = resumed.reduce(["w"], [g])
    resumed.end_step()
    assert m.device == CUDA
