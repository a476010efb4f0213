"""The end-to-end benchmark's report files: ``<stem>.json`` (the results), ``<stem>.md``
(set-up, the table of medians, the goals) and ``<stem>.png`` (validation curves over training
time), where the stem is ``e2e-<workload>-<link>`` or ``fsdp-<workload>-<link>``."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobs.bench.e2e.methods import FSDP_BASELINES, TORCH_HOOKS
from jobs.bench.e2e.stats import ratio
from jobs.bench.e2e.topology import FLAT, parse_topology
from jobs.bench.report import machine_markdown, markdown_table, write_atomic

__all__ = ["modeled", "plot", "render_markdown", "report_stem", "show", "write_reports"]


def show(value: Any, fmt: str = "{:.2f}", none: str = "—") -> str:
    """``value`` formatted with ``fmt``, or ``none`` when it is missing."""
    return none if value is None else fmt.format(value)


def _seeds(values: Sequence[Any], fmt: str = "{:.1f}") -> str:
    return " / ".join("miss" if v is None else fmt.format(v) for v in values)


def _warmup(row: dict[str, Any]) -> str:
    """A torch baseline's warm-up as the benchmark set it; where a raycomp run compressed from."""
    if row.get("warmup_steps") is not None:
        return f"{row['warmup_steps']} steps" if row["warmup_steps"] else "none"
    return _seeds(row["first_compressed_step_seeds"], "{}").replace("miss", "never")


def report_stem(results: dict[str, Any]) -> str:
    """The report files' name without extension, e.g. ``e2e-gpt-100mbit``, or
    ``e2e-cnn-4x1-100mbit`` for a topology other than the two-node link."""
    prefix = "fsdp" if results.get("strategy") == "fsdp" else "e2e"
    shape = results.get("topology", FLAT)
    tag = "" if shape == FLAT else f"{shape}-"
    return f"{prefix}-{results['workload']['name']}-{tag}{results['link']['rate']}"


def modeled(results: dict[str, Any], name: str) -> bool:
    """Whether ``name``'s wire bytes come from a byte model (torch's hooks, FSDP's own)."""
    return name in (FSDP_BASELINES if results.get("strategy") == "fsdp" else TORCH_HOOKS)


def _fsdp_setup() -> list[str]:
    return [
        "- Strategy **FSDP2** (`scaling.strategy=fsdp`): `fully_shard` on every transformer block, then the "
        "root; parameters are all-gathered fp32 in forward and backward by every method alike (FSDP's default "
        "`reshard_after_forward=True`): only the gradients' reduce-scatter differs.",
        "- `dense`: FSDP's own fp32 reduce-scatter (gloo runs it as an all-reduce: twice the bytes of the "
        "ideal reduce-scatter that the wire column models); `torch_bf16`: FSDP's "
        "`MixedPrecisionPolicy(reduce_dtype=bf16)`, which cannot be switched on mid-run, so it casts from step "
        "0 (no dense warm-up); `raycomp_*`: raycomp's compressed all-to-all per unit, dense (fp32 rows) for "
        "raycomp's own `compression.warmup_steps`, then bf16 / int8 / the adaptive policy (int4, int8, bf16 or "
        "dense per unit).",
        "- Compute-only step: 1 worker without FSDP (FSDP at one worker adds local copies, no communication).",
    ]


