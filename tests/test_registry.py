"""User-defined compressors and policies: registered by name or named by import path,
used in real gloo processes (compressor) and through the real controller actor (policy)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from jobs import config as job_config
from raycomp import compressors, config
from raycomp._internal.wire.payload import Payload
from raycomp.compressors import Compressor, Transport, make_compressor
from raycomp.config.policy_options import POLICY_OPTIONS
from raycomp.controllers.policies import (
    POLICIES,
    REGISTRY,
    Decision,
    Policy,
    Said,
    make_policy,
    register_policy,
    unregister_policy,
)
from raycomp.controllers.policies.base import compressible_layers
from raycomp.controllers.state import RunState
from raycomp.messages import GradStats
from raycomp.plan import CompressorSpec, Plan
from raycomp.train import TrainOptions
from tests.distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]


class ScaledHalf(Compressor):
    """fp16 payload of ``x * scale`` (summable: one all-reduce), a user's compressor."""

    name = "scaled_half"
    transport = Transport.ALLREDUCE

    def __init__(self, scale: float = 1024.0) -> None:
        if not scale > 0:
            raise ValueError(f"scale: must be > 0, got {scale!r}")
        self.scale = float(scale)

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        return Payload({"values": (flat * self.scale).half()}, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return (payload.tensors["values"].to(payload.dtype) / self.scale).reshape(payload.shape)


# at module level: every process that imports this module (the spawned gloo ranks, the
# controller actor importing LargestLayers below) has the name too
compressors.register("scaled_half", ScaledHalf)


class LargestOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: how many of the largest layers to compress
    count: Annotated[int, Field(ge=1)] = 1
    compressor: str = "scaled_half"


class LargestLayers(Policy):
    """Compress the ``count`` largest compressible layers with ``compressor``."""

    name = "largest"
    options_model = LargestOptions

    options: LargestOptions

    def decide(self, run: RunState) -> Decision:
        layers = sorted(compressible_layers(run, self.min_numel), key=lambda n: -run.layers[n].numel)
        chosen = layers[: self.options.count]  # the typed options: an instance of LargestOptions
        spec = CompressorSpec.of(self.options.compressor)
        return Decision.of(Plan.per_layer(dict.fromkeys(chosen, spec)),
                           Said("largest", f"largest {len(chosen)}: {', '.join(chosen)}"))


# --- compressors ----------------------------------------------------------------------------
def _grads(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return {"a": torch.randn(64, 32, generator=gen), "b": torch.randn(2048, generator=gen),
            "c": torch.randn(16, 128, generator=gen)}


def _reduce_on_ranks(rank: int, world_size: int, plan: Plan) -> dict[str, Any]:
    from raycomp._internal.reduce.reducer import CompressedReducer

    grads = _grads(rank)
    reducer = CompressedReducer(plan, min_compress_numel=1024, stats_every=1)
    out = reducer.reduce(list(grads), list(grads.values()))
    return {"mean": dict(zip(grads, out, strict=True)), "kinds": {s.layer: s.compressor for s in reducer.stats},
            "wire_total": reducer.ledger.wire_total, "dense_total": reducer.ledger.dense_total}


def test_registered_and_import_path_compressors_run_in_real_gloo_processes():
    plan = Plan.per_layer({
        "a": CompressorSpec.of("scaled_half", scale=256.0),  # the registered name
        "b": CompressorSpec.of("tests.test_registry:ScaledHalf"),  # by import path
    })  # "c" stays dense
    results = run_distributed(_reduce_on_ranks, 2, plan)
    expected = {name: (_grads(0)[name] + _grads(1)[name]) / 2 for name in ("a", "b", "c")}
    for result in results:
        assert result["kinds"] == {"a": "scaled_half", "b": "scaled_half", "c": "none"}
        torch.testing.assert_close(result["mean"]["c"], expected["c"])  # dense: exact
        for name in ("a", "b"):  # fp16 rounding of x * scale: close, not equal
            assert not torch.equal(result["mean"][name], expected[name])
            torch.testing.assert_close(result["mean"][name], expected[name], atol=2e-3, rtol=1e-3)
        # fp16 payloads: half the dense bytes for a and b
        dense = 4 * (64 * 32 + 2048 + 16 * 128)
        assert result["dense_total"] == dense
        assert result["wire_total"] == 2 * (64 * 32 + 2048) + 4 * 16 * 128
    torch.testing.assert_close(results[0]["mean"]["a"], results[1]["mean"]["a"], rtol=0, atol=0)


def test_registered_compressors_validate_parameters_like_built_ins():
    assert make_compressor("scaled_half", scale=2.0).scale == 2.0
    with pytest.raises(ValueError, match=r"^compressor 'scaled_half': unknown parameter 'ratio'; allowed: scale$"):
        CompressorSpec.of("scaled_half", ratio=0.1)
    with pytest.raises(ValueError, match=r"^scale: must be > 0, got -1$"):
        CompressorSpec.of("tests.test_registry:ScaledHalf", scale=-1)
    assert compressors.registered()["scaled_half"] == "tests.test_registry:ScaledHalf"


@pytest.mark.parametrize(("call", "message"), [
    (lambda: make_compressor("nope"),
     r"^compressor: unknown name 'nope'; allowed: .*topk, .*scaled_half, or an import path 'package.module:Class'$"),
    (lambda: compressors.register("topk", ScaledHalf), r"^compressor name 'topk' is built in; choose another name$"),
    (lambda: compressors.register("bad name", ScaledHalf), r"^compressor name 'bad name': expected letters"),
    (lambda: compressors.register("x", dict), r"^compressor 'x': <class 'dict'> is not a subclass of raycomp"),
    (lambda: compressors.register("x", Compressor), r"^compressor 'x': Compressor does not implement _compress, decompress$"),
    (lambda: compressors.register("x", "not a path"), r"^compressor 'x': 'not a path' is not an import path"),
    (lambda: compressors.register("scaled_half", "tests.test_registry:Other"),
     r"^compressor name 'scaled_half' is already registered to tests.test_registry:ScaledHalf; pass replace=True"),
    (lambda: make_compressor("no_such_module_xyz:Thing"),
     r"^compressor 'no_such_module_xyz:Thing': cannot import 'no_such_module_xyz' \(No module named"),
    (lambda: make_compressor("tests.test_registry:Missing"),
     r"^compressor 'tests.test_registry:Missing': module 'tests.test_registry' has no 'Missing'$"),
    (lambda: make_compressor("tests.test_registry:LargestOptions"),
     r"^compressor 'tests.test_registry:LargestOptions': .* is not a subclass of raycomp.compressors.Compressor$"),
])
def test_registration_errors_are_one_line_and_name_what_is_allowed(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_a_compressor_without_name_or_transport_is_refused():
    class NoTransport(ScaledHalf):
        transport = None  # type: ignore[assignment]

    with pytest.raises(ValueError, match=r"^compressor 'y': NoTransport must set the class attributes 'name'"):
        compressors.register("y", NoTransport)


def test_register_again_is_idempotent_and_replace_and_unregister_work():
    compressors.register("scaled_half", ScaledHalf)  # the module is imported again: no error
    compressors.register("tmp_cast", "raycomp.compressors.casts:Fp16")
    try:
        assert type(make_compressor("tmp_cast")).__name__ == "Fp16"
        compressors.register("tmp_cast", "raycomp.compressors.casts:Bf16", replace=True)
        assert type(make_compressor("tmp_cast")).__name__ == "Bf16"
    finally:
        compressors.unregister("tmp_cast")
    with pytest.raises(ValueError, match=r"^compressor name 'tmp_cast' is not registered; registered: scaled_half$"):
        compressors.unregister("tmp_cast")
    assert "tmp_cast" not in compressors.COMPRESSORS and "scaled_half" not in compressors.COMPRESSORS


# --- policies ---------------------------------------------------------------------------------
@pytest.fixture
def largest():
    register_policy("largest", LargestLayers)
    yield
    unregister_policy("largest")


def test_registered_policy_in_a_job_config_becomes_its_import_path(largest):
    job = job_config.validate({"compression": {"policy": "largest", "custom_options": {"count": 2}}})
    assert job.compression.policy == "tests.test_registry:LargestLayers"  # what the controller imports
    assert job.compression.policy_options() == {"count": 2}  # as given: the controller validates them
    # workers validate the dumped config again: the path passes there without the registration
    unregister_policy("largest")
    again = job_config.validate(job.model_dump(mode="json"))
    assert again.compression.policy == "tests.test_registry:LargestLayers"
    register_policy("largest", LargestLayers)


def test_the_registry_reaches_validation_only_when_the_validator_hands_it_over(largest):
    # registering (and importing the controller's policies) changes nothing in raycomp.config:
    # a section validated without the registry knows built-in names and import paths only
    data = {"policy": "largest", "custom_options": {"count": 0}}
    with pytest.raises(config.ConfigError, match=r"^compression\.policy: must be one of 'static', .*'adaptive' or an "
                                                 r"import path 'package\.module:Class' \(a name registered with "
                                                 r"raycomp\.controllers\.policies\.register_policy needs the registry: "
                                                 r"validate with context=raycomp\.config\.policy_context\(REGISTRY\)\), "
                                                 r"got 'largest'$"):
        config.CompressionSection(**data)
    path = {**data, "policy": "tests.test_registry:LargestLayers"}
    assert config.CompressionSection(**path).custom_options == {"count": 0}  # the controller checks them
    context = config.policy_context(REGISTRY)
    with pytest.raises(ValueError, match=r"custom_options\.count: Input should be greater than or equal to 1"):
        config.CompressionSection.model_validate(path, context=context)
    section = config.CompressionSection.model_validate({**data, "custom_options": {"count": 3}}, context=context)
    assert section.policy == "tests.test_registry:LargestLayers"
    # the Ray Train API's options hand it over when a section is given as a dict
    options = TrainOptions(compression={**data, "custom_options": {"count": 3}})
    assert options.compression.policy == "tests.test_registry:LargestLayers"


@pytest.mark.parametrize(("data", "message"), [
    ({"policy": "largest", "custom_options": {"count": 0}},
     r"^compression: custom_options\.count: Input should be greater than or equal to 1 \(got 0\)$"),
    ({"policy": "largest", "custom_options": {"cuont": 2}}, r"^compression: custom_options\.cuont: unknown key$"),
    ({"policy": "magic"}, r"^compression\.policy: must be one of 'static', .*'adaptive', a name registered with "
                          r"raycomp\.controllers\.policies\.register_policy, or an import path 'package\.module:Class', got 'magic'$"),
    ({"custom_options": {"count": 1}}, r"^compression: custom_options: only for policies that are not built in; "
                                       r"set compression\.adaptive\.<option> instead$"),
])
def test_policy_config_errors_are_one_line(largest, data, message):
    with pytest.raises(config.ConfigError, match=message):
        job_config.validate({"compression": data})


def test_policy_registration_errors(largest):
    with pytest.raises(ValueError, match=r"^policy name 'adaptive' is built in; choose another name$"):
        register_policy("adaptive", LargestLayers)
    with pytest.raises(ValueError, match=r"^policy 'z': <class 'dict'> is not a subclass of raycomp\.controllers\.policies\.Policy$"):
        register_policy("z", dict)
    class BadOptions(LargestLayers):
        options_model = 3  # type: ignore[assignment]

    with pytest.raises(ValueError, match=r"^policy 'z': BadOptions\.options_model must be a pydantic model class, got 3$"):
        register_policy("z", BadOptions)
    with pytest.raises(ValueError, match=r"^compression\.policy: unknown name 'zz'; allowed: static, .*adaptive, largest, "
                                         r"or an import path 'package\.module:Class'$"):
        make_policy("zz", {})
    with pytest.raises(ValueError, match=r"^compression\.custom_options\.count: Input should be greater"):
        make_policy("largest", {"count": 0})


def test_every_built_in_policy_takes_the_options_model_the_job_config_validates():
    # the config validates compression.<policy> with POLICY_OPTIONS, the controller with the
    # policy's options_model: a policy built on another model would get options it refuses
    assert {name: cls.options_model for name, cls in POLICIES.items()} == POLICY_OPTIONS
    assert set(config.CompressionSection().model_dump()) >= set(POLICY_OPTIONS)  # a section each


VALIDATE_WITHOUT_CONTROLLER = """
import sys
from raycomp.config import CompressionSection
section = CompressionSection.model_validate({"policy": "static", "static": {"compressor": {"name": "int8"}}})
print(section.policy_options(), any(m.startswith("raycomp.controllers") for m in sys.modules))
"""


def test_the_job_config_validates_built_in_policies_without_the_controller():
    out = subprocess.run([sys.executable, "-c", VALIDATE_WITHOUT_CONTROLLER], capture_output=True, text=True,
                         timeout=120, cwd=REPO, check=True)
    assert out.stdout.split()[-1] == "False", out.stdout  # controllers never imported
    assert "'int8'" in out.stdout, out.stdout


def _stats(run_id: str, rank: int, step: int) -> dict[str, Any]:
    layers = [{"layer": n, "compressor": "none", "numel": numel, "grad_norm": 1.0, "compression_error": 0.0,
               "residual_norm": 0.0, "wire_bytes": 0.0, "dense_bytes": 0.0} for n, numel in LAYERS.items()]
    return GradStats(run_id=run_id, rank=rank, step=step, epoch=0, plan_version=0, loss=1.0, step_seconds=0.1,
                     compute_seconds=0.05, comm_seconds=0.05, samples_per_second=10.0, wire_bytes=0.0,
                     dense_bytes=0.0, layers=tuple(layers)).to_dict()


LAYERS = {"big": 8192, "mid": 4096, "small": 100}


def test_custom_policy_through_the_real_controller_actor(ray_cluster, tmp_path):
    from raycomp.controllers.service import get_or_create

    ray = ray_cluster
    actor = get_or_create(f"registry-{uuid.uuid4().hex[:8]}", "raycomp-tests", str(tmp_path / "snapshots"),
                          metrics=None)
    try:
        # the actor process has no registration: the import path is what reaches it, and
        # importing the module there registers the 'scaled_half' compressor the plan names
        path = "tests.test_registry:LargestLayers"
        plan = ray.get(actor.register_run.remote("custom", 2, LAYERS, path, {"count": 1}, 10, 5, 1024))
        assert plan["layers"] == {} and plan["reason"] == "warm-up: dense"
        for step in (4, 9):
            for rank in range(2):
                assert ray.get(actor.ingest.remote(_stats("custom", rank, step)))
        plan = ray.get(actor.plan.remote("custom", 0))
        assert plan["layers"] == {"big": {"name": "scaled_half"}}
        assert plan["reason"] == "largest 1: big"
        assert ray.get(actor.summary.remote("custom"))["policy"] == path
        with pytest.raises(Exception, match=r"compression\.custom_options\.count: Input should be greater than "
                                            r"or equal to 1 \(got 0\)"):
            ray.get(actor.register_run.remote("bad", 2, LAYERS, path, {"count": 0}, 10, 5, 1024))
    finally:
        ray.kill(actor)


# --- a new policy: one file plus its registration -----------------------------------------------
@pytest.fixture
def ramp():
    register_policy("ramp", "tests.support.ramp_policy:RampPolicy")
    yield
    unregister_policy("ramp")


def test_a_new_policy_with_typed_options_is_one_file_and_its_registration(ramp):
    from raycomp.controllers.service import Controller
    from tests.support.ramp_policy import RampOptions

    job = job_config.validate({"compression": {"policy": "ramp", "custom_options": {"start_ratio": 0.2, "every_steps": 10}}})
    assert job.compression.policy == "tests.support.ramp_policy:RampPolicy"  # what the controller imports
    options = job.compression.policy_options()
    assert options == {"start_ratio": 0.2, "every_steps": 10}  # as given: the controller validates them
    for bad, message in [({"every_steps": 0}, r"custom_options\.every_steps: Input should be greater than or equal "
                                              r"to 1 \(got 0\)"),
                         ({"start_ratio": 0.2, "min_ratio": 0.5}, r"custom_options\.min_ratio: must be <= "
                                                                  r"start_ratio \(0\.2\), got 0\.5"),
                         ({"every_step": 5}, r"custom_options\.every_step: unknown key")]:
        with pytest.raises(config.ConfigError, match=rf"^compression: {message}$") as info:
            job_config.validate({"compression": {"policy": "ramp", "custom_options": bad}})
        assert "\n" not in str(info.value)
    # the controller's decide path: the policy gets its typed options
    controller = Controller()
    controller.register_run("ramp", 2, LAYERS, job.compression.policy, options, 0, 5, 1024)
    policy = controller.policies["ramp"].inner
    assert isinstance(policy.options, RampOptions) and policy.options.every_steps == 10
    for step in (4, 9, 14, 19):
        for rank in range(2):
            assert controller.ingest(_stats("ramp", rank, step))
        plan = Plan.from_dict(controller.plan("ramp"))
        expected = 0.2 / 2 ** ((step + 1) // 10)
        assert plan.reason == f"ramp: topk {expected:g}"
        assert dict(plan.layers) == dict.fromkeys(("big", "mid"), CompressorSpec.of("topk", ratio=expected))
    with pytest.raises(ValueError, match=r"^compression\.custom_options\.every_steps: Input should be greater"):
        controller.register_run("bad", 2, LAYERS, job.compression.policy, {"every_steps": 0}, 0, 5, 1024)
