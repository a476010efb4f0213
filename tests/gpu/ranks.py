"""Running a check on NCCL in this process (one GPU: world size 1) or on two gloo ranks.

A check is a module-level function ``fn(device, rank, world, **kwargs) -> str`` that
raises (an ``AssertionError``, or ``pytest.skip``) where it fails and returns a note.
One GPU cannot hold two NCCL ranks, so the two-rank runs use gloo with CUDA tensors,
both ranks on ``cuda:0``. Starting two processes costs seconds, so a test module's
two-rank checks (its ``TWO_RANKS`` list) run in one spawned pair, the first time one of
them is asked for. Each rank writes its results after every check: a crash keeps the
rows before it, and a check a rank never reported fails with how the pair ended.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import json
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.gpu.support import CUDA, free_port

__all__ = ["Check", "Nccl", "TwoRanks", "spawn_two_ranks", "two_rank_results"]

#: a collective that waits longer than this on gloo fails the check (a rank that failed
#: before it never arrives) instead of hanging the pair
GLOO_TIMEOUT = datetime.timedelta(seconds=180)


@dataclass(frozen=True)
class Check:
    """One call of a check: the function and its keyword arguments (JSON values)."""

    fn: Callable[..., str]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.fn.__module__}:{self.fn.__qualname__}{json.dumps(self.kwargs, sort_keys=True)}"

    def run(self, device: torch.device, rank: int, world: int) -> str:
        return self.fn(device, rank, world, **self.kwargs) or ""


class Nccl:
    """Checks run here, on the session's NCCL group of one rank."""

    def run(self, check: Check) -> str:
        return check.run(CUDA, 0, 1)


def _worker(rank: int, world: int, port: int, calls: list[tuple[str, str, dict[str, Any]]], outdir: str,
            device: torch.device) -> None:
    faulthandler.enable()  # a crash inside a collective prints the Python stack
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    Path(outdir, f"rank{rank}.started").touch()  # the group is up: a later death is the checks'
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results: list[dict[str, str]] = []
    for module, name, kwargs in calls:
        check = Check(getattr(importlib.import_module(module), name), kwargs)
        try:
            results.append({"key": check.key, "status": "PASS", "note": check.run(device, rank, world)})
        except pytest.skip.Exception as reason:
            results.append({"key": check.key, "status": "SKIP", "note": str(reason)})
        except Exception as error:  # noqa: BLE001 - reported to the test that asks for this check
            results.append({"key": check.key, "status": "FAIL",
                            "note": f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"})
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class TwoRanks:
    """Each rank's result of every check of one spawned pair, and how the pair ended."""

    results: list[dict[str, dict[str, str]]]
    ended: str = ""

    def failure(self, check: Check) -> str:
        """'' if no rank failed ``check``, else how the first one did (or that it never reported it)."""
        for rank, got in enumerate(self.results):
            row = got.get(check.key)
            if row is None:
                return f"rank {rank} never reported {check.key}: {self.ended or 'not among the checks it ran'}"
            if row["status"] == "FAIL":
                return f"rank {rank}: {row['note']}"
        return ""

    def run(self, check: Check) -> str:
        """Rank 0's note; fails if either rank failed ``check`` or never reported it."""
        failure = self.failure(check)
        if failure:
            pytest.fail(failure, pytrace=False)
        first = self.results[0][check.key]
        if first["status"] == "SKIP":
            pytest.skip(first["note"])
        return first["note"]


def spawn_two_ranks(checks: list[Check], outdir: Path, device: torch.device = CUDA) -> TwoRanks:
    """Run ``checks`` in order on two gloo ranks (two processes) with tensors on ``device``.
    A pair whose process group never came up is tried once more on a fresh port."""
    import torch.multiprocessing as mp

    calls = [(c.fn.__module__, c.fn.__qualname__, c.kwargs) for c in checks]
    ended = ""
    for attempt in (1, 2):
        workdir = outdir / f"attempt{attempt}"
        workdir.mkdir(parents=True)
        try:
            mp.spawn(_worker, args=(2, free_port(), calls, str(workdir), device), nprocs=2, join=True)
            ended = ""
        except Exception as error:  # noqa: BLE001 - the tests asking for the checks report it
            lines = [line.strip() for line in f"{type(error).__name__}: {error}".splitlines() if line.strip()]
            ended = f"the pair ended with {lines[-1][:300]}"
        if all((workdir / f"rank{r}.started").exists() for r in (0, 1)):
            break
        if attempt == 2:
            ended += " (the process group did not come up, twice)"
    results = []
    for rank in (0, 1):
        path = workdir / f"rank{rank}.json"
        rows = json.loads(path.read_text()) if path.exists() else []
        results.append({row["key"]: row for row in rows})
    return TwoRanks(results, ended)


def two_rank_results(module: Any, outdir: Path) -> TwoRanks:
    """``module.TWO_RANKS`` run on two gloo ranks (the module's checks, in one pair)."""
    checks = list(getattr(module, "TWO_RANKS", []))
    if not checks:
        raise ValueError(f"TWO_RANKS: {module.__name__} lists no two-rank checks")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return spawn_two_ranks(checks, outdir)
