"""Run a function on W real gloo processes and collect what each rank returns.

Functions must live at module level (they are pickled by reference into the new
processes). Any exception on any rank fails the caller with that rank's traceback; a
rank that does not finish within ``timeout`` fails it too (no silent hang).

The processes are forked from a forkserver that has imported once what each rank would
otherwise import on its own, seconds of CPU each: torch, what DDP's constructor imports
the first time it runs (``torch._dynamo`` and with it sympy, which otherwise made a small
DDP test spend most of its time building a tiny model) and Ray Train's API
(``raycomp.train`` imports it for its callback). Each rank gets the caller's
environment as it is at the call. A run with ``env_per_rank`` starts fresh
interpreters instead (``spawn``), for settings that must be in place before the
interpreter or torch starts (``PYTHONHASHSEED``, torch's flight recorder).

The ranks meet through a ``FileStore`` in a fresh directory, not a TCP port: a port found
free and released before rank 0 binds it can be taken by another process in between
(EADDRINUSE), which a suite that starts Ray clusters and servers does now and then. Each
rank hands back its result as a file in that directory, renamed into place when complete,
not through a multiprocessing queue: a queue's pipe once left the parent waiting in the
middle of a message while both ranks, their results sent, waited to exit (a suite-long
hang no timeout caught, since the parent had started reading). A rank that exits without a
result fails the caller at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what the forkserver imports before it forks the ranks: the heavy third-party part (Ray
#: reads its settings from the environment at import: the server starts with the session's,
#: tests/conftest.py's, which every rank has too). Importing starts no thread in any of them.
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "numpy", "ray.train"]


def _context(fresh_interpreters: bool) -> mp.context.BaseContext:
    if fresh_interpreters:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(fn, rank, world_size, store_path, args, out_dir, pg_timeout_s, environ=None):
    if environ is not None:  # a forked rank: the caller's environment now, not the server's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        _hand_back(out_dir, rank, ("ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        _hand_back(out_dir, rank, ("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _hand_back(out_dir: str, rank: int, result: tuple[str, Any]) -> None:
    """Write ``result`` where the parent looks for it, whole or not at all (plain pickle:
    nothing of it lives in memory shared with a process about to exit)."""
    part = os.path.join(out_dir, f"result-{rank}.part")
    with open(part, "wb") as f:
        pickle.dump(result, f)
    os.replace(part, os.path.join(out_dir, f"result-{rank}.pkl"))


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120, pg_timeout_s: float = 60,
    env_per_rank: Callable[[int], dict[str, str]] | None = None,
) -> list[Any]:
    """``env_per_rank(rank)``: extra environment for that rank's fresh interpreter (e.g. a
    different ``PYTHONHASHSEED`` per rank, which must be set before the process starts)."""
    ctx = _context(fresh_interpreters=env_per_rank is not None)
    environ = None if env_per_rank is not None else dict(os.environ)
    store_dir = tempfile.mkdtemp(prefix="raycomp-store-")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, store_path, args, store_dir, pg_timeout_s, environ))
        for r in range(world_size)
    ]
    for rank, p in enumerate(procs):
        extra = env_per_rank(rank) if env_per_rank else {}
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)  # a spawned child copies the parent's environment at start
        try:
            p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            for rank, p in enumerate(procs):
                if rank in results:
                    continue
                path = os.path.join(store_dir, f"result-{rank}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        status, value = pickle.load(f)
                    if status != "ok":
                        errors.append(f"rank {rank}:\n{value}")
                        break
                    results[rank] = value
                elif p.exitcode is not None and not os.path.exists(path):  # gone without a result
                    errors.append(f"rank {rank}: exited with code {p.exitcode} without a result")
                    break
            if len(results) < world_size and not errors:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    errors.append(f"ranks {missing}: no result within {timeout:.0f} s")
                time.sleep(0.02)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        raise AssertionError("distributed run failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]
