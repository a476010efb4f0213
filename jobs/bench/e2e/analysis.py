"""The end-to-end benchmark's analysis: raw traces of every run -> the results (per-method
rows of medians over seeds, the target, the references, the goals' verdicts).

Pure: :func:`analyze` reads what the driver wrote (``raw.json``) and the link's settings,
so ``--reanalyze`` rebuilds a report from a finished run without training.
"""

from __future__ import annotations

import math
from typing import Any

from jobs.bench.e2e.judge import judge
from jobs.bench.e2e.methods import (
    COMPUTE,
    FSDP_BASELINES,
    NO_COMM,
    REFERENCES,
    TORCH_HOOKS,
    methods_of,
)
from jobs.bench.e2e.stats import median, median_with_misses, spread
from jobs.bench.e2e.traces import (
    CONSECUTIVE,
    eval_series,
    first_compressed_step,
    interpolate_counters,
    steady_step_s,
    target_index,
    torch_hook_bytes,
    training_clock,
)

__all__ = ["TARGET_AT", "aggregate", "analyze", "analyze_run", "resolve_target"]

TARGET_AT = 0.75  # --target auto: dense's median metric at the evaluation at this share of the budget


def analyze_run(run: dict[str, Any], raw: dict[str, Any], settings: dict[str, Any],
                idle_rate: float) -> dict[str, Any]:
    """One run's numbers (target-independent)."""
    name, summary, steps = run["method"], run["summary"], run["steps"]
    world = 1 if name == COMPUTE else 2
    metric = raw["metric"]
    series = eval_series(run["evals"], metric)
    eval_steps = [e["step"] for e in series]
    clock = training_clock(steps, eval_steps)
    done = len(steps)
    sharded = settings.get("strategy") == "fsdp"
    numel = sum(math.prod(shape) for shape in raw["layers"].values())
    if sharded and name in FSDP_BASELINES:  # FSDP's own reduce-scatter: the ideal one's bytes
        wire = world * done * (world - 1) / world * FSDP_BASELINES[name] * numel
        first = 0 if name != "dense" else None
    elif name in TORCH_HOOKS and not sharded:
        start = settings["warmup"] if name != "dense" else 0
        rank = int(name[-1]) if name.startswith("torch_powersgd") else 2
        per_step = torch_hook_bytes(TORCH_HOOKS[name], raw["layers"], world, done, rank, start)
        wire = world * sum(per_step)
        first = start if name != "dense" else None
    else:
        wire = float(summary.get("wire_bytes_total") or 0.0) or \
            (world * float(steps[-1]["wire_bytes"]) if steps else 0.0)
        first = first_compressed_step(steps)
    dense = world * sum(torch_hook_bytes("allreduce", raw["layers"], world, done)) if world > 1 else 0.0
    if sharded:  # an fp32 reduce-scatter sends half of an all-reduce's bytes
        dense = world * done * (world - 1) / world * 4 * numel if world > 1 else 0.0
    nic = None
    times = sorted(float(r["time"]) for r in steps if r.get("time") is not None)
    if len(times) > 1 and run["nic"]:
        (tx0, rx0), (tx1, rx1) = interpolate_counters(run["nic"], times[0]), interpolate_counters(run["nic"], times[-1])
        nic = (tx1 - tx0) + (rx1 - rx0) - idle_rate * (times[-1] - times[0])
    steady_from = (first if first is not None else settings["warmup"]) + raw["interval_steps"] \
        if name not in ("dense", *REFERENCES) else 2
    step_s, step_n = steady_step_s(steps, eval_steps, steady_from)
    control = summary.get("control_overhead")
    return {
        "method": name, "seed": run["seed"], "status": summary.get("status"), "error": summary.get("error"),
        "steps": done, "curve": [{**e, "train_s": clock.get(e["step"])} for e in series],
        "final_metric": series[-1]["value"] if series else None,
        "wire_bytes": wire, "dense_bytes": dense, "nic_bytes": nic,
        "nic_bytes_per_step": nic / (done - 1) if nic is not None and done > 1 else None,
        "step_s": step_s, "step_s_steps": step_n, "steady_from_step": steady_from,
        "first_compressed_step": first, "control_share": control,
        "controller_cpu_s": run.get("controller_cpu_s"), "fit_s": run["t_end"] - run["t_start"],
        "placement": run.get("placement"), "load_average": run.get("load_average"),
    }


def resolve_target(runs: list[dict[str, Any]], settings: dict[str, Any], metric: str) -> dict[str, Any]:
    """The fixed ``--target``, or 'auto': dense's median metric at the first evaluation at or
    after ``TARGET_AT`` of the step budget."""
    if settings["target"] is not None:
        return {"value": settings["target"], "source": "fixed (--target)"}
    at = math.ceil(TARGET_AT * settings["steps"])
    values = [next((p["value"] for p in r["curve"] if p["step"] >= at), None)
              for r in runs if r["method"] == "dense"]
    value = median(values)
    return {"value": value, "source": f"auto: median over seeds of dense's validation {metric} at the first "
            f"evaluation at or after step {at} ({TARGET_AT:.0%} of the {settings['steps']}-step budget)"}


