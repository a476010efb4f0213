"""Restoring a checkpoint written by W workers on W' != W workers (an elastic resize).

Ray Train restarts an elastic run's whole worker group at a new size from the latest
checkpoint. raycomp's checkpoint holds one ``rank<r>.pt`` per old rank; every new rank reads
all W of them and builds its own state by this rule:

* **Error feedback is merged, so the mean stays unbiased.** Rank r's residual ``e_r`` is
  what it still owes; the step owes the global model their mean ``(1/W) sum_r e_r``. Every
  new rank starts with that mean, so the new ranks owe ``(1/W') sum_j e'_j`` = the same
  mean, whether the group shrank or grew; nothing a rank held is dropped and nothing is
  counted twice. DGC's memory is merged the same way (its velocity and its accumulated
  update are both sums the ranks' mean is taken of). A layer absent from a rank's memory
  (sent in full there) counts as zero.
* **The scalable route's server residuals are folded in.** Old rank r kept the residual
  of chunk r of each layer's mean (``chunks(layer, W)``): concatenated they are one owed
  correction of the mean, already at the mean's scale. It is added to every new rank's
  merged residual (the new chunks no longer line up with the old ones, and at W' = 2 the
  route keeps no server residuals at all); with ``memory: none`` there is no residual to
  fold it into, and new rank j keeps chunk j of it at W'.
* **What must agree across ranks comes from old rank 0**: the plan and the pending plan,
  the reducer's step, the loss scale, each compressor's state (PowerSGD's warm-start Q,
  the count of seeded draws), the guard, the controller's plan, the GradScaler, the
  agreed counters and, under local steps, the global weights, the outer optimizer and
  the schedule's position. A compressor whose draws are seeded per rank keeps new rank
  j's own seed (``CompressorSpec.build`` at rank j), with rank 0's count of draws.
* **What is summed over ranks is folded**: old rank r's byte totals, controller outages
  and local skips go to new rank ``r mod W'``, so the run's totals are unchanged.
* **RNG**: new rank j takes old rank j's generator state where one existed; a rank beyond
  the old size keeps the state its training function seeded.
* **Local steps**: each rank's own replica (its weights and inner optimizer, kept only
  during local steps) is not carried over; the new ranks start from the global weights
  (:func:`raycomp._internal.train.resume.restore` copies them into the model) and the shared
  checkpoint's inner optimizer. Inner steps since the last sync are lost with the replicas:
  they were each rank's own, and averaging replicas is the sync's job, not the restore's.

A checkpoint from the same number of workers is restored rank for rank, bit for bit, and
never passes through here. A sharded (FSDP) run's residuals are laid out per shard of W;
they are not merged (its compression state starts fresh at a new size).

**Two levels** (:mod:`raycomp._internal.reduce.two_level`): a rank holds its position's piece of each layer's
residual, and the scalable route's server residuals are chunks of those pieces. Merged, they
become the owed correction over whole layers, the mean over nodes
(:mod:`raycomp._internal.train.resize_levels`); a flat new rank keeps it, a two-level one cuts out its
own piece. A checkpoint of the same size restores rank for rank only where each rank's
layout (flat, or nodes x ranks, position and cross-node rank) is the old rank's; otherwise
it is merged by this rule too.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch

from raycomp._internal.reduce.memory import PER_LAYER_STATE
from raycomp._internal.train import resize_levels
from raycomp._internal.transports.packing import chunk_sizes
from raycomp.plan import CompressorSpec

__all__ = ["layout_of", "merge_compression", "merge_own", "merge_reducer", "summary"]

#: memory state keys a server residual can be folded into (the error-feedback residual)
_FOLD_INTO = ("residuals", "accumulated")
#: counters summed over ranks (the rest agree across ranks)
_SUMMED_COUNTERS = ("outages", "local_skips")


def merge_own(olds: list[dict[str, Any]], rank: int, world_size: int, seed: int,
              shapes: dict[str, Any]) -> dict[str, Any]:
    """New rank ``rank`` of ``world_size``'s own state (as
    :func:`raycomp._internal.train.resume.own_state` lays it out) from every old rank's, in old rank
    order. ``seed``: the run's base seed (``options.seed``); ``shapes``: parameter name ->
    shape (where a folded server residual lands)."""
    if not olds:
        raise ValueError("olds: at least one old rank's state is needed")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    first = olds[0]
    counters = dict(first["counters"])
    for key in _SUMMED_COUNTERS:
        if key in counters:
            counters[key] = sum(o["counters"].get(key, 0) for i, o in enumerate(olds) if i % world_size == rank)
    return {
        "compression": merge_compression([o["compression"] for o in olds], rank, world_size, seed, shapes),
        "guard": copy.deepcopy(first["guard"]),
        "controller_plan": copy.deepcopy(first["controller_plan"]),
        "rng": olds[rank]["rng"].clone() if rank < len(olds) else None,
        "counters": counters,
        "grad_scaler": copy.deepcopy(first.get("grad_scaler")),
        "replica": None,
    }


def merge_compression(states: list[dict[str, Any]], rank: int, world_size: int, seed: int,
                      shapes: dict[str, Any]) -> dict[str, Any]:
    """The gradient state's ``state_dict`` for the new rank: a reducer's (per step), or a
    local-steps state's (the hook's reducer and the local steps' own)."""
    first = states[0]
    if "hook" in first and "local" in first:  # raycomp._internal.train.local_strategy.LocalState
        local = {key: copy.deepcopy(value) for key, value in first["local"].items() if key != "reducer"}
        local["reducer"] = merge_reducer([s["local"]["reducer"] for s in states], rank, world_size, seed, shapes)
        return {"hook": merge_reducer([s["hook"] for s in states], rank, world_size, seed, shapes),
                "local": local, "mode": copy.deepcopy(first["mode"])}
    if "memory" in first:
        return merge_reducer(states, rank, world_size, seed, shapes)
    raise ValueError("compression: a sharded (fsdp) state cannot be resized; allowed: ddp or local-steps states")


