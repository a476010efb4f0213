"""The control boundary's agreement check (``raycomp._internal.train.plan_agreement.PlanAgreement.agree``) on two
real gloo processes: agreeing ranks get rank 0's offer from the same bytes; ranks that hold
different plans, or whose guards differ, both fail with ``PlanMismatchError`` at that
boundary instead of communicating under different plans. The same failure through a whole
Ray Train run is a long check (``test_faults.py``)."""

from __future__ import annotations

import pytest

from raycomp._internal.train.plan_agreement import PlanAgreement, PlanMismatchError
from raycomp.plan import Plan
from tests.distributed import run_distributed

INSTALLED = Plan.uniform("int8", version=3, reason="installed")
OFFER = Plan.uniform("int4", version=4, reason="the controller's newer plan")


def boundary(rank: int, world_size: int, case: str, odd: int = 1) -> dict:
    """One boundary; in ``case`` "plan" or "guard" rank ``odd`` holds another plan or guard."""
    plans = PlanAgreement(rank, world_size, None)
    installed, guard = INSTALLED, (0.0, 0.0, 0.0)
    if rank == odd and case == "plan":
        installed = Plan.uniform("int4", version=3, reason="installed")  # same version, other content
    if rank == odd and case == "guard":
        guard = (1.0, 0.0, 0.0)  # this rank skipped a step the others did not
    try:
        got = plans.agree(installed, guard, OFFER if rank == 0 else None, step=40).plan
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


def three_boundaries(rank: int, world_size: int) -> list[dict]:
    """Agreement, then the last rank alone on another plan, then alone with another guard
    state: three boundaries in one process group (a mismatch fails every rank alike, so the
    group stays usable)."""
    last = world_size - 1
    return [boundary(rank, world_size, "agree"), boundary(rank, world_size, "plan", last),
            boundary(rank, world_size, "guard", last)]


@pytest.mark.parametrize("world_size", [3, 4])
def test_past_two_ranks_every_rank_gets_the_offer_and_the_last_rank_out_of_step_fails_all(world_size):
    """At W > 2 the check still covers every rank: the last one alone on another plan, or with
    another guard state, fails every rank at the boundary (not only ranks 0 and 1)."""
    results = run_distributed(three_boundaries, world_size)
    assert [r[0] for r in results] == [{"plan": OFFER.to_json()}] * world_size
    for _, plan, guard in results:
        assert plan["error"].startswith("ranks disagree on the plan installed for step 40"), plan
        assert guard["error"].startswith("ranks' guards disagree at step 40"), guard
        assert f"rank {world_size - 1}: [1.0, 0.0, 0.0]" in guard["error"]


def late_losses(rank: int, world_size: int) -> list:
    """Two agreements carrying each rank's late losses (rank r's are r + 1, 2r + 2, ...),
    then one with a loss more on the last rank, counted in its guard state."""
    plans = PlanAgreement(rank, world_size, None, late_slots=4)
    own = [(rank + 1.0) * (i + 1) for i in range(3)]
    got = [plans.agree(INSTALLED, (0.0, 3.0), None, 40, own).late,
           plans.agree(INSTALLED, (0.0, 0.0), None, 50, []).late]
    extra = [1.0] if rank == world_size - 1 else []
    try:
        plans.agree(INSTALLED, (0.0, float(len(extra))), None, 60, extra)
    except PlanMismatchError as error:
        got.append(str(error))
    with pytest.raises(ValueError, match=r"^late: at most 4 values \(late_slots\), got 5$"):
        plans.agree(INSTALLED, (0.0, 5.0), None, 70, [1.0] * 5)
    return got


def test_an_agreement_carries_each_ranks_late_losses_and_hands_every_rank_their_means():
    """What dense steps left out of their collectives rides in the agreement's all-gather: every
    rank gets the same mean of each slot over the ranks; a rank with one more fails every rank."""
    results = run_distributed(late_losses, 3)
    # ranks' losses (1, 2, 3), (2, 4, 6), (3, 6, 9): means 2, 4, 6
    for late, none, mismatch in results:
        assert late == [2.0, 4.0, 6.0] and none == []
        assert mismatch.startswith("ranks' guards disagree at step 60"), mismatch
        assert "rank 2: [0.0, 1.0]" in mismatch


def preemption_notices(rank: int, world_size: int) -> list[float]:
    """Agreements where only the last rank holds a notice (of 2 nodes), then none does."""
    plans = PlanAgreement(rank, world_size, None, late_slots=0)
    mine = 2.0 if rank == world_size - 1 else 0.0
    return [plans.agree(INSTALLED, (0.0, 0.0), None, 40, notice=mine).notice,
            plans.agree(INSTALLED, (0.0, 0.0), None, 50).notice]


def test_a_preemption_notice_one_rank_holds_reaches_every_rank_in_the_agreement():
    # the notice rides in the all-gather that runs anyway; every rank gets the largest
    assert run_distributed(preemption_notices, 3) == [[2.0, 0.0]] * 3
