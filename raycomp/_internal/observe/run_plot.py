"""``raycomp plot RUN``: a run as one PNG, read from its files alone
(:mod:`raycomp._internal.observe.run_files`): the loss, bytes per step and the plan
timeline, sharing the step axis.

matplotlib is an optional dependency: without it ``plot`` exits with 1 and one line naming
the extra that installs it (:data:`PLOT_INSTALL`); 2 when RUN is not a run directory.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from raycomp._internal.observe.run_files import EXIT_NOT_A_RUN, Run, open_run

__all__ = ["PLOT_INSTALL", "figure", "main", "plot"]

EXIT_MISSING_PACKAGE = 1
#: what installs ``raycomp plot``'s optional dependency (matplotlib)
PLOT_INSTALL = 'pip install "raycomp[plot]"'


def _plan_bands(run: Run, end: int) -> list[tuple[int, int, str, bool]]:
    """The plan timeline as bands: (first step, step after the last, what, guard fallback)."""
    bands = []
    for index, entry in enumerate(run.timeline):
        stop = run.timeline[index + 1]["step"] if index + 1 < len(run.timeline) else end
        guarded = entry.get("kind") == "fallback"
        bands.append((entry["step"], max(stop, entry["step"]), str(entry.get("to")), guarded))
    return bands


def plot(run: Run, out: Path) -> Path:
    """Draw the run (:func:`figure`) into a PNG at ``out``. Needs matplotlib (ImportError
    otherwise)."""
    import matplotlib.pyplot as plt

    fig = figure(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def figure(run: Run) -> Any:
    """The run as a matplotlib figure of three panels sharing the step axis: loss (rank
    0, and evaluations), wire and dense bytes per step (all ranks) on a linear axis from 0,
    so that their heights show their real ratio, and the plan timeline (a band per plan,
    colored by what the plan does, fallbacks in red; a legend below names each color, a
    band wide enough carries its version). Needs matplotlib (ImportError otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rank0 = run.steps.get(0, [])
    per_step: dict[int, list[float]] = {}
    for records in run.steps.values():
        wire_before = dense_before = 0.0
        for record in records:
            totals = per_step.setdefault(record["step"], [0.0, 0.0])
            totals[0] += record["wire_bytes"] - wire_before
            totals[1] += record["dense_bytes"] - dense_before
            wire_before, dense_before = record["wire_bytes"], record["dense_bytes"]
    fig, (loss_ax, bytes_ax, plan_ax) = plt.subplots(3, 1, sharex=True, figsize=(9, 7),
                                                     gridspec_kw={"height_ratios": [3, 3, 1.4]})
    loss_ax.plot([r["step"] for r in rank0], [r["loss"] for r in rank0], lw=0.8, label="training loss (rank 0)")
    loss_ax.set_ylabel("loss")
    if run.evals:
        evals_ax = loss_ax.twinx()
        key = next((k for k in run.evals[-1] if k not in ("time", "epoch", "step")
                    and isinstance(run.evals[-1][k], int | float)), None)
        if key is not None:
            points = [(e["step"], e[key]) for e in run.evals if isinstance(e.get(key), int | float)]
            evals_ax.plot(*zip(*points, strict=True), "o-", color="tab:orange", ms=3, lw=0.8, label=key)
            evals_ax.set_ylabel(key)
    steps = sorted(per_step)
    wire = [per_step[s][0] for s in steps]
    dense = [per_step[s][1] for s in steps]
    bytes_ax.plot(steps, wire, lw=0.8, color="tab:green", label="wire")
    bytes_ax.plot(steps, dense, lw=0.8, ls="--", color="tab:gray", label="dense all-reduce")
    # linear from 0: a log axis over a narrow range (1.0937e6-1.0938e6) makes 80 bytes look
    # like the wire far above dense
    bytes_ax.set_ylim(0, max([*wire, *dense, 1.0]) * 1.4)  # room above the lines for the legend
    bytes_ax.yaxis.set_major_formatter(matplotlib.ticker.EngFormatter(unit="B"))
    total_wire, total_dense = sum(wire), sum(dense)
    ratio = f"dense / wire {total_dense / total_wire:.2f}x" if total_wire > 0 else "no bytes on the wire"
    bytes_ax.set_ylabel("bytes / step (all ranks)")
    bytes_ax.legend(loc="upper right", ncol=2, fontsize=8, title=ratio, title_fontsize=8)
    end = (max(steps) + 1) if steps else 1
    bands = _plan_bands(run, end)
    colors = plt.get_cmap("tab10")
    what = list(dict.fromkeys(to for _, _, to, guarded in bands if not guarded))  # each plan one color
    handles: dict[str, Any] = {}
    span = max(end - min((b[0] for b in bands), default=0), 1)
    for index, (start, stop, to, guarded) in enumerate(bands):
        color = "tab:red" if guarded else colors(what.index(to) % 10)
        label = f"{to} (guard fallback)" if guarded else to
        handles[label] = plan_ax.axvspan(start - 0.5, stop - 0.5, color=color, alpha=0.35, lw=0, label=label)
        if (stop - start) / span >= 0.04:  # a version on its band where it fits; the legend says what
            plan_ax.text(start, 0.3 + 0.4 * (index % 2), f" v{run.timeline[index].get('version')}", va="center",
                         fontsize=7, clip_on=True)
    if handles:
        plan_ax.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.55),
                       ncol=min(2, len(handles)), fontsize=7, frameon=False)
    plan_ax.set_ylim(0, 1)
    plan_ax.set_yticks([])
    plan_ax.set_ylabel("plan")
    plan_ax.set_xlabel("step")
    fig.suptitle(str((run.summary or {}).get("run_id", run.directory.name)))
    fig.tight_layout()
    return fig


def main(args: Any) -> int:
    """``raycomp plot`` (``args.run``, ``args.out``)."""
    run = open_run("plot", args.run)
    if run is None:
        return EXIT_NOT_A_RUN
    out = Path(args.out) if getattr(args, "out", None) else run.directory / "raycomp.png"
    try:
        path = plot(run, out)
    except ImportError as error:
        missing = (getattr(error, "name", None) or "matplotlib").split(".")[0]
        print(f"raycomp plot: needs {missing}, not installed: {PLOT_INSTALL}", file=sys.stderr)
        return EXIT_MISSING_PACKAGE
    print(f"wrote {path}")
    return 0
