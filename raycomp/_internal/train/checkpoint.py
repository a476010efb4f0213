"""What a checkpoint holds and how it is written: rank 0's ``shared.pt`` (model, optimizer,
scheduler) and ``meta.json``, and every rank's ``rank<r>.pt`` (compressor state, error
feedback residuals, guard, plan, RNG, counters) — all written atomically.

A sharded (FSDP) run keeps its model and optimizer in ``sharded/``, a torch distributed
checkpoint that every rank writes its own shards into; ``shared.pt`` then holds only the
scheduler."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "META", "SHARDED", "SHARED", "atomic_write", "load", "load_all_own", "load_sharded", "save_own",
    "save_sharded", "save_shared"
]

SHARED, META, SHARDED = "shared.pt", "meta.json", "sharded"


def atomic_write(path: Path, write: Any) -> None:
    """``write(tmp_path)``, then rename over ``path``: readers see the old file or the new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_own(directory: Path, rank: int, own: dict[str, Any]) -> None:
    atomic_write(directory / f"rank{rank}.pt", lambda p: torch.save(own, p))


def save_shared(directory: Path, model: torch.nn.Module | None, optimizer: Any, scheduler: Any,
                meta: dict[str, Any]) -> None:
    """Rank 0 only: what every rank holds identically (``model`` None: a sharded run, whose
    model and optimizer are in :func:`save_sharded`'s files)."""
    shared = {"model": None if model is None else getattr(model, "module", model).state_dict(),
              "optimizer": None if model is None else optimizer.state_dict(),
              "scheduler": None if scheduler is None else scheduler.state_dict()}
    atomic_write(directory / SHARED, lambda p: torch.save(shared, p))
    atomic_write(directory / META, lambda p: p.write_text(json.dumps(meta)))


def load(directory: Path, rank: int, world_size: int, model: torch.nn.Module, optimizer: Any,
         scheduler: Any, sharded: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load the shared part into the model/optimizer/scheduler; return (meta, this rank's
    own state, or None when the checkpoint was written by a different number of workers)."""
    meta = json.loads((directory / META).read_text())
    shared = torch.load(directory / SHARED, weights_only=False)
    if (shared["model"] is None) != sharded:
        written = "a sharded (fsdp)" if shared["model"] is None else "a ddp"
        raise ValueError(f"checkpoint: written by {written} run; resume it with the same strategy")
    if sharded:
        load_sharded(directory, model, optimizer)
    else:
        getattr(model, "module", model).load_state_dict(shared["model"])
        optimizer.load_state_dict(shared["optimizer"])
    if scheduler is not None and shared["scheduler"] is not None:
        scheduler.load_state_dict(shared["scheduler"])
    own_path = directory / f"rank{rank}.pt"
    if meta["world_size"] != world_size or not own_path.exists():
        return meta, None
    return meta, torch.load(own_path, weights_only=False)


def load_all_own(directory: Path, world_size: int) -> list[dict[str, Any]] | None:
    """Every rank's own state of a checkpoint written by ``world_size`` workers, in rank
    order (None when a rank's file is missing): what a resize merges
    (:mod:`raycomp._internal.train.resize`)."""
    paths = [directory / f"rank{r}.pt" for r in range(world_size)]
    if not all(p.exists() for p in paths):
        return None
    return [torch.load(p, weights_only=False) for p in paths]


def save_sharded(directory: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Every rank (a collective): its shards of the model and optimizer state, with torch's
    distributed checkpoint; each rank's files land in its own ``directory`` and Ray Train
    gathers them into one checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory / SHARDED)


def load_sharded(directory: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Every rank (a collective): load its shards of :func:`save_sharded`'s files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # the layout to load into
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory / SHARDED)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
