"""A plan the controller decides at a control boundary is in force on every rank a few steps
later, not one control interval later (real Ray, 2 gloo workers). With
``controller.dense_control: every_step`` rank 0 checks for the answer every step, and its
version rides to every rank inside the next step's gradient collective. With
``at_boundaries`` (the default) a dense step sends no control values: the ranks agree two
steps after the boundary, when the answer is in, and that agreement also brings the guard
the losses the dense steps left out."""

from __future__ import annotations

import time

import torch

from tests.support.step_logs import step_logs

K, WARMUP = 10, 4


def _train(config: dict, dense_control: str = "every_step") -> dict:
    import ray.train

    import raycomp.train
    from raycomp.config import CompressionSection, ControllerSection, compressor
    from raycomp.controllers.policies import StaticOptions

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    options = raycomp.train.TrainOptions(
        compression=CompressionSection(policy="static", warmup_steps=WARMUP,
                                       static=StaticOptions(compressor=compressor("int8"))),
        controller=ControllerSection(name=config["controller"], interval_steps=K, dense_control=dense_control),
        output_dir=config["output_dir"], run_id=config.get("run_id"))
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    gen = torch.Generator().manual_seed(rank)
    loop = raycomp.train.current()
    window = []  # the losses in the guard's window before each step
    for _ in loop.epochs(1, 3 * K):
        for _ in range(3 * K):
            window.append(len(loop.judge.guard.losses))
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            time.sleep(0.05)  # a step's compute: the controller's answer takes a few ms
            raycomp.train.step(loss, samples=len(y))
    return {**raycomp.train.finish(), "window": window}


def _train_at_boundaries(config: dict) -> dict:
    return _train(config, "at_boundaries")


#: trained in the session's shared fit (tests/support/runs_in_turn.py)
IN_TURN = {"latency": _train, "at_boundaries": _train_at_boundaries}


def test_a_plan_decided_at_a_boundary_is_in_force_within_a_few_steps_on_every_rank(in_turn):
    totals = in_turn["latency"]["value"]
    assert totals["steps"] == 3 * K
    logs = step_logs(in_turn["latency"]["output_dir"])
    first = [next(r["step"] for r in records if not r["dense"]) for records in logs]
    # the statistics of the boundary after the warm-up (step K - 1) make the controller decide;
    # the plan then reaches every rank at the same step, well before the next boundary (2K):
    # from step K when the answer is in by that boundary's own agreement, else a step later
    assert first[0] == first[1]
    assert K <= first[0] <= K + 4, first
    for mine, theirs in zip(*logs, strict=True):
        assert mine["plan_digest"] == theirs["plan_digest"]


def test_at_boundaries_the_ranks_agree_two_steps_after_the_boundary_and_the_plan_starts_there(in_turn):
    from raycomp._internal.train.plan_handoff import ANSWER_STEPS
    from raycomp.config import ControllerSection

    totals = in_turn["at_boundaries"]["value"]
    assert totals["steps"] == 3 * K
    logs = step_logs(in_turn["at_boundaries"]["output_dir"])
    first = [next(r["step"] for r in records if not r["dense"]) for records in logs]
    # decided after the boundary at K as above; no dense step announces it, the agreement
    # ANSWER_STEPS steps later hands it out, in force from the next step on every rank
    assert first == [K + ANSWER_STEPS] * 2, first
    for mine, theirs in zip(*logs, strict=True):
        assert mine["plan_digest"] == theirs["plan_digest"]
    # no dense step carried its loss, yet the guard holds them once the ranks agreed (after
    # the early first boundary, then after K's): the first compressed step is judged
    # against the losses of every dense step before the agreement's
    early = ControllerSection().first_interval_steps + ANSWER_STEPS
    window = totals["window"]
    assert window[:early] == [0] * early, window
    assert window[early:K + ANSWER_STEPS] == [early - 1] * (K + ANSWER_STEPS - early), window
    assert window[K + ANSWER_STEPS] == K + ANSWER_STEPS - 1, window
