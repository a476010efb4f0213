"""What a ``jobs.train`` run leaves in its output directory at the end: ``summary.json`` (the
workers' totals, the controller's account of the policy, the config) and ``plot.png``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from jobs.config import JobConfig

__all__ = ["build_summary", "plot", "write_outputs", "write_summary"]

log = logging.getLogger("raycomp.train")


def build_summary(config: JobConfig, run_id: str, status: str, error: str | None, worker: dict[str, Any],
                  controller: dict[str, Any], wall: float, output: Path) -> dict[str, Any]:
    wire, dense = worker.get("wire_bytes_total", 0.0), worker.get("dense_bytes_total", 0.0)
    steps = worker.get("steps", 0)
    summary = {
        "run_id": run_id,
        "status": status,
        "error": error,
        "steps": steps,
        "epochs": worker.get("epochs", 0),
        "world_size": worker.get("world_size", config.scaling.num_workers),
        "workload": config.workload.name,
        "wire_bytes_total": wire,
        "dense_bytes_total": dense,
        "compression_ratio": dense / wire if wire else None,
        "plan_switches": worker.get("plan_switches", 0),
        "fallback_events": worker.get("fallback_events", []),
        "skipped_steps": worker.get("skipped_steps", 0),
        "wall_seconds": wall,
        "steps_per_second": steps / wall if wall > 0 else 0.0,
        "controller_outages": worker.get("controller_outages", 0),
        "control_overhead": worker.get("control_overhead"),
        "control_seconds": worker.get("control_seconds"),
        "control_boundary_seconds": worker.get("control_boundary_seconds"),  # of control_seconds
        "stats_dropped": worker.get("stats_dropped", 0),
        "replayed_steps": worker.get("replayed_steps", 0),
        "restored_from_step": worker.get("restored_from_step"),
        "final_plan": worker.get("final_plan"),
        "ddp_bucket_cap_mb": worker.get("ddp_bucket_cap_mb"),
        "policy": {"name": config.compression.policy, **controller},
        "output_dir": str(output),
        "config": config.model_dump(mode="json"),
    }
    for key in ("final_eval_accuracy", "final_eval_loss"):
        if key in worker:
            summary[key] = worker[key]
    warnings = []
    if worker.get("controller_outages"):
        warnings.append(f"controller unreachable {worker['controller_outages']} times; "
                        "training continued on the last plan")
    if "error" in controller:
        warnings.append(controller["error"])
    summary["warnings"] = warnings
    return summary


def write_summary(summary: dict[str, Any], output: Path) -> None:
    """``summary.json``, replaced atomically: a reader sees the workers' one or this one."""
    path = Path(output) / "summary.json"
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(summary, indent=2, default=str))
    os.replace(partial, path)


def write_outputs(summary: dict[str, Any], output: Path) -> None:
    write_summary(summary, output)
    try:
        plot(output)
    except Exception as failure:  # noqa: BLE001 - a missing plot must not lose the summary
        log.warning("plot failed: %s", failure)


def plot(output: Path) -> None:
    """Loss and per-step compression ratio of rank 0 over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (output / "steps" / "rank0.jsonl").read_text().splitlines()]
    if not records:
        return
    steps = [r["step"] for r in records]
    ratios, previous = [], (0.0, 0.0)
    for r in records:
        wire, dense = r["wire_bytes"] - previous[0], r["dense_bytes"] - previous[1]
        ratios.append(dense / wire if wire > 0 else float("nan"))
        previous = (r["wire_bytes"], r["dense_bytes"])
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.plot(steps, [r["loss"] for r in records], lw=0.8)
    top.set_ylabel("training loss (rank 0)")
    bottom.plot(steps, ratios, lw=0.8, color="tab:green")
    bottom.set_yscale("log")
    bottom.set_ylabel("compression ratio (dense / wire)")
    bottom.set_xlabel("step")
    for r in records:
        if r["fallback"]:
            bottom.axvspan(r["step"] - 0.5, r["step"] + 0.5, color="tab:red", alpha=0.15, lw=0)
    fig.suptitle(output.name)
    fig.tight_layout()
    fig.savefig(output / "plot.png", dpi=110)
    plt.close(fig)
