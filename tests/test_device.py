"""Device propagation, checked without a GPU (the CUDA run is jobs/gpu_check.py).

Tensors on the ``meta`` device have a shape, a dtype and a device but no data. A
compressor run on meta tensors therefore shows (a) that every tensor it creates follows
the input's device (a ``torch.zeros(n)`` without ``device=`` would come out on the CPU),
and (b) that it makes no host sync: reading a meta tensor's value (``bool(t)``,
``t.item()``, ``if norm > eps``) raises. On a GPU each such read stalls the stream.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raycomp.compressors import PowerSGD
from raycomp.compressors.base import SeededDraws
from raycomp.payload import Payload, pack, unpack_like
from raycomp.plan import CompressorSpec

REPO = Path(__file__).resolve().parents[1]

META = torch.device("meta")

# compressors whose compress and decompress must be free of host syncs; the others
# (randomk: torch.unique, threshold and sampled dgc_topk: torch.nonzero) produce
# data-dependent sizes, which needs one sync by construction
SYNC_FREE = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "topk": {"ratio": 0.01},
    "qsgd": {"levels": 7, "bucket_size": 128},
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


@pytest.mark.parametrize("name", sorted(SYNC_FREE))
@pytest.mark.parametrize("shape", [(64, 33), (8, 4, 3, 3), (1000,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("meta_generators")
def test_compressor_follows_the_input_device_without_host_syncs(
    name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    compressor = CompressorSpec.of(name, **SYNC_FREE[name]).build("layer", 0)
    reference = CompressorSpec.of(name, **SYNC_FREE[name]).build("layer", 0)
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


def test_powersgd_sync_free_path_matches_the_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator path (draw every step, select dead columns on the device) gives the
    CPU path's result whenever no column is dead (up to rounding: the selected Q is laid
    out row-major, the warm one column-major), and still revives dead columns."""
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    cpu_path, device_path = PowerSGD(rank=3), PowerSGD(rank=3)
    monkeypatch.setattr(device_path, "_sync_free", lambda device: True)
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
    """raycomp.sharded's collective without a process group: two ranks whose all-to-all
    hands every row back unchanged (device-agnostic, meta tensors included)."""
    import raycomp.sharded as sharded

    monkeypatch.setattr(sharded.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(sharded.dist, "all_to_all_single",
                        lambda output, input, group=None: output.copy_(input))


@pytest.mark.parametrize("name", ["int8", "sign", "bf16", "qsgd"])
@pytest.mark.usefixtures("meta_generators", "loopback_all_to_all")
def test_sharded_reduce_scatter_follows_the_input_device_without_host_syncs(name: str) -> None:
    from raycomp.sharded import CompressedReduceScatter

    comm = CompressedReduceScatter(CompressorSpec.of(name), name="unit")
    for _ in range(2):  # the second call compensates with the residual (sign)
        out = torch.empty(4099, device=META)
        comm(out, torch.empty(2 * 4099, device=META), None, torch.distributed.ReduceOp.AVG)
    assert comm.residual is None or comm.residual.device == META


@pytest.mark.usefixtures("meta_generators", "loopback_all_to_all")
def test_sharded_residual_from_a_cpu_checkpoint_follows_the_gradient_device() -> None:
    """A checkpoint loaded with map_location="cpu" resumes on CUDA (first seen on an H100:
    'Expected all tensors to be on the same device' in CompressedReduceScatter.__call__)."""
    from raycomp.sharded import CompressedReduceScatter

    trained = CompressedReduceScatter(CompressorSpec.of("sign"), name="unit")
    trained(torch.empty(500), torch.randn(1000), None, torch.distributed.ReduceOp.AVG)
    state = trained.state_dict()
    assert state["residual"].device.type == "cpu"
    resumed = CompressedReduceScatter(CompressorSpec.of("sign"), name="unit")
    resumed.load_state_dict(state)
    out = torch.empty(500, device=META)
    resumed(out, torch.empty(1000, device=META), None, torch.distributed.ReduceOp.AVG)
    assert resumed.residual is not None and resumed.residual.device == META


def test_the_gpu_check_runs_every_registered_compressor_and_every_transport() -> None:
    """jobs/gpu_check.py takes each compressor's parameters from its own table: a
    compressor registered without an entry there fails every CUDA row it appears in
    (int4 did, KeyError, on the first H100 run after it was added)."""
    from jobs import gpu_check
    from raycomp.compressors import COMPRESSORS, Transport

    assert set(gpu_check.PARAMS) == set(COMPRESSORS)
    for name, params in gpu_check.PARAMS.items():
        CompressorSpec.of(name, **params).build("layer", 0)  # valid parameters
    checked = {CompressorSpec.of(n, **gpu_check.PARAMS[n]).build("layer", 0).transport
               for n in gpu_check.TRANSPORT_PLANS.values()}
    assert checked == set(Transport)


def test_the_gpu_check_builds_the_shipped_transformer_with_torch_alone(tmp_path) -> None:
    """A GPU machine may have torch and nothing else (2026-11-25: no pydantic, PyYAML or KJV
    text there), so the check builds gpt_kjv's transformer from its sizes, and it must be
    the model the shipped config trains, weights included."""
    from jobs.workloads import model_of

    out = tmp_path / "model.pt"
    code = ("import sys\n"
            "for name in ('pydantic', 'yaml', 'ray'): sys.modules[name] = None  # import fails\n"
            "import torch\nfrom jobs.gpu_check import kjv_transformer\n"
            f"torch.save(kjv_transformer(torch.device('cpu')).state_dict(), {str(out)!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    built, shipped = torch.load(out), model_of("gpt_kjv").state_dict()
    assert built.keys() == shipped.keys()
    assert all(torch.equal(built[k], shipped[k]) for k in built)


def test_the_sharded_control_row_is_built_on_the_gradient_device_without_host_syncs() -> None:
    """FSDP's last unit carries this row; built on the CPU it read the norm and copied the
    row back, two host syncs a step on CUDA. On meta, any such read raises."""
    from raycomp.sharded_state import control_row

    row = control_row([3.0, 1.0, 0.5], torch.zeros((), device=META))
    assert row.device == META and row.dtype == torch.float32 and row.shape == (5,)
    values = control_row([3.0, 1.0, 0.5], torch.tensor(4.0)).tolist()
    assert values == [0.0, 3.0, 1.0, 0.5, 4.0]
    assert control_row([], torch.tensor(float("inf"))).tolist()[0] == 1.0  # the non-finite flag