def merge_reducer(states: list[dict[str, Any]], rank: int, world_size: int, seed: int,
                  shapes: dict[str, Any]) -> dict[str, Any]:
    """A :class:`~raycomp._internal.reduce.reducer.CompressedReducer` state for new rank ``rank``: memory
    merged (and server residuals folded in), agreed state from old rank 0, byte totals folded."""
    first = states[0]
    merged = {key: copy.deepcopy(value) for key, value in first.items()
              if key not in ("memory", "server_residuals", "compressors", "ledger", "levels", "intra_ledger")}
    if first.get("levels") is not None:  # pieces of a two-level layout: owed means over whole layers
        memory = resize_levels.owed_memory(states, shapes)
        full = resize_levels.owed_server_residuals(states, shapes) if "server_residuals" in first else None
        merged["intra_ledger"] = _fold_ledgers([s["intra_ledger"] for s in states], rank, world_size)
    else:
        memory = _mean_memory([s["memory"] for s in states])
        servers = [s["server_residuals"] for s in states if "server_residuals" in s]
        full = _full_server_residuals(servers, shapes) if "server_residuals" in first else None
    merged["merged"] = True  # every new rank the same owed means: a two-level rank cuts out its pieces
    if full is not None:
        slot = next((key for key in _FOLD_INTO if key in memory), None)
        if slot is not None:
            for name, owed in full.items():
                shape = shapes[name]
                base = memory[slot].get(name)
                memory[slot][name] = (owed.reshape(shape) if base is None else base + owed.reshape(base.shape))
            merged["server_residuals"] = {}
        else:  # no error-feedback memory to fold into: chunk j of the whole at W'
            merged["server_residuals"] = {name: _chunk(owed, world_size, rank).clone()
                                          for name, owed in full.items()}
    merged["memory"] = memory
    merged["compressors"] = _compressors(first["compressors"], rank, seed)
    merged["ledger"] = _fold_ledgers([s["ledger"] for s in states], rank, world_size)
    return merged


