"""When a preemption notice calls for a checkpoint (raycomp._internal.train.preemption), with Ray's own
``PreemptionInfo``: a rank carries the number of nodes its notice names into the agreement;
the agreed number (the largest any rank carried) checkpoints once, and again only for a
notice that names more nodes; what was answered survives a checkpoint; nothing is read when
off. How the agreement combines the ranks' notices: tests/test_plan_agreement.py; a real
node drained and killed: the long check tests/test_preemption.py."""

from __future__ import annotations

from ray.train import PreemptionInfo

from raycomp._internal.train.preemption import PreemptionWatch, local_notice, ray_preemption_info


def test_a_rank_carries_the_nodes_its_notice_names():
    notices = iter([None, PreemptionInfo(deadline_ms=5_000, preempted_node_to_ranks={"b": [1], "c": [2]})])
    watch = PreemptionWatch(lambda: next(notices))
    assert [watch.notice(), watch.notice()] == [0.0, 2.0] and watch.asked == 2


def test_each_agreed_notice_is_checkpointed_once_and_a_resumed_run_remembers_it():
    watch = PreemptionWatch(lambda: None)
    assert [watch.checkpoint_due(n, step) for step, n in ((10, 0.0), (20, 1.0), (30, 1.0))] == [False, True, False]
    resumed = PreemptionWatch(lambda: None)
    resumed.load_state_dict(watch.state_dict())
    assert not resumed.checkpoint_due(1.0, 40)  # the notice the checkpoint answered: not again
    assert watch.checkpoint_due(2.0, 40) and not watch.checkpoint_due(2.0, 50)  # a node more: once more


def test_nothing_is_read_when_off_and_outside_a_worker_the_public_ask_is_what_is_left():
    watch = PreemptionWatch(None)
    assert watch.notice() == 0.0 and watch.asked == 0
    assert local_notice() is None  # no Ray Train worker context in this process
    assert ray_preemption_info() is not None  # the installed Ray has the public notice
