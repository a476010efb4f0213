"""Compression policies by name (``compression.policy`` in the job config)."""

from __future__ import annotations

from typing import Any

from controllers.policies.adaptive import AdaptivePolicy
from controllers.policies.bandwidth import BandwidthPolicy
from controllers.policies.base import Policy
from controllers.policies.critical import CriticalPolicy
from controllers.policies.error_budget import ErrorBudgetPolicy
from controllers.policies.guard import Guarded
from controllers.policies.schedule import SchedulePolicy
from controllers.policies.static import StaticPolicy

POLICIES: dict[str, type[Policy]] = {
    "static": StaticPolicy,
    "schedule": SchedulePolicy,
    "critical": CriticalPolicy,
    "error_budget": ErrorBudgetPolicy,
    "bandwidth": BandwidthPolicy,
    "adaptive": AdaptivePolicy,
}


def make_policy(name: str, options: dict[str, Any], guard: bool = True) -> Policy:
    """The policy ``name`` with its options (wrapped in :class:`Guarded` unless ``guard=False``)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"compression.policy: unknown {name!r}; allowed: {', '.join(POLICIES)}")
    policy = cls(options)
    return Guarded(policy) if guard else policy


__all__ = ["POLICIES", "Guarded", "Policy", "make_policy"]
