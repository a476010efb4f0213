"""The guard's inputs made to agree for baselines whose ranks keep their own gradients.

raycomp's guard (:mod:`raycomp._internal.train.step_judge`) decides from the norm of the reduced
gradient, the same tensor on every rank, and from control rows that ride in the step's
gradient collective or, when nothing carried them (torch's hooks), in one small all-reduce
of their own. A baseline whose ranks do not reduce gradients (torch's post-local SGD after
its warm-up, torchft's DiLoCo) gives each rank a norm of its own: ranks that judged
different norms could skip different steps, and the next control boundary would find them
disagreeing (``PlanMismatchError``).

:class:`BaselineGuardState` wraps the rank's state and makes that one small all-reduce carry two
more numbers per rank: its local gradient norm and whether its gradient is finite. The guard
then sees, on every rank, the largest norm of any rank (NaN if any rank's gradient is not
finite): the same decision everywhere, with no collective added to the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from raycomp import LayerStats, Plan, WireLedger

__all__ = ["BaselineGuardState"]


class BaselineGuardState:
    """A :class:`~raycomp.train.gradient_strategy.GradientState` over ``inner`` (a
    :class:`~raycomp.CompressionState` whose hook is not raycomp's) whose
    :meth:`gradient_norm` agrees across ranks.

    Args:
        inner: the rank's compression state (plan, ledger, statistics, checkpoints).
        rank, world_size: this rank in ``group``.
        group: the process group of the guard's exchange (None: the default group).
    """

    def __init__(self, inner: Any, rank: int, world_size: int, group: Any = None) -> None:
        self.inner, self.rank, self.world_size, self.group = inner, rank, world_size, group
        self._carry: list[float] = []
        self.control_rows: torch.Tensor | None = None

    # --- what the guard reads ------------------------------------------------------------
    #: every step carries the control values, in the norm's own all-reduce
    control_skipped = False

    def stage_control(self, values: Sequence[float], skippable: bool = False) -> None:
        self._carry = [float(v) for v in values]

    def gradient_norm(self, parameters: Sequence[torch.Tensor]) -> float:
        """The largest local gradient norm of any rank, NaN if any rank's is not finite;
        every rank's control row (flag, then the staged values) left in :attr:`control_rows`."""
        local = self.inner.gradient_norm(parameters)
        width = 1 + len(self._carry)
        rows = torch.zeros(self.world_size, width + 1, dtype=torch.float64)
        finite = math.isfinite(local)
        rows[self.rank, 0] = 0.0 if finite else 1.0
        rows[self.rank, 1:width] = torch.tensor(self._carry, dtype=torch.float64)
        rows[self.rank, width] = local if finite else 0.0
        if self.world_size > 1:
            dist.all_reduce(rows, group=self.group)
        self.control_rows = rows[:, :width].float()
        if bool((rows[:, 0] > 0).any()):
            return math.nan
        return float(rows[:, width].max())

    # --- everything else is the inner state's ----------------------------------------------
    @property
    def ledger(self) -> WireLedger:
        return self.inner.ledger

    @property
    def intra_bytes(self) -> float:
        return self.inner.intra_bytes

    @property
    def stats(self) -> list[LayerStats]:
        return self.inner.stats

    @property
    def stats_step(self) -> int:
        return self.inner.stats_step

    #: a baseline's plan is raycomp's dense one: no compression error to judge
    measures_mean_error = False

    @property
    def step(self) -> int:
        return self.inner.step

    @property
    def comm_seconds(self) -> float:
        return self.inner.comm_seconds

    @property
    def plan(self) -> Plan:
        return self.inner.plan

    def set_plan(self, plan: Plan) -> None:
        self.inner.set_plan(plan)

    def discard_step(self) -> None:
        self.inner.discard_step()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()
