"""``summary.json``: what a run did, in one file (the job's driver writes a fuller one over it).

A run that stayed dense all run says why once, on rank 0, as its summary is made (the
same words ``raycomp inspect`` prints, :func:`raycomp._internal.observe.run_report.dense_why`): no line
during the run says it, since a plan that stays dense is never switched to."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from raycomp._internal.train.checkpoint import atomic_write

__all__ = ["worker_summary", "write_summary"]


def worker_summary(totals: dict[str, Any], run_id: str, world_size: int, policy: str,
                   controller: dict[str, Any], output_dir: Path | str) -> dict[str, Any]:
    """The keys of the job's ``summary.json`` that the workers know, from rank 0's totals."""
    from raycomp._internal.observe.run_report import dense_why

    wire, dense = totals["wire_bytes_total"], totals["dense_bytes_total"]
    summary = {"run_id": run_id, "status": "succeeded", "error": None, "world_size": world_size, **totals,
               "compression_ratio": dense / wire if wire else None,
               "policy": {"name": policy, **controller}, "output_dir": str(output_dir)}
    why = dense_why(summary)
    if why is not None:
        logging.getLogger("raycomp.train").info("the plan stayed dense all run: %s", why)
    return summary


def write_summary(summary: dict[str, Any], output_dir: Path) -> None:
    """``<output_dir>/summary.json``, replaced atomically."""
    atomic_write(Path(output_dir) / "summary.json",
                 lambda p: p.write_text(json.dumps(summary, indent=2, default=str)))
