"""What a policy returns: a :class:`Decision`, the plan and a typed record of why.

A *why* is a frozen dataclass of named facts (what was measured, each candidate's predicted
step, what was chosen) with a ``rule`` (which rule decided) and ``text()``, the prose that
becomes the plan's ``reason`` (the rule and facts ride in the plan's ``why``). Each policy's
whys live beside it (``CriticalWhy`` in ``critical.py``, ``AdaptiveWhy`` in ``adaptive_why.py``,
...); :class:`Said` here is the why of a decision one sentence explains. The controller logs
the rule with the prose, counts plan switches by rule for Prometheus and keeps the facts in
the run's events (the summary)::

    Decision.of(Plan.per_layer(chosen), AdaptiveWhy(...))   # the plan's reason: why.text()
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Protocol

from raycomp.plan import Plan


class Why(Protocol):
    """The facts behind a decision (a frozen dataclass) and their prose."""

    rule: str

    def text(self) -> str: ...


@dataclass(frozen=True)
class Said:
    """A decision one sentence explains in full (a fixed plan, a dense one until measured)."""

    rule: str
    words: str

    def text(self) -> str:
        return self.words


@dataclass(frozen=True)
class Decision:
    plan: Plan
    why: Why

    @classmethod
    def of(cls, plan: Plan, why: Why) -> Decision:
        """``plan`` with its reason rendered from ``why``, and the why's rule and facts
        (:meth:`facts`) in the plan's ``why``: they travel with the plan to every rank, so
        rank 0's switch line and ``plans.jsonl`` say which rule decided and from what."""
        decision = cls(plan, why)
        return cls(replace(plan, reason=why.text(), why=decision.facts()), why)

    @property
    def rule(self) -> str:
        return self.why.rule

    def facts(self) -> dict[str, Any]:
        """The why's named facts and its rule (JSON-able: for logs and the run's summary); a
        why that is not a dataclass gives its rule alone."""
        if not dataclasses.is_dataclass(self.why):
            return {"rule": self.why.rule}
        return {"rule": self.why.rule, **{k: _plain(v) for k, v in dataclasses.asdict(self.why).items()
                                          if k != "rule"}}


def checked(decision: Any, policy: str) -> Decision | None:
    """``decision`` as a policy's ``decide``/``warmup`` must return it (TypeError: one line)."""
    if decision is not None and not isinstance(decision, Decision):
        raise TypeError(f"policy {policy!r}: decide/warmup must return a Decision "
                        f"(Decision.of(plan, Said(rule, words))) or None, got {type(decision).__name__}")
    return decision


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


__all__ = ["Decision", "Said", "Why", "checked"]
