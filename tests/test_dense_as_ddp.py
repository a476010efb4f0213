"""A dense plan trains exactly as plain DDP, on a real local Ray (2 workers, gloo).

The same seeded model (with BatchNorm, SGD with momentum, each rank its own batches) is
trained twice in one worker group: through ``ray.train.torch.prepare_model`` and
``optimizer.step()``, and through ``raycomp.train`` held dense (the static ``none`` plan).
At one step the loss, and with it the gradient, is multiplied a thousandfold: plain DDP
applies that step, and so must raycomp, whose guard would once have called it an explosion
and skipped it. After every step each rank's parameters and buffers must be bit for bit
the same in both runs.
"""

from __future__ import annotations

import pytest
import torch

STEPS = 30
BLOW_UP_STEP = 20  # the step whose loss (and gradient) is multiplied by 1000


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def _batches(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        yield step, torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    module = getattr(model, "module", model)
    return [t.detach().clone() for t in [*module.parameters(), *module.buffers()]]


def _twice(config: dict) -> dict:
    import ray.train
    import ray.train.torch

    import raycomp.train
    from raycomp.config import CompressionSection, ControllerSection, compressor
    from raycomp.controllers.policies import StaticOptions

    rank = ray.train.get_context().get_world_rank()
    runs = {}
    for name in ("ddp", "raycomp"):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if name == "ddp":
            model = ray.train.torch.prepare_model(model)
        else:
            options = raycomp.train.TrainOptions(
                compression=CompressionSection(policy="static", static=StaticOptions(compressor=compressor("none"))),
                controller=ControllerSection(name=config["controller"], interval_steps=5),
                output_dir=config["output_dir"], run_id=f"{config['run_id']}-raycomp")
            model = raycomp.train.prepare_model(model, optimizer, options=options)
        after, applied = [], []
        for step, x, y in _batches(rank):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y) * (1000.0 if step == BLOW_UP_STEP else 1.0)
            loss.backward()
            if name == "ddp":
                optimizer.step()
                applied.append(True)
            else:
                applied.append(raycomp.train.step(loss, samples=len(y)))
            after.append(_snapshot(model))
        if name == "raycomp":
            loop = raycomp.train.current()
            runs["events"] = list(loop.judge.guard.events)
            runs["skipped"] = loop.skipped_steps
            # every rank read its preemption notice at every agreement, the same number of times
            asked = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
            torch.distributed.all_gather(asked, torch.tensor([loop.preemption.asked]))
            runs["asked"] = [int(a) for a in asked]
            runs["boundaries"] = sum(loop.handoff.agrees_at(s) for s in range(1, STEPS + 1))
            raycomp.train.finish()
        runs[name] = (after, applied)
    (ddp, _), (ours, applied) = runs["ddp"], runs["raycomp"]
    differ = [step for step in range(STEPS) if not all(torch.equal(a, b) for a, b in zip(ddp[step], ours[step],
                                                                                          strict=True))]
    return {"differ": differ, "applied": applied, "events": runs["events"], "skipped": runs["skipped"],
            "asked": runs["asked"], "boundaries": runs["boundaries"],
            "last": [t.tolist() for t in ours[-1]]}


IN_TURN = {"twice": _twice}


@pytest.fixture(scope="module")
def twice(in_turn):
    return in_turn["twice"]["value"]


def test_a_dense_plan_trains_bit_for_bit_as_plain_ddp_after_every_step(twice):
    assert twice["differ"] == []


def test_a_thousandfold_gradient_under_a_dense_plan_is_applied_and_raises_no_guard_event(twice):
    assert all(twice["applied"]) and twice["skipped"] == 0
    assert twice["events"] == []


def test_every_rank_reads_its_preemption_notice_at_every_agreement_the_same_number_of_times(twice):
    assert twice["boundaries"] >= 5
    assert twice["asked"] == [twice["boundaries"]] * 2
