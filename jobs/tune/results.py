"""What a search leaves: one row per trial (best first), ``results.csv``/``results.md``,
``best_config.yaml`` and ``pareto.png``."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from jobs.config import load_config, validate
from jobs.tune.objective import METRIC, TIME_ATTR
from jobs.tune.space import trial_config
from jobs.tune.spec import TuneSetup
from jobs.tune.trials import finish_run

__all__ = ["best_row", "collect", "pareto_front", "plot_pareto", "report", "write_best_config", "write_tables"]


SUMMARY_STATUS = {"succeeded": "completed", "stopped": "stopped", "failed": "error"}


def collect(tuning: TuneSetup, grid: Any, complete: bool = True) -> list[dict[str, Any]]:
    """One row per trial, best first. Status: completed, stopped (by ASHA), error, or
    unfinished (the search was interrupted before the trial ended)."""
    rows = []
    for result in grid:
        config = result.config or {}
        metrics = result.metrics or {}
        variant = config.get("variant", "unknown")
        found = re.search(r"[0-9a-f]{5}_\d{5}", Path(result.path).name)
        trial_id = metrics.get("trial_id") or (found.group(0) if found else Path(result.path).name)
        run_id = metrics.get("run_id") or f"{tuning.spec.name}-{trial_id}"
        epochs_done = int(metrics.get(TIME_ATTR, 0) or 0)
        summary = tuning.runs_dir / run_id / "summary.json"
        recorded = json.loads(summary.read_text()).get("status") if summary.exists() else None
        if result.error is not None:
            status = "error"
        elif recorded == "failed":  # Tune saw no error: the failure is ASHA's abort
            status = "stopped"
        elif recorded in SUMMARY_STATUS:  # what the trial itself wrote at its end
            status = SUMMARY_STATUS[recorded]
        elif not complete:
            status = "unfinished"
        else:
            status = "completed" if epochs_done >= tuning.epochs else "stopped"
        wire, dense = metrics.get("wire_bytes"), metrics.get("dense_bytes")
        row = {
            "trial_id": trial_id,
            "run_id": run_id,
            "variant": variant,
            "status": status,
            "epochs": epochs_done,
            METRIC: metrics.get(METRIC),
            tuning.metric_key: metrics.get(tuning.metric_key),
            "wire_bytes": wire,
            "dense_bytes": dense,
            "compression_ratio": dense / wire if wire else None,
            "seconds": metrics.get("trial_elapsed_s"),
            **({} if tuning.spec.objective.at_budget
               else {"reached_target": metrics.get("reached_target")}),
            "error": _first_line(result.error) if result.error is not None else "",
        }
        params = config.get("params", {}) if variant == "search" else {}
        for key in tuning.search:  # baselines ignore the sampled values: blank
            row[key] = params.get(key, "")
        row["_params"] = params
        rows.append(row)
    return sorted(rows, key=lambda r: _rank_key(tuning, r))


def _rank_key(tuning: TuneSetup, row: dict[str, Any]) -> tuple:
    order = {"completed": 0, "stopped": 1, "unfinished": 2, "error": 3}[row["status"]]
    score = row[METRIC]
    if score is None:
        return (order, 1, math.inf)
    reached = 0 if row.get("reached_target") in (True, None) else 1
    signed = -score if tuning.spec.objective.mode == "max" else score
    return (order, reached, signed, row["wire_bytes"] or math.inf)  # ties: fewer bytes first


def _first_line(error: Any) -> str:
    text = str(error).strip().splitlines()
    return (text[-1] if text else type(error).__name__)[:200]


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    completed = [r for r in rows if r["status"] == "completed" and r[METRIC] is not None]
    return completed[0] if completed else None  # rows are sorted best first


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def write_tables(tuning: TuneSetup, rows: list[dict[str, Any]]) -> tuple[Path, Path]:
    columns = [c for c in rows[0] if not c.startswith("_")] if rows else ["trial_id"]
    csv_path, md_path = tuning.exp_dir / "results.csv", tuning.exp_dir / "results.md"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([json.dumps(row[c]) if isinstance(row[c], (dict, list)) else
                             "" if row[c] is None else row[c] for c in columns])
    objective = tuning.spec.objective
    goal = (f"byte budget {objective.byte_budget:.4g}" if objective.at_budget
            else f"target {objective.metric} {objective.target}")
    shown = [c for c in columns if c not in ("error",)]
    lines = [
        f"# Tune results: {tuning.spec.name}",
        "",
        f"Objective: `{objective.kind}` ({goal}, {objective.mode}imise). "
        f"{len(rows)} trials, best first; `stopped` = stopped early by ASHA"
        + ("; `unfinished` = the search was interrupted: run the same command to resume it."
           if any(r["status"] == "unfinished" for r in rows) else "."),
        "",
        "| " + " | ".join(shown) + " |",
        "| " + " | ".join("---:" if c in ("epochs", METRIC, tuning.metric_key, "wire_bytes", "dense_bytes",
                                           "compression_ratio", "seconds") else "---" for c in shown) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]).replace("|", "\\|") for c in shown) + " |")
    errors = [r for r in rows if r["error"]]
    if errors:
        lines += ["", "Errors:", ""] + [f"- `{r['trial_id']}`: {r['error']}" for r in errors]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def write_best_config(tuning: TuneSetup, best: dict[str, Any]) -> Path:
    config = trial_config(tuning.base, best["variant"], best["_params"])
    data = config.model_dump(mode="json")
    data["run"]["name"] = f"{tuning.spec.name}-best"[:64]
    validate(data)  # still a valid job config
    objective = tuning.spec.objective
    header = [
        f"# Best compression schedule of the search {tuning.spec.name!r} ({objective.kind}: "
        f"{best[METRIC]:.6g}, {tuning.metric_key.replace('_', ' ')} {best[tuning.metric_key]}, "
        f"wire bytes {best['wire_bytes']:.4g}).",
        f"# Trial {best['trial_id']} ({best['variant']}), run id {best['run_id']}.",
        "# Run it:  python -m jobs.train --config <this file>",
        "#     or:  ray job submit --working-dir . --runtime-env jobs/runtime_env.yaml -- "
        "python -m jobs.train --config <this file>",
    ]
    if best["variant"] != "search":
        header.append(f"# Note: the {best['variant']} baseline beat every searched schedule.")
    path = tuning.exp_dir / "best_config.yaml"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)
    load_config(path)  # what users will do with it
    return path


def pareto_front(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Completed trials no other completed trial beats on both the metric ``key`` (a loss:
    lower is better) and wire bytes."""
    sign = -1.0 if key == "eval_loss" else 1.0
    points = [(sign * r[key], r) for r in rows
              if r["status"] == "completed" and r["wire_bytes"] and r[key] is not None]
    front = [p for m, p in points if not any(
        n >= m and q["wire_bytes"] <= p["wire_bytes"] and (n > m or q["wire_bytes"] < p["wire_bytes"])
        for n, q in points)]
    return sorted(front, key=lambda r: r["wire_bytes"])


