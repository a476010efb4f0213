"""Collective rounds beyond the dense all-reduce, per collective family, as each compressor
declares them (:class:`raycomp.compressors.Cost`): what the cost model prices a plan's
rounds from, and what it learns each family's round overhead for."""

from __future__ import annotations

from raycomp.compressors import compressor_class


def family_rounds(names: set[str], world_size: int) -> dict[str, int]:
    """Collective rounds beyond the dense all-reduce (which the measured bandwidth includes),
    per collective family of the compressors ``names``, as each declares them
    (:class:`raycomp.compressors.Cost`): a family's rounds count once, whatever number of
    layers it carries. Compressors without a declared cost, or unknown here, add none."""
    rounds: dict[str, int] = {}
    for name in names:
        found = _family(name, world_size == 2)
        if found is not None and found[1]:
            rounds[found[0]] = found[1]
    return dict(sorted(rounds.items()))


def _family(name: str, two_ranks: bool) -> tuple[str, int] | None:
    try:
        cost = compressor_class(name).cost
    except ValueError:
        return None  # a name this process cannot resolve: priced as no extra round
    if cost is None:
        return None
    rounds = cost.rounds_at_two if two_ranks and cost.rounds_at_two is not None else cost.rounds
    return cost.family or name, rounds


__all__ = ["family_rounds"]
