"""A training function that returns without :func:`raycomp.train.finish`.

Ray Train v2 runs the training function in a thread of the worker actor
(``TrainingThread(...)``), and once every worker's function has returned it ends the
actors with ``ray.kill``: the interpreter never exits normally there, so ``atexit``
handlers do not run. What does work: a daemon thread that :func:`watch` starts when the
loop is built joins the training thread; when that ends, normally, with the loop still
open, rank 0 warns and every rank finishes the loop as ``finish()`` would (final
statistics, the run's totals, ``summary.json`` on rank 0, the files uploaded). The
worker group is shut down a moment later (Ray Train polls its workers every
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default), which may cut that short; the
warning says so. A function that raised is left alone (Ray Train reports its error, or
restarts the group). Outside a training thread (a test's main thread) nothing is watched.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["MISSING_FINISH", "watch"]

log = logging.getLogger("raycomp.train")

#: the start of rank 0's warning
MISSING_FINISH = "raycomp.train.finish() was not called"


def watch(loop: Any, is_open: Callable[[Any], bool], finish: Callable[[Any], Any]) -> None:
    """From the training thread that built ``loop``: when that thread ends without an
    error while ``is_open(loop)``, warn (rank 0) and ``finish(loop)`` (every rank)."""
    training = threading.current_thread()
    if training is threading.main_thread():
        return
    threading.Thread(target=_after, args=(training, loop, is_open, finish), daemon=True,
                     name="raycomp-finish-watch").start()


def _after(training: threading.Thread, loop: Any, is_open: Callable[[Any], bool],
           finish: Callable[[Any], Any]) -> None:
    training.join()
    if not is_open(loop) or _training_failed():
        return
    if loop.rank == 0:
        log.warning("%s before the training function returned: raycomp finishes the run now (run totals, "
                    "summary.json in %s), unless Ray Train shuts the workers down first. End the training "
                    "function with `return raycomp.train.finish()` on every rank", MISSING_FINISH, loop.output_dir)
    try:
        finish(loop)
    except Exception as error:  # noqa: BLE001 - the thread is the last thing running here
        if loop.rank == 0:
            log.warning("%s and finishing the run for it failed: %s; the run has no summary.json",
                        MISSING_FINISH, error)


def _training_failed() -> bool:
    """Whether Ray Train's training function raised (its thread runner holds the error)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().execution_context.training_thread_runner.get_error() is not None
    except Exception:  # noqa: BLE001 - another Ray Train: assume it returned
        return False