def plot_pareto(tuning: TuneSetup, rows: list[dict[str, Any]], best: dict[str, Any] | None,
                complete: bool = True) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    key = tuning.metric_key
    usable = [r for r in rows if r["wire_bytes"] and r[key] is not None]
    searched = [r for r in usable if r["variant"] == "search"]
    for status, style in (("completed", {"color": "tab:blue", "alpha": 0.8}),
                          ("stopped", {"facecolors": "none", "edgecolors": "tab:gray"}),
                          ("unfinished", {"facecolors": "none", "edgecolors": "tab:purple"}),
                          ("error", {"color": "tab:red", "marker": "x"})):
        group = [r for r in searched if r["status"] == status]
        if group:
            ax.scatter([r["wire_bytes"] for r in group], [r[key] for r in group], s=36,
                       label=f"searched, {status}" + (" (ASHA)" if status == "stopped" else ""), **style)
    markers = {"dense": ("s", "tab:red", "dense baseline (all-reduce)"),
               "default": ("D", "tab:orange", f"base config as is ({tuning.base['compression']['policy']})")}
    for variant, (marker, color, label) in markers.items():
        for r in (r for r in usable if r["variant"] == variant):
            ax.scatter([r["wire_bytes"]], [r[key]], marker=marker, s=90, color=color,
                       edgecolors="black", zorder=3, label=label + ("" if r["status"] == "completed" else
                                                                    f" [{r['status']}]"))
    front = pareto_front(rows, key)
    if front:
        ax.plot([r["wire_bytes"] for r in front], [r[key] for r in front], "--", marker="|",
                color="tab:green", lw=1, label="Pareto front")
    if best is not None and best["wire_bytes"]:
        ax.scatter([best["wire_bytes"]], [best[key]], marker="*", s=320, color="gold",
                   edgecolors="black", zorder=4, label=f"best ({tuning.spec.objective.kind})")
    objective = tuning.spec.objective
    if objective.at_budget:
        ax.axvline(objective.byte_budget, color="gray", lw=0.8, ls=":", label="byte budget")
    else:
        ax.axhline(objective.target, color="gray", lw=0.8, ls=":", label=f"target {objective.metric}")
    ax.set_xscale("log")
    ax.set_xlabel("wire bytes, all ranks (log)")
    ax.set_ylabel(f"{key.replace('_', ' ')} (last reported epoch)")
    ax.set_title(f"{tuning.spec.name}: {objective.metric} vs wire bytes ({len(rows)} trials"
                 + ("" if complete else ", interrupted") + ")")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right" if objective.metric == "loss" else "lower right")
    fig.tight_layout()
    path = tuning.exp_dir / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish_stopped_runs(tuning: TuneSetup, rows: list[dict[str, Any]]) -> None:
    """Make each stopped trial's summary and controller record say so (a trial Tune ended
    quickly may not have managed it itself)."""
    from jobs.train import write_summary

    for row in rows:
        if row["status"] == "completed":
            continue
        path = tuning.runs_dir / row["run_id"] / "summary.json"
        summary = json.loads(path.read_text()) if path.exists() else None
        if summary is not None and row["status"] == "stopped" and summary.get("status") == "failed":
            summary.update(status="stopped", error=None)
            write_summary(summary, path.parent)
        if summary is None or summary.get("status") == "stopped":
            finish_run(tuning.base, row["run_id"], row["status"])


def report(tuning: TuneSetup, grid: Any) -> dict[str, Any]:
    expected = tuning.spec.num_samples + len(tuning.spec.baselines)
    complete = grid.num_terminated + grid.num_errors >= expected
    rows = collect(tuning, grid, complete)
    if complete:
        finish_stopped_runs(tuning, rows)
    best = best_row(rows) if complete else None
    csv_path, md_path = write_tables(tuning, rows)
    outputs = {"results_csv": str(csv_path), "results_md": str(md_path), "trials": len(rows),
               "expected_trials": expected, "complete": complete, "best": None}
    if best is not None:
        outputs["best_config"] = str(write_best_config(tuning, best))
        outputs["best"] = {k: v for k, v in best.items() if not k.startswith("_")}
    outputs["pareto_png"] = str(plot_pareto(tuning, rows, best, complete))
    (tuning.exp_dir / "outputs.json").write_text(json.dumps(outputs, indent=2, default=str))
    return outputs
