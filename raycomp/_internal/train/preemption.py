"""A preemption notice turned into a checkpoint before the node goes.

Spot and preemptible nodes are announced before they are taken: Ray Train (2.59 and later)
hands the notice to each worker's training context, and to the training function through
``ray.train.get_preemption_info()``, a barrier across the workers (an actor round trip, a few
ms). raycomp asks for no barrier of its own: at every agreement of the ranks (once per
control interval, the same step on every rank, :mod:`raycomp._internal.train.plan_agreement`) each rank
reads the notice its own worker holds (:func:`local_notice`) and the number of nodes it
names rides in the agreement's all-gather, which runs anyway; the largest comes back to
every rank. When it exceeds what a checkpoint already answered, every rank checkpoints there
with raycomp's state (under local steps each replica's weights and optimizer state too) and
trains on until the node goes: Ray Train restarts the run from that checkpoint at the size
the remaining nodes hold (and grows back with ``ScalingConfig(num_workers=(min, max))``).
Where the installed Ray keeps no notice in the worker's context, the public barrier is
asked instead, at the same agreements on every rank. A framework that checkpoints through its
own callbacks (Lightning, the Hugging Face Trainer) asks itself: ``docs/elastic.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["PreemptionWatch", "local_notice", "ray_preemption_info"]

log = logging.getLogger("raycomp.train")


def ray_preemption_info() -> Callable[[], Any] | None:
    """Ray Train's ``get_preemption_info`` (a barrier), or None where the installed Ray has none."""
    import ray.train

    return getattr(ray.train, "get_preemption_info", None)


def local_notice() -> Callable[[], Any] | None:
    """Reads this worker's own copy of the notice, with no barrier (Ray Train v2's worker
    context keeps it), or None where the installed Ray keeps none there."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        get_train_context().preemption_context  # noqa: B018 - present in this Ray?
    except Exception:  # noqa: BLE001 - another Ray, or outside a Ray Train worker
        return None
    return lambda: get_train_context().preemption_context.preemption_info


class PreemptionWatch:
    """This rank's part in turning a notice into one checkpoint.

    Args:
        read: returns the notice this rank holds (an object with ``preempted_node_ids`` and
            ``deadline_ms``, as Ray's ``PreemptionInfo``) or None. Called at every agreement
            by every rank; it may be a barrier (the public API's), since every rank calls
            it equally. None: nothing is read (no notice in this Ray, or
            ``checkpoint.on_preemption`` off).
    """

    def __init__(self, read: Callable[[], Any] | None) -> None:
        self.read = read
        self.asked = 0  # agreements at which this rank read its notice (the same count on every rank)
        #: the most preempted nodes a checkpoint has answered (a notice naming more: again)
        self.answered = 0

    def notice(self) -> float:
        """What this rank carries into the agreement: the number of nodes its notice names."""
        if self.read is None:
            return 0.0
        self.asked += 1
        found = self.read()
        # a notice naming no node still counts as one
        return float(max(1, len(getattr(found, "preempted_node_ids", ())))) if found is not None else 0.0

    def checkpoint_due(self, agreed: float, step: int) -> bool:
        """Whether the agreement's notice (the largest any rank carried) calls for a
        checkpoint no earlier one answered; the same on every rank."""
        if agreed <= self.answered:
            return False
        self.answered = int(agreed)
        log.warning("preemption notice at step %d for %d node(s): checkpointing now, training goes on until "
                    "the node goes", step, self.answered)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"answered": self.answered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.answered = int(state.get("answered", 0))
