"""Shared helpers for benchmark reports: machine description and result files.

Every benchmark writes two files into its output directory:

* ``<name>.json``: a JSON *list* of row objects (one per measurement);
* ``<name>.md``: a human-readable report (command, machine, table, verdicts).

:func:`machine_info` describes where the numbers were taken, :func:`machine_markdown`
renders it, :func:`markdown_table` formats rows, and :func:`write_results` writes both
files atomically.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "command_line", "cpu_model", "eprint", "machine_info", "machine_markdown", "markdown_table", "usable_cores",
    "write_atomic", "write_results",
]


def cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """Cores this process may run on (affinity mask), falling back to ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """Where and when a benchmark ran: CPU, cores, library versions, threads, UTC date."""
    import torch

    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count() or 1,
        "usable_cores": usable_cores(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads() if threads is None else threads,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
    allocator = {
        k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"
    }
    info["allocator_env"] = (
        ", ".join(f"{k}={v}" for k, v in sorted(allocator.items())) or "(default)"
    )
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that reproduces this run, e.g. ``python -m jobs.bench kernels --quick``."""
    return shlex.join(["python", "-m", module, *argv])


def machine_markdown(info: Mapping[str, Any]) -> str:
    """A markdown bullet list describing the machine."""
    labels = {
        "cpu_model": "CPU",
        "logical_cores": "Logical cores",
        "usable_cores": "Usable cores (affinity)",
        "torch_threads": "torch threads",
        "torch": "torch",
        "python": "Python",
        "platform": "Platform",
        "cuda_device": "CUDA device",
        "allocator_env": "Allocator environment (MALLOC_*, LD_PRELOAD)",
        "date_utc": "Date",
    }
    lines = [f"- {label}: {info[key]}" for key, label in labels.items() if key in info]
    lines += [f"- {key}: {value}" for key, value in info.items() if key not in labels]
    return "\n".join(lines)


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None
) -> str:
    """A GitHub-flavoured markdown table.

    ``align`` has one letter per column, ``l`` or ``r``; by default columns holding only
    numbers are right-aligned. Floats are shown with 3 decimals (pre-format them as
    strings for other precisions).
    """

    def is_number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if align is None:
        align = "".join(
            "r" if rows and all(is_number(r[i]) for r in rows) else "l" for i in range(len(headers))
        )
    if len(align) != len(headers) or set(align) - {"l", "r"}:
        raise ValueError(f"align: expected {len(headers)} letters l/r, got {align!r}")
    rule = [":---" if a == "l" else "---:" for a in align]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def write_results(
    name: str, rows: Sequence[Mapping[str, Any]], markdown: str, output_dir: str | os.PathLike
) -> tuple[Path, Path]:
    """Write ``<output_dir>/<name>.json`` (a JSON list of rows) and ``<name>.md``.

    Files are written to a temporary name first and then renamed, so an interrupted run
    never leaves a half-written report. Returns the two paths.
    """
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)):
        raise TypeError(f"rows: expected a list of objects, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"rows[{i}]: expected an object, got {type(row).__name__}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    write_atomic(json_path, json.dumps([dict(r) for r in rows], indent=2, allow_nan=False) + "\n")
    write_atomic(md_path, markdown if markdown.endswith("\n") else markdown + "\n")
    return json_path, md_path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary name beside ``path``, then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def eprint(*args: Any) -> None:
    """Print to stderr (progress and verdicts; stdout stays free), flushed."""
    print(*args, file=sys.stderr, flush=True)
