"""The end-to-end benchmark's analysis: raw traces of every run -> the results (per-method
rows of medians over seeds, a grid's best setting under the grid's name, the target, the
references, the compute-bound time to target, the goals' verdicts).

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
    GRIDS,
    NO_COMM,
    REFERENCES,
    TORCH_HOOKS,
    family,
    grid_setting,
    methods_of,
    warmup_of,
)
from jobs.bench.e2e.predictions import plan_predictions
from jobs.bench.e2e.stats import median, median_with_misses, ratio, spread
from jobs.bench.e2e.topology import FLAT, parse_topology
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

__all__ = ["TARGET_AT", "aggregate", "analyze", "analyze_run", "auto_target", "best_of_grids",
           "compute_bound", "resolve_target", "target_step"]

TARGET_AT = 0.75  # --target auto: dense's median metric at the evaluation at this share of the budget


def analyze_run(run: dict[str, Any], raw: dict[str, Any], settings: dict[str, Any],
                idle_rate: float) -> dict[str, Any]:
    """One run's numbers (target-independent)."""
    name, summary, steps = run["method"], run["summary"], run["steps"]
    world = 1 if name == COMPUTE else settings.get("workers", 2)
    metric = raw["metric"]
    series = eval_series(run["evals"], metric)
    eval_steps = [e["step"] for e in series]
    clock = training_clock(steps, eval_steps)
    done = len(steps)
    sharded = settings.get("strategy") == "fsdp"
    numel = sum(math.prod(shape) for shape in raw["layers"].values())
    if sharded and name == "torch_hsdp":  # each rank's 1/L shard all-reduced across the K nodes
        shape = parse_topology(settings.get("topology", FLAT))
        nodes, per_node = shape.nodes, shape.per_node
        wire = world * done * 2 * (nodes - 1) / nodes * FSDP_BASELINES[name] * numel / per_node
        first = 0
    elif sharded and name in FSDP_BASELINES:  # FSDP's own reduce-scatter: the ideal one's bytes
        wire = world * done * (world - 1) / world * FSDP_BASELINES[name] * numel
        first = 0 if name != "dense" else None
    elif name in TORCH_HOOKS and not sharded:
        start = warmup_of(name, settings)
        rank = int(name[-1]) if name.startswith("torch_powersgd") else 2
        per_step = torch_hook_bytes(TORCH_HOOKS[name], raw["layers"], world, done, rank, start,
                                    period=grid_setting(name) or 1)
        wire = world * sum(per_step)
        first = start if name != "dense" else None
    else:
        wire = float(summary.get("wire_bytes_total") or 0.0) or \
            (world * float(steps[-1]["wire_bytes"]) if steps else 0.0)
        first = first_compressed_step(steps)
    dense = world * sum(torch_hook_bytes("allreduce", raw["layers"], world, done)) if world > 1 else 0.0
    if sharded:  # an fp32 reduce-scatter sends half of an all-reduce's bytes
        dense = world * done * (world - 1) / world * 4 * numel if world > 1 else 0.0
    nic, nic_at = None, {}
    times = sorted(float(r["time"]) for r in steps if r.get("time") is not None)
    if len(times) > 1 and run["nic"]:
        nic = _nic_between(run["nic"], times[0], times[-1], idle_rate)
        at = {int(r["step"]) + 1: float(r["time"]) for r in steps if r.get("time") is not None}
        nic_at = {s: _nic_between(run["nic"], times[0], at[s], idle_rate) for s in eval_steps if s in at}
    raycomp_plan = name not in TORCH_HOOKS and not (sharded and name in FSDP_BASELINES)
    own = first if raycomp_plan and first is not None else warmup_of(name, settings)
    steady_from = own + raw["interval_steps"] if name not in ("dense", *REFERENCES) else 2
    step_s, step_n = steady_step_s(steps, eval_steps, steady_from)
    steady_nic = None  # NIC bytes per step once the method's own plan held (warm-up left out)
    at_step = {int(r["step"]): float(r["time"]) for r in steps if r.get("time") is not None}
    last = max(at_step, default=-1)
    if run["nic"] and steady_from in at_step and last > steady_from:
        steady_nic = _nic_between(run["nic"], at_step[steady_from], at_step[last], idle_rate) / (last - steady_from)
    control = summary.get("control_overhead")
    return {
        "method": name, "seed": run["seed"], "status": summary.get("status"), "error": summary.get("error"),
        "steps": done, "curve": [{**e, "train_s": clock.get(e["step"])} for e in series],
        "final_metric": series[-1]["value"] if series else None,
        "wire_bytes": wire, "dense_bytes": dense, "nic_bytes": nic, "nic_bytes_at_eval": nic_at,
        "nic_bytes_per_step": nic / (done - 1) if nic is not None and done > 1 else None,
        "nic_bytes_per_steady_step": steady_nic, "step_s": step_s, "step_s_steps": step_n, "steady_from_step": steady_from,
        "first_compressed_step": first, "control_share": control,
        "controller_cpu_s": run.get("controller_cpu_s"), "fit_s": run["t_end"] - run["t_start"],
        "placement": run.get("placement"), "load_average": run.get("load_average"),
        "plan_predictions": plan_predictions(run.get("plans") or [], steps, eval_steps, raw["interval_steps"])
        if raycomp_plan else [],
    }


