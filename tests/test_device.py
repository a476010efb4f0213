"""Device propagation, checked without a GPU (the CUDA tests are tests/gpu).

Tensors on the ``meta`` device have a shape, a dtype and a device but no data. A
compressor run on meta tensors therefore shows (a) that every tensor it creates follows
the input's device (a ``torch.zeros(n)`` without ``device=`` would come out on the CPU),
and (b) that it never waits for the device: reading a meta tensor's value (``bool(t)``,
``t.item()``, ``if norm > eps``) raises. On a GPU each such read stalls the stream.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raycomp._internal.wire.payload import Payload, pack, unpack_like
from raycomp.compressors import PowerSGD
from raycomp.compressors.base import SeededDraws
from raycomp.plan import CompressorSpec

REPO = Path(__file__).resolve().parents[1]

META = torch.device("meta")

# compressors whose compress and decompress must never wait for the device; the others
# (randomk: torch.unique, threshold and sampled dgc_topk: torch.nonzero) produce
# data-dependent sizes, which needs one device-to-host wait by construction
WAIT_FREE = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "topk": {"ratio": 0.01},
    "qsgd": {"points": 7, "bucket_size": 128},
    "terngrad": {},
    "sign": {},
    "int8": {"chunk_size": 256},
    "int4": {"chunk_size": 256},
    "powersgd": {"rank": 2},
}


@pytest.fixture
def meta_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch has no generator for meta tensors; draw from the default one (no data anyway)."""
    real = SeededDraws.generator

    def generator(self: SeededDraws, device: torch.device) -> torch.Generator | None:
        if torch.device(device).type == "meta":
            self.draws += 1
            return None
        return real(self, device)

    monkeypatch.setattr(SeededDraws, "generator", generator)


def _payload_devices(p: Payload) -> set[torch.device]:
    tensors = list(p.tensors.values()) + [v for v in p.meta.values() if isinstance(v, torch.Tensor)]
    return {t.device for t in tensors}