def render_markdown(results: dict[str, Any]) -> str:
    """The markdown report of :func:`~jobs.bench.e2e.analysis.analyze`'s results."""

    wl, link, target = results["workload"], results["link"], results["target"]
    methods = results["methods"]
    dense = next((m for m in methods if m["name"] == "dense"), {})
    dense_t = dense.get("time_to_target_s")
    compute = results["compute_step_s"]
    metric = target["metric"]
    mfmt = "{:.4f}"
    bound = results.get("compute_bound_time_to_target_s")
    table = markdown_table(
        ["method", "time to target s (median)", "per seed", "vs dense", "vs compute-bound", "steps to target",
         f"final {metric}", "wire bytes", "NIC bytes to stop", "NIC B/step", "step ms", "step / no-comm",
         "control share", "warm-up / compressed from"],
        [[m["name"] + (f" ({m['variant']})" if m.get("variant") else ""), show(m["time_to_target_s"], "{:.1f}"),
          _seeds(m["time_to_target_s_seeds"]),
          show(ratio(dense_t, m["time_to_target_s"]), "{:.2f}x"), show(m.get("vs_compute_bound"), "{:.2f}x"),
          _seeds(m["steps_to_target_seeds"], "{}"),
          show(m["final_metric"], mfmt), show(m["wire_bytes"], "{:,.0f}") + ("*" if modeled(results, m.get("variant") or m["name"]) else ""),
          show(m.get("nic_bytes_to_stop"), "{:,.0f}"), show(m["nic_bytes_per_step"], "{:,.0f}"),
          show(m["step_s"] * 1e3 if m["step_s"] else None, "{:.0f}"),
          show(m.get("step_vs_no_comm"), "{:.2f}x"),
          show(m["control_share"] * 100 if m["control_share"] is not None else None, "{:.1f}%"),
          _warmup(m)] for m in methods],
        align="lllrrlrrrrrrrl",
    )
    grids = [f"- `{m['name']}`, each H (median time to target s / final {metric}): "
             + "; ".join(f"{g['variant']}: {show(g['time_to_target_s'], '{:.1f}')} / {show(g['final_metric'], mfmt)}"
                         + _grid_seeds(g, m["grid"]) for g in m["grid"]) for m in methods if m.get("grid")]
    failures = [f"- {m['name']}: {e}" for m in methods for e in m["errors"]]
    load = results.get("load_average") or {}
    requested = results.get("seeds_requested") or results["seeds"]
    measured = link["measured_mbit_s"]
    check = link["check"]
    parts = [
        f"# {'FSDP end-to-end' if results.get('strategy') == 'fsdp' else 'End-to-end'} benchmark: {wl['name']} "
        f"over a {link['rate']} link{_shape(results)}, {len(results['seeds'])} seed{'' if len(results['seeds']) == 1 else 's'}",
        "",
        f"Generated by `jobs/bench/e2e/`; every number in `{report_stem(results)}.json`, curves in "
        f"`{report_stem(results)}.png`.",
        "",
        "## Command",
        "",
        f"```\n{results.get('command', '')}\n```",
        "",
        *([f"**Stopped early: {len(results['seeds'])} of the {len(requested)} requested seeds "
            f"({', '.join(map(str, requested))}) ran every method**; the medians below are over those, dense's "
            "(which ran first on every seed and sets the target) over each seed it ran.", ""]
          if len(results["seeds"]) < len(requested) else []),
        f"Mode **{results['mode']}**; the whole benchmark took {show(results.get('benchmark_seconds'), '{:.0f}')} s "
        f"(load average {show((load.get('start') or [None])[0], '{:.1f}')} at the start, "
        f"{show((load.get('end') or [None])[0], '{:.1f}')} at the end).",
        "",
        "## Machine",
        "",
        machine_markdown(results.get("machine") or {}),
        "",
        "## Set-up",
        "",
        f"- Workload `{wl['config']}`: {wl['parameters']:,} parameters ({wl['parameters'] * 4 / 1e6:.1f} MB fp32), "
        f"{parse_topology(results.get('topology', FLAT)).describe()}, a budget of {wl['steps']} steps for every method (the "
        "LR schedule's length), validation "
        f"{metric} on the fixed validation set every {wl['eval_every_steps']} steps, seeds "
        f"{', '.join(map(str, results['seeds']))}; same data order, LR schedule and step budget for all.",
        f"- Link: {next(iter(link['shaping']['qdisc'].values()), None)} on each end of "
        f"{'the veth' if results.get('topology', FLAT) == FLAT else 'every node' + chr(39) + 's link to the switch'}; "
        "measured (one bulk TCP flow each way) "
        f"{show(check.get('a_to_b', {}).get('bits_per_s', 0) / 1e6, '{:.1f}')} / "
        f"{show(check.get('b_to_a', {}).get('bits_per_s', 0) / 1e6, '{:.1f}')} Mbit/s of payload "
        f"(min {show(measured, '{:.1f}')})"
        + (f", TCP round trip median {check['rtt']['median_s'] * 1e6:.0f} µs." if check.get("rtt") else "."),
        *(_fsdp_setup() if results.get("strategy") == "fsdp" else [
            "- No shared warm-up: each method warms up as its authors recommend and the warm-up counts in its "
            "time. torch PowerSGD: `start_powerSGD_iter` = 10% of the budget (torch's docs); torch post-local SGD: "
            "DDP for `start_localSGD_iter` = W steps (about 10% of the budget, W + 1 a multiple of 16 so that "
            "evaluations see averaged weights, unless `--localsgd-start`), then "
            "`PeriodicModelAverager` every H steps, no gradient exchange in between; torch's bf16 hook and "
            "torchft's DiLoCo: none; raycomp: its own config (*compressed from* shows where each raycomp run "
            "really started: the first step whose ledger bytes fell below dense).",
            f"- torch PowerSGD: one DDP bucket (`bucket_cap_mb={wl['torch_powersgd_bucket_cap_mb']}`, above the "
            "model's fp32 size; with several buckets `powerSGD_hook` aborts or hangs on gloo). Other DDP methods: "
            + (f"the same DDP buckets, `bucket_cap_mb={wl['ddp_bucket_cap_mb']}` (`compression.bucket_cap_mb`), so "
               "they overlap communication with backward alike." if wl.get("ddp_bucket_cap_mb") is not None
               else "DDP's default buckets."),
            "- A grid (torch post-local SGD, torchft DiLoCo, raycomp's local steps: H in 4, 8, 16) is reported under "
            "its name with its best H: the shortest median time to target, else the best final metric, compared on "
            "the seeds every H ran. The default run holds only the H an earlier run of the whole grid chose on this "
            "workload, where there was one (`best_h` in `jobs/bench/e2e/methods.py`); the H run are listed below.",
            *grids]),
        f"- `raycomp_adaptive` = the shipped default policy (`{wl['adaptive_policy']}`), untuned.",
        f"- Target: validation {metric} {'<=' if target['lower_is_better'] else '>='} "
        f"**{show(target['value'], mfmt)}** ({target['source']}). Every run stops once the target held at "
        f"{target['consecutive']} consecutive evaluations (with an auto target, dense runs its whole budget "
        "first). Time to target: training wall time from the end of step 0, evaluation/report pauses "
        "subtracted, at the first of those evaluations; median over seeds with a miss counted as infinitely "
        "slow (— when most seeds missed).",
        f"- Compute-bound time to target (the physical limit beside every ratio): dense's median steps to "
        f"target x the median step without communication = **{show(bound, '{:.1f}')} s**; at most "
        f"**{show(ratio(dense_t, bound), '{:.2f}x')}** faster than dense.",
        f"- Compute-only step (1 worker, no DDP, same per-worker batch, same loop): "
        f"**{show(compute * 1e3 if compute else None, '{:.0f}')} ms**.",
        *(["- Step without communication (every worker, DDP with the same buckets, torch's `noop_hook` in place "
           "of every collective, so each rank keeps its own gradient; one run before each seed's methods, and "
           "`step / no-comm` divides each seed's step by its own): **"
           + " / ".join(f"{v * 1e3:.0f}" for v in results["no_comm_step_s_seeds"].values())
           + " ms** (seeds " + ", ".join(results["no_comm_step_s_seeds"]) + "). The compute-only worker "
           "has the machine to itself; the workers share its cores, caches and memory even without a network."]
          if results.get("no_comm_step_s_seeds") else []),
        ("- Wire bytes: all ranks, raycomp's ledger (the gradients' reduce-scatter only); * = FSDP's own, byte "
         "model of an ideal reduce-scatter ((N-1)/N x payload). NIC bytes:" if results.get("strategy") == "fsdp" else
         "- Wire bytes: all ranks, raycomp's ledger; * = torch hooks, byte model of the hook (ring all-reduce "
         "2(N-1)/N x payload). NIC bytes:")
        + (" veth tx+rx in namespace a" if results.get("topology", FLAT) == FLAT else
           " tx+rx of node 0's link (the head's; on a ring every node's link carries as much)")
        + " from the end of step 0, "
        f"minus idle Ray traffic ({link['idle_ray_bytes_per_s']:,.0f} B/s) x that time. Step time: mean "
        "step gap after compression started + one control interval, evaluation gaps excluded. Control "
        "share: the session's control time / step time.",
        "",
        "## Results (medians over seeds)",
        "",
        table,
        "",
        "## Goals",
        "",
        *[f"- {g['goal']}: **{g.get('note') or show(g['value'], '{:.3f}')}** — **{'PASS' if g['ok'] else 'MISS'}**"
          + (f" (physical limit, at the compute-bound time: {g['limit']:.2f})" if g.get("limit") is not None else "")
          + (f" ({g['detail']})" if g.get("detail") else "")
          for g in results["goals"]],
        "",
    ]
    predictions = _predictions(results)
    if predictions:
        parts += ["## Predicted against measured step (adaptive)", "",
                  "Each plan the adaptive policy priced: the step the controller predicted for it and the mean step "
                  "measured while it held, from one control interval after it was published to the next plan "
                  "(evaluation gaps excluded; plans held under 5 steps not scored).", "", predictions, ""]
    if failures:
        parts += ["## Failed runs", "", *failures, ""]
    return "\n".join(parts)


