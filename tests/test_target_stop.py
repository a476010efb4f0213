"""workload.stop_at_target: the rule deciding when a run has held its target (one process); the
evaluation it reads, computed once on rank 0 (gloo processes)."""

from __future__ import annotations

import pytest

from jobs.train import TargetStop, evaluated_once
from tests.distributed import run_distributed


@pytest.mark.parametrize(("metrics", "lower", "stops_at"), [
    ([0.5, 0.7, 0.6, 0.8, 0.9], False, 4),  # accuracy >= 0.7: the miss at 0.6 resets the count
    ([0.7, 0.7], False, 1),  # reaching the target exactly counts
    ([2.0, 1.4, 1.6, 1.5, 1.2], True, 4),  # loss <= 1.5: 1.4 then 1.6 breaks it; 1.5, 1.2 holds
    ([0.69, 0.69, 0.69], False, None),
])
def test_stops_only_after_consecutive_evaluations_at_target(metrics, lower, stops_at):
    target = 1.5 if lower else 0.7
    rule = TargetStop(target, 2, lower_is_better=lower, group=None)
    decisions = [rule.held(m) for m in metrics]
    if stops_at is None:
        assert not any(decisions)
    else:
        assert decisions.index(True) == stops_at
    assert rule.stopped == (stops_at is not None)


def test_no_target_never_stops():
    rule = TargetStop(None, 1, lower_is_better=False, group=None)
    assert not any(rule.held(m) for m in [1.0, 1.0, 1.0])


def _evaluated(rank: int, world_size: int, sharded: bool) -> tuple[float, int]:
    calls = []

    def evaluate() -> float:
        calls.append(rank)
        return 0.25 + rank  # each replica its own value, to see whose arrives

    return evaluated_once(evaluate, rank, None, sharded=sharded), len(calls)


def test_rank_zero_evaluates_once_and_every_rank_gets_its_value():
    """On 3 gloo processes: rank 0 evaluates, the others take its value without evaluating;
    a sharded model (FSDP) evaluates on every rank, since its forward needs them all."""
    assert run_distributed(_evaluated, 3, False) == [(0.25, 1), (0.25, 0), (0.25, 0)]
    assert run_distributed(_evaluated, 3, True) == [(0.25, 1), (1.25, 1), (2.25, 1)]
