"""What a checkpoint holds and how it is written: rank 0's ``shared.pt`` (model, optimizer,
scheduler) and ``meta.json``, and every rank's ``rank<r>.pt`` (compressor state, error
feedback residuals, guard, plan, RNG, counters) — all written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

SHARED, META = "shared.pt", "meta.json"


def atomic_write(path: Path, write: Any) -> None:
    """``write(tmp_path)``, then rename over ``path``: readers see the old file or the new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_own(directory: Path, rank: int, own: dict[str, Any]) -> None:
    atomic_write(directory / f"rank{rank}.pt", lambda p: torch.save(own, p))


def save_shared(directory: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                meta: dict[str, Any]) -> None:
    """Rank 0 only: what every rank holds identically."""
    shared = {"model": getattr(model, "module", model).state_dict(), "optimizer": optimizer.state_dict(),
              "scheduler": None if scheduler is None else scheduler.state_dict()}
    atomic_write(directory / SHARED, lambda p: torch.save(shared, p))
    atomic_write(directory / META, lambda p: p.write_text(json.dumps(meta)))


def load(directory: Path, rank: int, world_size: int, model: torch.nn.Module, optimizer: Any,
         scheduler: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load the shared part into the model/optimizer/scheduler; return (meta, this rank's
    own state, or None when the checkpoint was written by a different number of workers)."""
    meta = json.loads((directory / META).read_text())
    shared = torch.load(directory / SHARED, weights_only=False)
    getattr(model, "module", model).load_state_dict(shared["model"])
    optimizer.load_state_dict(shared["optimizer"])
    if scheduler is not None and shared["scheduler"] is not None:
        scheduler.load_state_dict(shared["scheduler"])
    own_path = directory / f"rank{rank}.pt"
    if meta["world_size"] != world_size or not own_path.exists():
        return meta, None
    return meta, torch.load(own_path, weights_only=False)
