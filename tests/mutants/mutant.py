"""A mutant: an honest bug, the edits that make it, and the tests of the normal suite that should notice."""

from __future__ import annotations

from dataclasses import dataclass

from .anchor import Edit

__all__ = ["DEFAULT_TIMEOUT_S", "Mutant", "mutant"]

DEFAULT_TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutant:
    name: str
    edits: tuple[Edit, ...]  # placed on the unmutated code, then applied together
    tests: tuple[str, ...]  # pytest arguments (paths, -k expressions)
    why: str  # the bug in one line
    timeout_s: int = DEFAULT_TIMEOUT_S


def mutant(name: str, anchor: str, original: str, replacement: str, tests: str, why: str,
           *more_edits: tuple[str, str, str], timeout_s: int = DEFAULT_TIMEOUT_S) -> Mutant:
    """One catalog entry: ``original`` inside the definition ``anchor`` becomes ``replacement``;
    ``more_edits`` are further ``(anchor, original, replacement)`` triples of the same bug."""
    edits = (Edit(anchor, original, replacement), *(Edit(*e) for e in more_edits))
    return Mutant(name, edits, tuple(tests.split()), why, timeout_s)
