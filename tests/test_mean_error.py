"""The applied mean's compression error (raycomp._internal.reduce.mean_error), on real gloo processes: flat at
W = 2 and 4 (int4's scalable route quantizes once at two ranks, twice at four) and in two
levels at 2 nodes x 2 ranks, every layer small enough that its sample is the whole layer (or
piece), so the measure must equal the exact ``||applied - mean|| / ||mean||`` computed here
from a dense all-reduce of every rank's gradient; and every rank gets the same numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from raycomp._internal.reduce.mean_error import SAMPLES
from tests.distributed import run_distributed

SHAPES = {"a": (8, 12), "b": (12, 4), "c": (100,)}  # every layer (and piece) <= SAMPLES elements


def _grads(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(17 + rank)
    # heavy-tailed, as late gradients are: a few large entries among small ones
    return [torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(4) for shape in SHAPES.values()]


def _measured(rank: int, world: int, spec: str, levels: bool) -> dict:
    from raycomp._internal.reduce.mean_error import layer_errors
    from raycomp._internal.reduce.reducer import CompressedReducer
    from raycomp._internal.reduce.two_level import TwoLevelReducer
    from raycomp._internal.topology import Topology, node_groups
    from raycomp.plan import Plan

    plan = Plan.uniform(spec)
    if levels:
        two = node_groups(Topology.of_rank(rank, 2, world // 2))
        reducer, position = TwoLevelReducer(two, plan, min_compress_numel=0, stats_every=1), two.intra.rank
    else:
        reducer, position = CompressedReducer(plan, min_compress_numel=0, stats_every=1), 0
    names, grads = list(SHAPES), _grads(rank)
    applied = reducer.reduce(names, [g.clone() for g in grads], closes_step=True)
    reducer.end_step()
    measured = layer_errors(reducer.mean_samples, names, position)
    exact = {}
    for name, grad, mean in zip(names, grads, applied, strict=True):
        total = grad.double().clone()
        dist.all_reduce(total)
        total /= world  # the first step: no residual yet, so the inputs are the gradients
        exact[name] = float((mean.double() - total).norm() / total.norm())
    own = {s.layer: s.compression_error for s in reducer.stats}
    return {"measured": measured, "exact": exact, "own": own}


@pytest.mark.parametrize("world,spec,levels", [(2, "int4", False), (4, "int4", False), (4, "int4", True),
                                               (3, "sign", False), (2, "topk", False)])
def test_the_measure_is_the_exact_error_of_the_applied_mean_on_every_rank(world, spec, levels):
    assert all(math.prod(shape) <= SAMPLES for shape in SHAPES.values())
    ranks = run_distributed(_measured, world, spec, levels)
    first = ranks[0]["measured"]
    assert set(first) == set(SHAPES)
    assert all(r["measured"] == first for r in ranks)  # the same numbers on every rank
    for name in SHAPES:
        assert first[name] == pytest.approx(ranks[0]["exact"][name], rel=1e-5, abs=1e-7), name


def test_an_unbiased_compressor_is_not_measured():
    # QSGD runs without error feedback: its error is variance by design, far above 1 on
    # healthy runs, and the guard does not judge it
    assert all(r["measured"] == {} for r in run_distributed(_measured, 2, "qsgd", False))


# --- through raycomp.train: the guard judges it at the agreement --------------------------
def _train(config: dict, threshold: float) -> dict:
    import ray.train

    import raycomp.train
    from raycomp.config import CompressionSection, ControllerSection, GuardSection, compressor
    from raycomp.controllers.policies import StaticOptions

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    options = raycomp.train.TrainOptions(
        compression=CompressionSection(policy="static", warmup_steps=2, min_compress_numel=256,
                                       static=StaticOptions(compressor=compressor("int4")),
                                       guard=GuardSection(max_compression_error=threshold)),
        controller=ControllerSection(name=config["controller"], interval_steps=5),
        output_dir=config["output_dir"], run_id=config["run_id"])
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    loop = raycomp.train.current()
    gen = torch.Generator().manual_seed(rank)
    compressed = []  # the steps that ran under a compressed plan
    for step in range(30):
        if not loop.state.plan.trains_as_ddp:
            compressed.append(step)
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        raycomp.train.step(loss, samples=len(y))
    events = [e.to_dict() for e in loop.judge.guard.events]
    raycomp.train.finish()
    return {"events": events, "compressed": compressed}


def _strict(config: dict) -> dict:
    return _train(config, 0.05)


def _default(config: dict) -> dict:
    from raycomp.config import GuardSection

    return _train(config, GuardSection().max_compression_error)


IN_TURN = {"strict": _strict, "default": _default}


@pytest.fixture(scope="module")
def trained(in_turn):
    return {name: in_turn[name]["value"] for name in IN_TURN}


def test_a_mean_error_over_the_threshold_falls_back_at_the_agreement_after_its_statistics_step(trained):
    from raycomp._internal.train.plan_handoff import ANSWER_STEPS

    events, compressed = trained["strict"]["events"], trained["strict"]["compressed"]
    assert events and events[0]["kind"] == "fallback" and events[0]["reason"] == "compression_error"
    # measured at the first compressed statistics step (the step before a boundary, K = 5),
    # judged at the agreement ANSWER_STEPS steps after that boundary: dense from the next step
    measured = next(s for s in compressed if (s + 1) % 5 == 0)
    assert events[0]["step"] == measured + ANSWER_STEPS, (events, compressed)
    assert events[0]["detail"].endswith(f", step {measured})"), events


def test_a_healthy_int4_run_raises_no_guard_event_at_the_default_threshold(trained):
    assert trained["default"]["events"] == []