def target_step(settings: dict[str, Any]) -> int:
    """The step whose dense validation metric is the target (``--target-step``, default
    ``TARGET_AT`` of the budget)."""
    return settings.get("target_step") or math.ceil(TARGET_AT * settings["steps"])


def _value_at(series: list[dict[str, Any]], step: int) -> float | None:
    return next((p["value"] for p in series if p["step"] >= step), None)


def auto_target(raw_runs: list[dict[str, Any]], metric: str, settings: dict[str, Any]) -> float | None:
    """``--target auto`` from raw runs: the median over dense's seeds of its metric at the
    first evaluation at or after :func:`target_step` (what the driver stops the other runs at)."""
    at = target_step(settings)
    return median([_value_at(eval_series(r["evals"], metric), at) for r in raw_runs if r["method"] == "dense"])


def resolve_target(runs: list[dict[str, Any]], settings: dict[str, Any], metric: str,
                   stopped_at: float | None = None) -> dict[str, Any]:
    """The fixed ``--target``, or 'auto': dense's median metric at the first evaluation at or
    after :func:`target_step` (the same value :func:`auto_target` gave the driver). Where the
    runs stopped at another value (``stopped_at``: phases merged, whose later dense seeds
    move the median), the value they stopped at: a run stopped there cannot show a target
    beyond it."""
    at = target_step(settings)
    if settings["target"] is not None:
        return {"value": settings["target"], "source": "fixed (--target)", "step": None}
    value = median([_value_at(r["curve"], at) for r in runs if r["method"] == "dense"])
    source = (f"auto: median over seeds of dense's validation {metric} at the first evaluation at or after "
              f"step {at} of the {settings['steps']}-step budget")
    if stopped_at is not None and value is not None and not math.isclose(value, stopped_at, rel_tol=1e-4):
        return {"value": stopped_at, "step": at, "source": f"{source}, over the first phase's seeds: the value "
                f"every run stopped at (over every seed: {value:.4g})"}
    return {"value": value, "step": at, "source": source}


def aggregate(per_seed: list[dict[str, Any]], target: float | None, lower_is_better: bool) -> dict[str, Any]:
    """One method's row: per-seed time to target and medians over seeds."""
    ttt, steps_to, to_stop = [], [], []
    for r in per_seed:
        i = None if target is None else target_index([p["value"] for p in r["curve"]], target, lower_is_better)
        hit = r["curve"][i] if i is not None else None
        ttt.append(hit["train_s"] if hit else None)
        steps_to.append(hit["step"] if hit else None)
        # a run stops at the evaluation that confirms the target; one that never confirmed
        # it (or a dense run that went on to fix an auto target) counts to its stop or end
        confirm = r["curve"][i + CONSECUTIVE - 1]["step"] if i is not None else None
        to_stop.append(r["nic_bytes_at_eval"].get(confirm, r["nic_bytes"]) if confirm else r["nic_bytes"])
    return {
        "name": per_seed[0]["method"],
        "time_to_target_s": median_with_misses(ttt),
        "time_to_target_s_seeds": ttt,
        "time_to_target_spread_s": spread(ttt),
        "steps_to_target_seeds": steps_to,
        "steps_to_target": median_with_misses(steps_to),
        "final_metric": median([r["final_metric"] for r in per_seed]),
        "final_metric_seeds": [r["final_metric"] for r in per_seed],
        "wire_bytes": median([r["wire_bytes"] for r in per_seed]),
        "dense_bytes": median([r["dense_bytes"] for r in per_seed]),
        "nic_bytes": median([r["nic_bytes"] for r in per_seed]),
        "nic_bytes_to_stop": median(to_stop),
        "nic_bytes_to_stop_seeds": to_stop,
        "nic_bytes_per_step": median([r["nic_bytes_per_step"] for r in per_seed]),
        "nic_bytes_per_steady_step": median([r.get("nic_bytes_per_steady_step") for r in per_seed]),
        "step_s": median([r["step_s"] for r in per_seed]),
        "control_share": median([r["control_share"] for r in per_seed]),
        "first_compressed_step_seeds": [r["first_compressed_step"] for r in per_seed],
        "status_seeds": [r["status"] for r in per_seed],
        "errors": [r["error"] for r in per_seed if r["error"]],
        "steps_seeds": [r["steps"] for r in per_seed],
        "runs": per_seed,
    }