def _mean_memory(memories: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key and layer, the mean over the old ranks (absent = zero), summed in float64
    and stored in the residuals' own dtype (fp32), on the CPU (the reducer moves a residual
    to its gradient's device when it uses it)."""
    merged: dict[str, Any] = {}
    for key in memories[0]:
        if key not in PER_LAYER_STATE:
            merged[key] = copy.deepcopy(memories[0][key])
            continue
        names = sorted({name for m in memories for name in m.get(key, {})})
        layers = {}
        for name in names:
            present = [m[key][name] for m in memories if name in m.get(key, {})]
            total = torch.zeros(present[0].shape, dtype=torch.float64)
            for tensor in present:
                total += tensor.detach().cpu().to(torch.float64)
            layers[name] = (total / len(memories)).to(present[0].dtype)
        merged[key] = layers
    return merged


def _full_server_residuals(servers: list[dict[str, torch.Tensor]], shapes: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each layer's server residual over the whole layer (flat), from old rank r's chunk r
    (a rank without one holds zeros there)."""
    w = len(servers)
    full = {}
    for name in sorted({n for s in servers for n in s}):
        numel = _numel(shapes[name])
        sizes = chunk_sizes(numel, w)
        pieces = []
        for r, size in enumerate(sizes):
            piece = servers[r].get(name)
            pieces.append(torch.zeros(size) if piece is None else piece.detach().cpu().reshape(-1).float())
        full[name] = torch.cat(pieces)
    return full


def _chunk(flat: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    return flat.split(chunk_sizes(flat.numel(), parts))[index]


def _numel(shape: Any) -> int:
    return int(torch.Size(shape).numel()) if isinstance(shape, (list, tuple, torch.Size)) else int(shape)


def _compressors(entries: dict[str, Any], rank: int, seed: int) -> dict[str, Any]:
    """Rank 0's compressor states; a compressor seeded per rank gets new rank ``rank``'s
    own seed (the one the router would build it with), keeping rank 0's count of draws."""
    out = {}
    for name, entry in entries.items():
        entry = copy.deepcopy(entry)
        state = entry.get("state")
        if isinstance(state, dict) and isinstance(state.get("draws"), dict):
            fresh = CompressorSpec.from_dict(entry["spec"]).build(name, rank, seed).state_dict()
            if isinstance(fresh.get("draws"), dict):
                state["draws"]["seed"] = fresh["draws"]["seed"]
        out[name] = entry
    return out


def _fold_ledgers(ledgers: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """The byte totals of old ranks ``r`` with ``r mod W' == rank``, added per layer."""
    folded: dict[str, Any] = {}
    for key in ("wire_bytes", "dense_bytes"):
        totals: dict[str, float] = defaultdict(float)
        for r, ledger in enumerate(ledgers):
            if r % world_size == rank:
                for layer, value in ledger.get(key, {}).items():
                    totals[layer] += value
        folded[key] = dict(totals)
    return folded


def summary(olds: list[dict[str, Any]], world_size: int) -> str:
    """What the merge did, in one line for the log."""
    layers: set[str] = set()
    servers: set[str] = set()
    for own in olds:
        for reducer in _reducers(own["compression"]):
            for key in PER_LAYER_STATE:
                layers.update(reducer.get("memory", {}).get(key, {}))
            servers.update(reducer.get("server_residuals", {}))
    local = any(own.get("replica") is not None for own in olds)
    return (f"{len(olds)} -> {world_size} workers: the residuals of {len(layers)} layers merged "
            f"(every new rank holds the old ranks' mean), {len(servers)} server residuals folded in, "
            f"compressor state, guard and plan from old rank 0, byte totals folded by rank mod {world_size}"
            + ("; replicas restarted from the global weights" if local else ""))


def layout_of(compression: dict[str, Any]) -> list[Any]:
    """The two-level places (nodes, ranks per node, position, cross-node rank) of the
    reducers in a gradient state's ``state_dict``; [] when every one is flat."""
    return [reducer["levels"] for reducer in _reducers(compression) if reducer.get("levels") is not None]


def _reducers(compression: dict[str, Any]) -> list[dict[str, Any]]:
    if "hook" in compression and "local" in compression:
        return [compression["hook"], compression["local"]["reducer"]]
    return [compression] if "memory" in compression else []
