"""A plan the controller decides at a control boundary is in force on every rank a few steps
later, not one control interval later: rank 0 checks for the answer every step, and its
version rides to every rank inside the next step's gradient collective (real Ray, 2 gloo
workers)."""

from __future__ import annotations

import time

import torch

from tests.test_train_job import step_logs

K, WARMUP = 10, 4


def _train(config: dict) -> dict:
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
        controller=ControllerSection(name=config["controller"], interval_steps=K),
        output_dir=config["output_dir"], run_id=config.get("run_id"))
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    gen = torch.Generator().manual_seed(rank)
    for _ in raycomp.train.current().epochs(1, 3 * K):
        for _ in range(3 * K):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            time.sleep(0.05)  # a step's compute: the controller's answer takes a few ms
            raycomp.train.step(loss, samples=len(y))
    return raycomp.train.finish()


#: trained in the session's shared fit (tests/support/runs_in_turn.py)
IN_TURN = {"latency": _train}


def test_a_plan_decided_at_a_boundary_is_in_force_within_a_few_steps_on_every_rank(in_turn):
    totals = in_turn["latency"]["value"]
    assert totals["steps"] == 3 * K
    logs = step_logs(in_turn["latency"]["output_dir"])
    first = [next(r["step"] for r in records if not r["dense"]) for records in logs]
    # the statistics of the boundary after the warm-up (step K - 1) make the controller decide;
    # the plan then reaches every rank at the same step, well before the next boundary (2K)
    assert first[0] == first[1]
    assert K < first[0] <= K + 4, first
    for mine, theirs in zip(*logs, strict=True):
        assert mine["plan_digest"] == theirs["plan_digest"]
