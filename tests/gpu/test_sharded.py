""":class:`raycomp._internal.fsdp.reduce_scatter.CompressedReduceScatter` on CUDA, called as FSDP2 calls it: the
shard each rank receives against the true mean of every rank's input (computed here,
without a collective), and resumed from a state loaded on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from raycomp.plan import CompressorSpec
from tests.gpu.ranks import Check, Nccl, TwoRanks
from tests.gpu.support import PARAMS, count_syncs, cpu_copy, rel_err, sites

pytestmark = pytest.mark.gpu

N = 4099  # per shard; not a multiple of the int8 chunk, odd byte rows
TOLERANCE = {"none": 1e-6, "fp16": 1e-3, "bf16": 1e-2, "int8": 3e-2}  # rel. error of the mean shard
LOSSY = ("sign", "qsgd", "terngrad")  # finite, on the device, error noted


def need_sharded() -> None:
    """Skips where this torch cannot run ``raycomp._internal.fsdp.reduce_scatter``."""
    try:
        import raycomp._internal.fsdp.reduce_scatter  # noqa: F401
    except ImportError as error:
        pytest.skip(f"torch {torch.__version__}: raycomp._internal.fsdp.reduce_scatter does not import ({error})")


def _input(rank: int, world: int, step: int = 0) -> torch.Tensor:
    return torch.randn(world * N, generator=torch.Generator().manual_seed(100 * step + rank))


def _mine(rank: int, world: int) -> torch.Tensor:
    truth = sum(_input(r, world) for r in range(world)) / world
    return truth.view(world, N)[rank]


def reduce_scatter(device: torch.device, rank: int, world: int, name: str) -> str:
    """The shard's error against the true mean (bounded for the near-lossless ones), on the
    device; on gloo also the same call on CPU tensors; SUM for the dense plan; the syncs."""
    need_sharded()
    from raycomp._internal.fsdp.reduce_scatter import CompressedReduceScatter

    group = dist.group.WORLD
    mine = _mine(rank, world)
    spec = CompressorSpec.of(name, **PARAMS[name])
    comm = CompressedReduceScatter(spec, name="unit", rank=rank)
    out = comm.allocate((N,), dtype=torch.float32, device=device)
    comm(out, _input(rank, world).to(device), group, dist.ReduceOp.AVG)
    assert out.device == device, f"output on {out.device}"
    assert torch.isfinite(out).all(), "non-finite shard"
    if comm.residual is not None:
        assert comm.residual.device == device, f"residual on {comm.residual.device}"
    e = rel_err(mine, out)
    if name in TOLERANCE:
        assert e <= TOLERANCE[name], f"mean off by {e:.2e} > {TOLERANCE[name]}"
    notes = [f"rel. error of the mean {e:.2e}"]
    if dist.get_backend() == "gloo":
        twin = CompressedReduceScatter(spec, name="unit", rank=rank)
        out_cpu = torch.empty(N)
        twin(out_cpu, _input(rank, world), group, dist.ReduceOp.AVG)
        d = rel_err(out_cpu, out)
        notes.append(f"vs CPU run {d:.2e}")
        if name in ("none", "fp16", "bf16"):
            assert d < 1e-6, f"CPU and {device.type} differ by {d:.2e}"
    if name == "none":
        total = comm.allocate((N,), dtype=torch.float32, device=device)
        comm(total, _input(rank, world).to(device), group, dist.ReduceOp.SUM)
        e_sum = rel_err(mine * world, total)
        assert e_sum < 1e-6, f"SUM off by {e_sum:.2e}"
    x = _input(rank, world).to(device)
    k, msgs = count_syncs(lambda: comm(out, x, group, dist.ReduceOp.AVG))
    notes.append(f"syncs/call={k}" + (f" [{sites(msgs)}]" if k else ""))
    if world > 1:
        notes.append(f"wire {comm.sent_bytes / comm.dense_bytes:.3f} of fp32")
    return ", ".join(notes)


def bf16_reduce_scatter(device: torch.device, rank: int, world: int) -> str:
    """FSDP with ``reduce_dtype=bf16`` hands the comm bf16 tensors: int8 in and out."""
    need_sharded()
    from raycomp._internal.fsdp.reduce_scatter import CompressedReduceScatter

    comm = CompressedReduceScatter(CompressorSpec.of("int8"), name="unit", rank=rank)
    out = comm.allocate((N,), dtype=torch.bfloat16, device=device)
    comm(out, _input(rank, world).to(device, torch.bfloat16), dist.group.WORLD, dist.ReduceOp.AVG)
    assert out.dtype == torch.bfloat16 and out.device == device, f"output {out.dtype} on {out.device}"
    e = rel_err(_mine(rank, world), out)
    assert e <= 3e-2, f"mean off by {e:.2e}"
    return f"rel. error of the mean {e:.2e}"


def resume(device: torch.device, rank: int, world: int, name: str) -> str:
    """A comm's state saved after two calls and loaded on the CPU (sign: a residual; qsgd:
    random draws) resumes bit for bit like the run that never stopped."""
    need_sharded()
    from raycomp._internal.fsdp.reduce_scatter import CompressedReduceScatter

    group = dist.group.WORLD
    first = CompressedReduceScatter(CompressorSpec.of(name, **PARAMS[name]), name="unit", rank=rank)
    for step in range(2):
        first(first.allocate((N,), dtype=torch.float32, device=device),
              _input(rank, world, step).to(device), group, dist.ReduceOp.AVG)
    again = CompressedReduceScatter(CompressorSpec.of("int8"), name="unit", rank=rank)
    again.load_state_dict(cpu_copy(first.state_dict()))  # a checkpoint loaded on the CPU
    x = _input(rank, world, 2).to(device)
    a, b = torch.empty(N, device=device), torch.empty(N, device=device)
    first(a, x.clone(), group, dist.ReduceOp.AVG)
    again(b, x.clone(), group, dist.ReduceOp.AVG)
    assert torch.equal(a, b), f"resumed shard differs (rel {rel_err(a, b):.2e})"
    return ""


NAMES = [*TOLERANCE, *LOSSY]
COMMS = {name: Check(reduce_scatter, {"name": name}) for name in NAMES}
BF16 = Check(bf16_reduce_scatter)
RESUME = {name: Check(resume, {"name": name}) for name in ("sign", "qsgd")}
TWO_RANKS = [*COMMS.values(), BF16, *RESUME.values()]


@pytest.mark.parametrize("name", NAMES)
def test_reduce_scatter_gives_each_rank_its_shard_of_the_mean(ranks: Nccl | TwoRanks, name: str,
                                                               note: Callable[[str], None]) -> None:
    note(ranks.run(COMMS[name]))


def test_reduce_scatter_in_and_out_in_bf16(ranks: Nccl | TwoRanks, note: Callable[[str], None]) -> None:
    note(ranks.run(BF16))


@pytest.mark.parametrize("name", list(RESUME))
def test_reduce_scatter_resumes_from_a_cpu_loaded_state(ranks: Nccl | TwoRanks, name: str) -> None:
    ranks.run(RESUME[name])
