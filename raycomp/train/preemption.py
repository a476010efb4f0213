"""A preemption notice turned into a checkpoint before the node goes.

Spot and preemptible nodes are announced before they are taken: Ray Train hands the
notice to the training function through ``ray.train.get_preemption_info()`` (Ray 2.59 and
later), a barrier across the workers that every rank must call the same number of times.
:class:`PreemptionWatch` asks at control boundaries, which come at the same steps on
every rank: one actor round trip every ``interval_steps`` steps, nothing on other steps.
On a notice every rank gets the same answer (Ray broadcasts rank 0's), and the loop
checkpoints at that boundary with raycomp's state (under local steps each replica's
weights and optimizer state too), once per notice, then keeps training until the node
goes: Ray Train restarts the run from that checkpoint, losing no step, at the size the
remaining nodes hold (and grows back when nodes return, with ``ScalingConfig(num_workers=
(min, max))``). A framework that checkpoints through its own callbacks (Lightning, the
Hugging Face Trainer) asks itself: ``docs/elastic.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["PreemptionWatch", "ray_preemption_info"]

log = logging.getLogger("raycomp.train")


def ray_preemption_info() -> Callable[[], Any] | None:
    """Ray Train's ``get_preemption_info``, or None where the installed Ray has none."""
    import ray.train

    return getattr(ray.train, "get_preemption_info", None)


class PreemptionWatch:
    """Asks for a preemption notice at control boundaries; says when to checkpoint.

    Args:
        ask: returns the notice (an object with ``preempted_node_ids`` and ``deadline_ms``,
            as Ray's ``PreemptionInfo``) or None; a barrier, called by every rank at the
            same boundary. None: nothing is asked (the installed Ray has no notice, or
            ``checkpoint.on_preemption`` is off).
    """

    def __init__(self, ask: Callable[[], Any] | None) -> None:
        self.ask = ask
        self.asked = 0  # boundaries at which this rank asked (the same count on every rank)
        #: the notices (their preempted nodes) this run has checkpointed for, oldest first
        self.handled: list[list[str]] = []

    def checkpoint_due(self, step: int) -> bool:
        """Ask for a notice (collective); True when one came that no checkpoint answered yet."""
        if self.ask is None:
            return False
        notice = self.ask()
        self.asked += 1
        if notice is None:
            return False
        nodes = sorted(str(node) for node in getattr(notice, "preempted_node_ids", []))
        if nodes in self.handled:
            return False
        self.handled.append(nodes)
        log.warning("preemption notice at step %d for node(s) %s (deadline %s ms): checkpointing now, "
                    "training goes on until the node goes", step, ", ".join(nodes) or "?",
                    getattr(notice, "deadline_ms", None))
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"handled": [list(nodes) for nodes in self.handled]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.handled = [list(nodes) for nodes in state.get("handled", [])]