def best_of_grids(methods: list[dict[str, Any]], lower_is_better: bool) -> list[dict[str, Any]]:
    """The rows with each grid's variants (:data:`~jobs.bench.e2e.methods.GRIDS`) replaced by
    one row under the grid's name: the variant with the shortest median time to target or,
    when none reached it, the best median final metric; every variant's headline numbers in
    its ``grid``, the winner's name in ``variant``. The row stands where its first variant stood.

    Variants are compared on the seeds all of them ran (a grid searched on seed 0 whose best
    setting then ran seeds 1 and 2 is judged on seed 0); the winner's row keeps all its seeds."""
    out: list[dict[str, Any]] = []
    for m in methods:
        name = family(m["name"])
        if name not in GRIDS:
            out.append(m)
            continue
        if any(o["name"] == name for o in out):
            continue
        variants = [v for v in methods if family(v["name"]) == name]
        common = set.intersection(*(set(_seeds_of(v)) for v in variants))
        best = min(variants, key=lambda v: _grid_rank(_on_seeds(v, common), lower_is_better))
        grid = [{"variant": v["name"], "setting": grid_setting(v["name"]), "time_to_target_s": v["time_to_target_s"],
                 "time_to_target_s_seeds": v["time_to_target_s_seeds"], "final_metric": v["final_metric"],
                 "nic_bytes_to_stop": v["nic_bytes_to_stop"], "step_s": v["step_s"], "seeds": _seeds_of(v)}
                for v in variants]
        out.append({**best, "name": name, "variant": best["name"], "grid": grid})
    return out


def _seeds_of(row: dict[str, Any]) -> list[int]:
    """The seeds a method's row holds, in the order of its per-seed lists."""
    return [r["seed"] for r in row["runs"]] if "runs" in row else list(row.get("seeds") or [0])


def _on_seeds(row: dict[str, Any], seeds: set[int]) -> dict[str, Any]:
    """A row's time to target and final metric as medians over ``seeds`` only."""
    keep = [i for i, s in enumerate(_seeds_of(row)) if s in seeds]
    if len(keep) == len(_seeds_of(row)):
        return row
    ttt = [row["time_to_target_s_seeds"][i] for i in keep]
    return {"time_to_target_s": median_with_misses(ttt),
            "final_metric": median([row["final_metric_seeds"][i] for i in keep])}


def _grid_rank(row: dict[str, Any], lower_is_better: bool) -> tuple[float, float]:
    """Sort key of a grid's variants: time to target (a miss last), then the final metric."""
    t, f = row["time_to_target_s"], row["final_metric"]
    return (math.inf if t is None else t, math.inf if f is None else (f if lower_is_better else -f))


def ran_seeds(runs: list[dict[str, Any]], seeds: list[int]) -> list[int]:
    """The seeds every method outside the grids ran (dense runs first on every seed, so a
    benchmark stopped early holds dense's later seeds without the other methods'; a grid
    may have run on fewer seeds, merged from a phase of its own)."""
    methods = {r["method"] for r in runs if family(r["method"]) == r["method"]}
    return [s for s in seeds if any(r["seed"] == s for r in runs)
            and all(any(r["seed"] == s and r["method"] == m for r in runs) for m in methods)]


def compute_bound(dense: dict[str, Any] | None, no_comm_step_s: float | None) -> float | None:
    """The physical limit of time to target: dense's (median) steps to target x the step
    without communication; None where either is missing."""
    steps = (dense or {}).get("steps_to_target")
    return steps * no_comm_step_s if steps is not None and no_comm_step_s else None


