"""The controller's state on disk: one JSON file per run, plus a small file of counters.

Why one file per run: a single snapshot of every run is written while the state lock is
held, and it grows with the number of runs (its cost: ``docs/benchmarks/history.md``). Per-run files let the controller write only the runs that changed, one
at a time, within a CPU budget (see ``Controller.flush_one``), so a snapshot never stalls
report ingestion for long, however many runs there are.

Files are named by a hash of the run id (run ids are user input: never a path), written
to a temporary name and renamed, so a crash leaves the previous version of that run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("raycomp.controller")

FORMAT_VERSION = 2


class SnapshotStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.runs_dir = self.directory / "runs"
        self.meta_path = self.directory / "controller.json"

    def run_path(self, run_id: str) -> Path:
        return self.runs_dir / f"{hashlib.blake2b(run_id.encode(), digest_size=12).hexdigest()}.json"

    def save_run(self, run_id: str, state: dict[str, Any]) -> None:
        _write_atomic(self.run_path(run_id), {"version": FORMAT_VERSION, "run_id": run_id, **state})

    def delete_run(self, run_id: str) -> None:
        self.run_path(run_id).unlink(missing_ok=True)

    def save_meta(self, meta: dict[str, Any]) -> None:
        _write_atomic(self.meta_path, {"version": FORMAT_VERSION, **meta})

    def load(self) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
        """(counters or None, run id -> saved state); unreadable files are logged and skipped."""
        meta = _read(self.meta_path)
        runs: dict[str, dict[str, Any]] = {}
        for path in sorted(self.runs_dir.glob("*.json")) if self.runs_dir.is_dir() else []:
            state = _read(path)
            if state is not None and isinstance(state.get("run_id"), str):
                runs[state.pop("run_id")] = state
        return meta, runs

    def size_bytes(self) -> int:
        files = [self.meta_path, *(self.runs_dir.glob("*.json") if self.runs_dir.is_dir() else [])]
        return sum(p.stat().st_size for p in files if p.exists())


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.pop("version", None) != FORMAT_VERSION:
            raise ValueError(f"not a version-{FORMAT_VERSION} snapshot")
        return data
    except (OSError, ValueError) as error:
        log.error("controller snapshot %s unreadable, skipped: %s", path, error)
        return None