def aggregate(per_seed: list[dict[str, Any]], target: float | None, lower_is_better: bool) -> dict[str, Any]:
    """One method's row: per-seed time to target and medians over seeds."""
    ttt, steps_to = [], []
    for r in per_seed:
        i = None if target is None else target_index([p["value"] for p in r["curve"]], target, lower_is_better)
        hit = r["curve"][i] if i is not None else None
        ttt.append(hit["train_s"] if hit else None)
        steps_to.append(hit["step"] if hit else None)
    return {
        "name": per_seed[0]["method"],
        "time_to_target_s": median_with_misses(ttt),
        "time_to_target_s_seeds": ttt,
        "time_to_target_spread_s": spread(ttt),
        "steps_to_target_seeds": steps_to,
        "final_metric": median([r["final_metric"] for r in per_seed]),
        "final_metric_seeds": [r["final_metric"] for r in per_seed],
        "wire_bytes": median([r["wire_bytes"] for r in per_seed]),
        "dense_bytes": median([r["dense_bytes"] for r in per_seed]),
        "nic_bytes": median([r["nic_bytes"] for r in per_seed]),
        "nic_bytes_per_step": median([r["nic_bytes_per_step"] for r in per_seed]),
        "step_s": median([r["step_s"] for r in per_seed]),
        "control_share": median([r["control_share"] for r in per_seed]),
        "first_compressed_step_seeds": [r["first_compressed_step"] for r in per_seed],
        "status_seeds": [r["status"] for r in per_seed],
        "errors": [r["error"] for r in per_seed if r["error"]],
        "steps_seeds": [r["steps"] for r in per_seed],
        "runs": per_seed,
    }


def analyze(raw: dict[str, Any], settings: dict[str, Any], shaping: dict[str, Any],
            check: dict[str, Any]) -> dict[str, Any]:
    """Every run of ``raw`` analysed, grouped by method (in the order of the methods table),
    the target resolved, each step divided by its own seed's no-communication step, and the
    goals judged (:func:`~jobs.bench.e2e.judge.judge`)."""
    idles = raw["idle"]
    idle_rate = sum(i["tx_bytes"] + i["rx_bytes"] for i in idles) / max(1e-9, sum(i["seconds"] for i in idles)) \
        if idles else 0.0
    lower = raw["metric"] == "loss"
    runs = [analyze_run(r, raw, settings, idle_rate) for r in raw["runs"]]
    compute = [r for r in runs if r["method"] == COMPUTE]
    no_comm = {r["seed"]: r["step_s"] for r in runs if r["method"] == NO_COMM and r["step_s"]}
    runs = [r for r in runs if r["method"] not in REFERENCES]
    target = resolve_target(runs, settings, raw["metric"])
    methods = [aggregate([r for r in runs if r["method"] == name], target["value"], lower)
               for name in methods_of(settings.get("strategy", "ddp")) if any(r["method"] == name for r in runs)]
    for m in methods:  # each seed's step over its own group's no-communication step
        m["step_vs_no_comm"] = median([r["step_s"] / no_comm[r["seed"]] for r in m["runs"]
                                        if r["step_s"] and r["seed"] in no_comm])
    measured = [check[k]["bits_per_s"] / 1e6 for k in ("a_to_b", "b_to_a") if "bits_per_s" in check.get(k, {})]
    results = {
        "workload": {"name": settings["workload"], "parameters": sum(math.prod(s) for s in raw["layers"].values()),
                     "config": settings["config"], "steps": settings["steps"],
                     "eval_every_steps": settings["eval_every"], "warmup_steps": settings["warmup"],
                     "world_size": 2, "adaptive_policy": raw.get("default_policy"),
                     "torch_powersgd_bucket_cap_mb": raw.get("bucket_cap_mb"),
                     "ddp_bucket_cap_mb": raw.get("ddp_bucket_cap_mb")},
        "link": {"rate": settings["link"], "measured_mbit_s": min(measured) if measured else None,
                 "shaping": shaping, "check": check, "idle_ray_bytes_per_s": idle_rate},
        "target": {"metric": raw["metric"], "value": target["value"], "lower_is_better": lower,
                   "source": target["source"], "consecutive": CONSECUTIVE},
        "seeds": [s for s in settings["seeds"] if any(r["seed"] == s for r in runs)],
        "seeds_requested": settings["seeds"],
        "compute_step_s": compute[0]["step_s"] if compute else None,
        "no_comm_step_s": median(list(no_comm.values())),
        "no_comm_step_s_seeds": {str(k): v for k, v in no_comm.items()},
        "methods": methods,
        "mode": settings["mode"], "strategy": settings.get("strategy", "ddp"),
        "controller": raw.get("controller"),
    }
    results["goals"] = judge(results)
    return results
