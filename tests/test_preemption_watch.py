"""When a preemption notice calls for a checkpoint (raycomp.train.preemption), with Ray's own
``PreemptionInfo``: once per notice, again for a notice about another node, never without
the ask; what was answered survives a checkpoint. The drain of a real node: the long check
tests/test_preemption.py."""

from __future__ import annotations

from ray.train import PreemptionInfo

from raycomp.train.preemption import PreemptionWatch, ray_preemption_info


def test_each_notice_is_checkpointed_once_and_a_resumed_run_remembers_it():
    notices = iter([None, PreemptionInfo(deadline_ms=5_000, preempted_node_to_ranks={"b": [1]}),
                    PreemptionInfo(deadline_ms=5_000, preempted_node_to_ranks={"b": [1]}),
                    PreemptionInfo(deadline_ms=9_000, preempted_node_to_ranks={"b": [1], "c": [2]})])
    watch = PreemptionWatch(lambda: next(notices))
    assert [watch.checkpoint_due(step) for step in (10, 20, 30)] == [False, True, False]
    resumed = PreemptionWatch(lambda: PreemptionInfo(deadline_ms=5_000, preempted_node_to_ranks={"b": [1]}))
    resumed.load_state_dict(watch.state_dict())
    assert not resumed.checkpoint_due(40)  # the node the checkpoint answered: not again
    assert watch.checkpoint_due(40)  # a notice that adds a node: once more
    assert watch.asked == 4 and watch.handled == [["b"], ["b", "c"]]


def test_nothing_is_asked_when_off():
    watch = PreemptionWatch(None)
    assert not watch.checkpoint_due(10) and watch.asked == 0
    assert ray_preemption_info() is not None  # the installed Ray has the notice