def _shape(results: dict[str, Any]) -> str:
    shape = results.get("topology", FLAT)
    return "" if shape == FLAT else f" per node, {parse_topology(shape).workers} workers as {shape}"


def _predictions(results: dict[str, Any]) -> str:
    ada = next((m for m in results["methods"] if m["name"] == "raycomp_adaptive"), None)
    rows = [[run["seed"], p["step"], p["steps"], p.get("rule") or "", show(p["predicted_s"] * 1e3, "{:.0f}"),
             show(p["measured_s"] * 1e3, "{:.0f}"), f"{p['error']:+.1%}"]
            for run in (ada or {}).get("runs") or [] for p in run.get("plan_predictions") or []]
    if not rows:
        return ""
    return markdown_table(["seed", "published at step", "steps measured", "rule", "predicted ms", "measured ms",
                           "error"], rows, align="rrrlrrr")


def plot(results: dict[str, Any], path: Path) -> None:
    """Every run's validation curve over training time (modeled methods dashed), the target dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 1, figsize=(9, 5))
    for i, m in enumerate(results["methods"]):
        color = plt.cm.tab20(i % 20)
        for j, run in enumerate(m["runs"]):
            pts = [p for p in run["curve"] if p["train_s"] is not None]
            ax.plot([p["train_s"] for p in pts], [p["value"] for p in pts], "--" if modeled(results, m["name"]) else "-",
                    color=color, lw=1, alpha=0.8, label=m["name"] if j == 0 else None)
    if results["target"]["value"] is not None:
        ax.axhline(results["target"]["value"], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("training wall time (s, evaluation pauses excluded)")
    ax.set_ylabel(f"validation {results['target']['metric']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{results['workload']['name']} over {results['link']['rate']}, {results.get('topology', FLAT)} "
                 f"({results['mode']}, "
                 f"{len(results['seeds'])} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: dict[str, Any], out: Path) -> list[Path]:
    """Write the JSON, markdown and plot into ``out``; the paths (a failed plot is logged only)."""

    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out / f"{report_stem(results)}.{ext}" for ext in ("json", "md", "png"))
    write_atomic(json_path, json.dumps(results, indent=2, allow_nan=False) + "\n")
    write_atomic(md_path, render_markdown(results))
    try:
        plot(results, png_path)
    except Exception as error:  # noqa: BLE001 - the numbers matter more than the plot
        print(f"e2e: plot failed: {error}", file=sys.stderr)
    return [json_path, md_path, png_path]


def _grid_seeds(variant: dict[str, Any], grid: list[dict[str, Any]]) -> str:
    """`` (seed 0)`` after a grid variant whose seeds differ from another variant's."""
    seeds = variant.get("seeds")
    if seeds is None or all(g.get("seeds") == seeds for g in grid):
        return ""
    return f" (seed{'' if len(seeds) == 1 else 's'} {', '.join(map(str, seeds))})"