def analyze(raw: dict[str, Any], settings: dict[str, Any], shaping: dict[str, Any],
            check: dict[str, Any]) -> dict[str, Any]:
    """Every run of ``raw`` analysed, grouped by method (in the order of the methods table),
    each grid's best setting kept under its name, the target resolved, each step divided by
    its own seed's no-communication step, the compute-bound time to target, and the goals
    judged (:func:`~jobs.bench.e2e.judge.judge`)."""
    idles = raw["idle"]
    idle_rate = sum(i["tx_bytes"] + i["rx_bytes"] for i in idles) / max(1e-9, sum(i["seconds"] for i in idles)) \
        if idles else 0.0
    lower = raw["metric"] == "loss"
    runs = [analyze_run(r, raw, settings, idle_rate) for r in raw["runs"]]
    compute = [r for r in runs if r["method"] == COMPUTE]
    no_comm = {r["seed"]: r["step_s"] for r in runs if r["method"] == NO_COMM and r["step_s"]}
    runs = [r for r in runs if r["method"] not in REFERENCES]
    target = resolve_target(runs, settings, raw["metric"], raw.get("stop_target"))
    strategy = settings.get("strategy", "ddp")
    methods = [aggregate([r for r in runs if r["method"] == name], target["value"], lower)
               for name in methods_of(strategy) if any(r["method"] == name for r in runs)]
    for m in methods:  # each seed's step over its own group's no-communication step
        m["step_vs_no_comm"] = median([r["step_s"] / no_comm[r["seed"]] for r in m["runs"]
                                        if r["step_s"] and r["seed"] in no_comm])
        # torch's baselines: the warm-up the benchmark set (raycomp's: "compressed from")
        m["warmup_steps"] = warmup_of(m["name"], settings) if strategy == "ddp" and m["name"] in TORCH_HOOKS else None
    methods = best_of_grids(methods, lower)
    no_comm_step = median(list(no_comm.values()))
    bound = compute_bound(next((m for m in methods if m["name"] == "dense"), None), no_comm_step)
    for m in methods:
        m["vs_compute_bound"] = ratio(m["time_to_target_s"], bound)
    measured = [check[k]["bits_per_s"] / 1e6 for k in ("a_to_b", "b_to_a") if "bits_per_s" in check.get(k, {})]
    results = {
        "workload": {"name": settings["workload"], "parameters": sum(math.prod(s) for s in raw["layers"].values()),
                     "config": settings["config"], "steps": settings["steps"],
                     "eval_every_steps": settings["eval_every"], "localsgd_start": settings.get("localsgd_start"),
                     "world_size": settings.get("workers", 2), "adaptive_policy": raw.get("default_policy"),
                     "torch_powersgd_bucket_cap_mb": raw.get("bucket_cap_mb"),
                     "ddp_bucket_cap_mb": raw.get("ddp_bucket_cap_mb")},
        "topology": settings.get("topology", "2x1"),
        "link": {"rate": settings["link"], "measured_mbit_s": min(measured) if measured else None,
                 "shaping": shaping, "check": check, "idle_ray_bytes_per_s": idle_rate},
        "target": {"metric": raw["metric"], "value": target["value"], "lower_is_better": lower,
                   "step": target["step"], "source": target["source"], "consecutive": CONSECUTIVE,
                   "stopped_runs_at": raw.get("stop_target", settings["target"])},
        "seeds": ran_seeds(runs, settings["seeds"]),
        "seeds_requested": settings["seeds"],
        "compute_step_s": compute[0]["step_s"] if compute else None,
        "no_comm_step_s": no_comm_step,
        "no_comm_step_s_seeds": {str(k): v for k, v in no_comm.items()},
        "compute_bound_time_to_target_s": bound,
        "methods": methods,
        "mode": settings["mode"], "strategy": strategy,
        "controller": raw.get("controller"),
    }
    results["goals"] = judge(results)
    return results


def _nic_between(samples: list[list[float]], t0: float, t1: float, idle_rate: float) -> float:
    """NIC bytes (tx + rx) between ``t0`` and ``t1``, less idle Ray traffic over that time."""
    (tx0, rx0), (tx1, rx1) = interpolate_counters(samples, t0), interpolate_counters(samples, t1)
    return (tx1 - tx0) + (rx1 - rx0) - idle_rate * (t1 - t0)