@pytest.mark.parametrize("name", sorted(WAIT_FREE))
@pytest.mark.parametrize("shape", [(64, 33), (8, 4, 3, 3), (1000,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("meta_generators")
def test_compressor_follows_the_input_device_without_waiting_for_it(
    name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    compressor = CompressorSpec.of(name, **WAIT_FREE[name]).build("layer", 0)
    reference = CompressorSpec.of(name, **WAIT_FREE[name]).build("layer", 0)
    if not compressor.accepts(torch.Size(shape)):
        pytest.skip("the reducer sends this shape dense")
    x = torch.empty(shape, dtype=dtype, device=META)
    for _ in range(3):  # later steps take the warm-start paths (PowerSGD)
        payload = compressor.compress(x)
        assert _payload_devices(payload) == {META}
        out = compressor.decompress(payload)
        assert out.device == META and out.dtype == dtype and out.shape == x.shape
        assert pack([payload]).device == META
    cpu_payload = reference.compress(torch.randn(shape).to(dtype))
    assert payload.nbytes == cpu_payload.nbytes
    assert {n: t.dtype for n, t in payload.tensors.items()} == {
        n: t.dtype for n, t in cpu_payload.tensors.items()
    }


def test_pack_of_no_bytes_stays_on_the_payloads_device() -> None:
    empty = Payload({"values": torch.empty(0, device=META)}, torch.Size([0]), torch.float32)
    assert pack([empty]).device == META
    assert pack([empty], device="cpu").device == torch.device("cpu")
    assert pack([]).device == torch.device("cpu")
    assert pack([], device=META).device == META
    assert unpack_like(pack([empty]), [empty])[0].tensors["values"].device == META


def test_dense_nbytes_allocates_nothing() -> None:
    payload = Payload({}, torch.Size([3, 5]), torch.bfloat16)
    assert payload.dense_nbytes == 30


@pytest.mark.usefixtures("meta_generators")
def test_powersgd_warm_start_follows_the_gradient_device() -> None:
    """A checkpoint loaded with map_location="cpu" resumes a compressor on another device."""
    trained = PowerSGD(rank=2)
    trained.compress(torch.randn(64, 33))
    state = trained.state_dict()
    assert state["q"].device.type == "cpu"
    resumed = PowerSGD(rank=2)
    resumed.load_state_dict(state)
    resumed.compress(torch.empty(64, 33, device=META))
    assert resumed.state_dict()["q"].device == META


def test_powersgd_branch_free_path_matches_the_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator path (draw every step, select dead columns on the device) gives the
    CPU path's result whenever no column is dead (up to rounding: the selected Q is laid
    out row-major, the warm one column-major), and still revives dead columns."""
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    cpu_path, device_path = PowerSGD(rank=3), PowerSGD(rank=3)
    monkeypatch.setattr(device_path, "_branch_free", lambda device: True)
    for _ in range(3):
        a, b = cpu_path.compress(x), device_path.compress(x)
        for name in a.tensors:
            torch.testing.assert_close(a.tensors[name], b.tensors[name], msg=name)
    # an all-zero gradient kills every column of Q; the next step redraws them
    device_path.compress(torch.zeros(64, 33))
    assert not device_path.state_dict()["q"].any()
    revived = device_path.compress(x)
    assert device_path.state_dict()["q"].abs().sum(dim=0).gt(0).all()
    assert torch.linalg.vector_norm(device_path.decompress(revived)) > 0


@pytest.fixture
def loopback_all_to_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """raycomp._internal.fsdp.reduce_scatter's collective without a process group: two ranks whose all-to-all
    hands every row back unchanged (device-agnostic, meta tensors included)."""
    import raycomp._internal.fsdp.reduce_scatter as sharded

    monkeypatch.setattr(sharded.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(sharded.dist, "all_to_all_single",
                        lambda output, input, group=None: output.copy_(input))


@pytest.mark.parametrize("name", ["int8", "sign", "bf16", "qsgd"])
@pytest.mark.usefixtures("meta_generators", "loopback_all_to_all")
def test_sharded_reduce_scatter_follows_the_input_device_without_waiting_for_it(name: str) -> None:
    from raycomp._internal.fsdp.reduce_scatter import CompressedReduceScatter

    comm = CompressedReduceScatter(CompressorSpec.of(name), name="unit")
    for _ in range(2):  # the second call compensates with the residual (sign)
        out = torch.empty(4099, device=META)
        comm(out, torch.empty(2 * 4099, device=META), None, torch.distributed.ReduceOp.AVG)
    assert comm.residual is None or comm.residual.device == META


@pytest.mark.usefixtures("meta_generators", "loopback_all_to_all")
def test_sharded_residual_from_a_cpu_checkpoint_follows_the_gradient_device() -> None:
    """A checkpoint loaded with map_location="cpu" resumes on CUDA (first seen on an H100:
    'Expected all tensors to be on the same device' in CompressedReduceScatter.__call__)."""
    from raycomp._internal.fsdp.reduce_scatter import CompressedReduceScatter

    trained = CompressedReduceScatter(CompressorSpec.of("sign"), name="unit")
    trained(torch.empty(500), torch.randn(1000), None, torch.distributed.ReduceOp.AVG)
    state = trained.state_dict()
    assert state["residual"].device.type == "cpu"
    resumed = CompressedReduceScatter(CompressorSpec.of("sign"), name="unit")
    resumed.load_state_dict(state)
    out = torch.empty(500, device=META)
    resumed(out, torch.empty(1000, device=META), None, torch.distributed.ReduceOp.AVG)
    assert resumed.residual is not None and resumed.residual.device == META


def test_the_gpu_tests_run_every_registered_compressor_and_every_transport() -> None:
    """tests/gpu takes each compressor's parameters from its own table: a compressor
    registered without an entry there fails every CUDA test it appears in (int4 did,
    KeyError, on the first H100 run after it was added)."""
    from raycomp.compressors import COMPRESSORS, Transport
    from tests.gpu import support

    assert set(support.PARAMS) == set(COMPRESSORS)
    for name, params in support.PARAMS.items():
        CompressorSpec.of(name, **params).build("layer", 0)  # valid parameters
    checked = {CompressorSpec.of(n, **support.PARAMS[n]).build("layer", 0).transport
               for n in support.TRANSPORT_PLANS.values()}
    assert checked == set(Transport)


def test_the_gpu_tests_build_the_shipped_transformer_with_torch_alone(tmp_path) -> None:
    """A GPU machine may have torch and pytest and nothing else (no pydantic, PyYAML, Ray or
    KJV text there), so every module of tests/gpu imports without them, and the tests build
    gpt_kjv's transformer from its sizes: it must be the model the shipped config trains,
    weights included."""
    from jobs.workloads import model_of

    out = tmp_path / "model.pt"
    modules = sorted(f"tests.gpu.{p.stem}" for p in (REPO / "tests" / "gpu").glob("*.py") if p.stem != "__init__")
    code = ("import importlib, sys\n"
            "for name in ('pydantic', 'yaml', 'ray'): sys.modules[name] = None  # import fails\n"
            f"for module in {modules!r}: importlib.import_module(module)\n"
            "import torch\nfrom tests.gpu.models import kjv_transformer\n"
            f"torch.save(kjv_transformer(torch.device('cpu')).state_dict(), {str(out)!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    built, shipped = torch.load(out), model_of("gpt_kjv").state_dict()
    assert built.keys() == shipped.keys()
    assert all(torch.equal(built[k], shipped[k]) for k in built)


def agree(device: torch.device, rank: int, world: int) -> str:
    """A two-rank check that passes: every rank sums the ranks."""
    total = torch.tensor([float(rank)], device=device)
    torch.distributed.all_reduce(total)
    assert total.item() == world * (world - 1) / 2
    return f"rank {rank} of {world}"


def fails_on_the_last_rank(device: torch.device, rank: int, world: int, message: str) -> str:
    assert rank < world - 1, message
    return ""


def skipped(device: torch.device, rank: int, world: int) -> str:
    pytest.skip("not on this machine")


def dies_on_the_last_rank(device: torch.device, rank: int, world: int) -> str:
    if rank == world - 1:
        os._exit(3)
    return ""


def test_the_gpu_tests_two_rank_runner_reports_what_each_rank_saw(tmp_path) -> None:
    """tests/gpu runs a module's two-rank checks in one spawned pair (here on CPU tensors):
    a test passes only if both ranks passed its check, fails with the failing rank's error,
    is skipped where rank 0 skipped, and fails where a rank never reported (the pair died)."""
    from tests.gpu.ranks import Check, spawn_two_ranks

    checks = [Check(agree), Check(fails_on_the_last_rank, {"message": "boom"}), Check(skipped),
              Check(dies_on_the_last_rank), Check(fails_on_the_last_rank, {"message": "after"})]
    pair = spawn_two_ranks(checks, tmp_path, torch.device("cpu"))
    assert pair.run(checks[0]) == "rank 0 of 2"
    with pytest.raises(pytest.fail.Exception, match="rank 1: AssertionError: boom"):
        pair.run(checks[1])
    with pytest.raises(pytest.skip.Exception, match="not on this machine"):
        pair.run(checks[2])
    with pytest.raises(pytest.fail.Exception, match="rank 1 never reported .*exit code 3"):
        pair.run(checks[4])
    assert pair.failure(checks[0]) == ""


def test_the_sharded_control_row_is_built_on_the_gradient_device_without_waiting_for_it() -> None:
    """FSDP's last unit carries this row; built on the CPU it read the norm and copied the
    row back, two device-to-host waits a step on CUDA. On meta, any such read raises."""
    from raycomp._internal.fsdp.state import control_row

    row = control_row([3.0, 1.0, 0.5], torch.zeros((), device=META))
    assert row.device == META and row.dtype == torch.float32 and row.shape == (5,)
    values = control_row([3.0, 1.0, 0.5], torch.tensor(4.0)).tolist()
    assert values == [0.0, 3.0, 1.0, 0.5, 4.0]
    assert control_row([], torch.tensor(float("inf"))).tolist()[0] == 1.0  # the non-finite flag
