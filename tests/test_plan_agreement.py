"""The control boundary's agreement check (``raycomp.train.plan_agreement.PlanAgreement.agree``) on two
real gloo processes: agreeing ranks get rank 0's offer from the same bytes; ranks that hold
different plans, or whose guards differ, both fail with ``PlanMismatchError`` at that
boundary instead of communicating under different plans. The same failure through a whole
Ray Train run is a long check (``test_faults.py``)."""

from __future__ import annotations

from raycomp.plan import Plan
from raycomp.train.plan_agreement import PlanAgreement, PlanMismatchError
from raycomp.train.reporter import Outages
from tests.distributed import run_distributed

INSTALLED = Plan.uniform("int8", version=3, reason="installed")
OFFER = Plan.uniform("int4", version=4, reason="the controller's newer plan")


def boundary(rank: int, world_size: int, case: str) -> dict:
    plans = PlanAgreement(rank, world_size, None, None, "run", Outages())
    installed, guard = INSTALLED, (0.0, 0.0, 0.0)
    if rank == 1 and case == "plan":
        installed = Plan.uniform("int4", version=3, reason="installed")  # same version, other content
    if rank == 1 and case == "guard":
        guard = (1.0, 0.0, 0.0)  # rank 1 skipped a step the others did not
    try:
        got = plans.agree(installed, guard, OFFER if rank == 0 else None, step=40)
    except PlanMismatchError as error:
        return {"error": str(error)}
    return {"plan": None if got is None else got.to_json()}


def test_agreeing_ranks_each_get_rank_0s_offer():
    results = run_distributed(boundary, 2, "agree")
    assert results == [{"plan": OFFER.to_json()}] * 2


def test_ranks_on_different_plans_both_fail_at_the_boundary():
    results = run_distributed(boundary, 2, "plan")
    for result in results:
        assert result["error"].startswith("ranks disagree on the plan installed for step 40: "
                                          "rank 0: version 3, rank 1: version 3"), result


def test_ranks_whose_guards_differ_both_fail_at_the_boundary():
    results = run_distributed(boundary, 2, "guard")
    for result in results:
        assert result["error"].startswith("ranks' guards disagree at step 40"), result
        assert "rank 1: [1.0, 0.0, 0.0]" in result["error"]
