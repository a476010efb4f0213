"""Reading a run's per-rank step logs (``<output>/steps/rank<N>.jsonl``)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["step_logs"]


def step_logs(output: str | Path, ranks: int | None = None) -> list[list[dict]]:
    """Every rank's step log under ``output``, by rank number (rank 10 after rank 9).
    ``ranks``: how many logs there must be; a missing or extra one fails here, not as a
    shorter comparison later."""
    paths = sorted((Path(output) / "steps").glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    if ranks is not None:
        assert [int(p.stem[4:]) for p in paths] == list(range(ranks)), f"step logs of ranks 0..{ranks - 1}: {paths}"
    return [[json.loads(line) for line in p.read_text().splitlines()] for p in paths]
