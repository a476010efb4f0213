"""What each rank writes about its steps: ``steps/rank<r>.jsonl``, rank 0's ``evals.jsonl``
and a status line every few steps."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from raycomp.plan import Plan

__all__ = ["StepLog", "is_dense", "show_progress", "truncate"]

log = logging.getLogger("raycomp.train")


class StepLog:
    """One JSON line per step on every rank (the benchmark reads ``time``, ``step``,
    ``wire_bytes``, ``dense_bytes``, ``loss``; ``seconds`` is the step's own time, the one
    the controller's step timings average: from the end of the previous step, or of the
    evaluation or report after it, to the end of this one); evaluations on rank 0. A
    context manager; or call :meth:`close`."""

    def __init__(self, output_dir: Path, rank: int, progress_every: int = 0) -> None:
        """``progress_every``: rank 0 logs a status line every this many steps (0: never):
        the step, loss, compression ratio so far, the plan in force and samples/s."""
        self.output_dir, self.rank, self.progress_every = output_dir, rank, progress_every
        self.path = output_dir / "steps" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = None
        self._progress_at = (time.perf_counter(), 0, 0)  # (time, step, samples)
        self._samples = 0
        #: what the plan in force does, in a few words (the loop sets it at each switch)
        self.plan_summary = ""
        self.evaluated_at: int | None = None  # the step of the latest evaluation (every rank)
        if progress_every and rank == 0:
            show_progress()

    def open(self, resume_step: int | None) -> int:
        """Start the log; after a resume keep only steps before ``resume_step`` and return
        how many logged steps were dropped (they will be replayed)."""
        dropped = 0
        if resume_step is None:
            self.path.write_text("")
        else:
            dropped = truncate(self.path, resume_step)
        self._file = self.path.open("a")
        return dropped

    def write_step(self, step: int, epoch: int, state: Any, loss: float, lr: float, applied: bool, fallback: bool,
                   seconds: float, samples: int) -> None:
        """Step ``step``'s line: what ``state`` (the rank's gradient state) trained it on and
        sent, its loss, learning rate, whether it applied, the guard's fallback, its time."""
        plan = state.plan
        self.write({
            "step": step, "epoch": epoch, "time": time.time(), "plan_version": plan.version,
            "plan_digest": plan.digest(), "dense": is_dense(plan), "loss": loss, "lr": lr,
            "applied": applied, "fallback": fallback, "seconds": seconds,
            "wire_bytes": state.ledger.wire_total, "dense_bytes": state.ledger.dense_total,
        }, samples)

    def write(self, record: dict[str, Any], samples: int) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # ~10 us: a crash loses no logged step (resume counts replays from it)
        self._samples += samples
        step = record["step"] + 1
        if self.rank == 0 and self.progress_every and step % self.progress_every == 0:
            then, then_step, then_samples = self._progress_at
            now = time.perf_counter()
            rate = (self._samples - then_samples) / max(1e-9, now - then)  # this rank's
            wire, dense = record["wire_bytes"], record["dense_bytes"]
            log.info("step %d  loss %.4g  ratio %.1fx  plan v%d %s  %.0f samples/s/rank", step, record["loss"],
                     dense / wire if wire else 1.0, record["plan_version"],
                     self.plan_summary or ("dense" if record["dense"] else "compressed"), rate)
            self._progress_at = (now, step, self._samples)

    def write_eval(self, metrics: dict[str, Any], step: int, epoch: int) -> None:
        """Rank 0: one line per evaluation, for accuracy-over-time measurements."""
        self.evaluated_at = step
        if self.rank != 0:
            return
        with (self.output_dir / "evals.jsonl").open("a") as evals:
            evals.write(json.dumps({"time": time.time(), **metrics, "epoch": epoch, "step": step},
                                   default=_json_value) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_dense(plan: Plan) -> bool:
    """Whether ``plan`` sends every layer dense (a step's ``dense``)."""
    return plan.dense or (plan.default.is_dense and all(s.is_dense for _, s in plan.layers))


def show_progress() -> None:
    """Make the ``raycomp`` logger's INFO lines visible in this worker (Ray streams a worker's
    stderr to the driver), unless the application configured it already."""
    logger = logging.getLogger("raycomp")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _json_value(value: Any) -> Any:
    """A reported value JSON has no type for: a number if it is one (a NumPy scalar, a
    one-element tensor), else its text."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def truncate(path: Path, next_step: int) -> int:
    """Keep log records of steps before ``next_step``; return how many were dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1  # a line cut short by the crash
            continue
        if record["step"] < next_step:
            kept.append(line)
        else:
            dropped += 1
    path.write_text("".join(line + "\n" for line in kept))
    return dropped
