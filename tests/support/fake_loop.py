"""A stand-in for a :class:`~raycomp.train.TrainLoop`: what the frameworks' step glue reads
of it, for tests that exercise the glue without a run."""

from __future__ import annotations

__all__ = ["fake_loop"]


def fake_loop(ratio: float | None = 4.0, version: int = 3, active: bool = False, kinds=("fallback", "recovered")):
    """What :meth:`FrameworkStep.logged` reads of a :class:`~raycomp.train.TrainLoop`."""
    from types import SimpleNamespace

    events = [SimpleNamespace(kind=k) for k in kinds]
    return SimpleNamespace(state=SimpleNamespace(ledger=SimpleNamespace(compression_ratio=ratio),
                                                 plan=SimpleNamespace(version=version)),
                           judge=SimpleNamespace(guard=SimpleNamespace(active=active, events=events)))
