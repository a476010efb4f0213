"""Benchmark records written by hand for the analysis tests of ``jobs/bench/e2e/``
(tests/test_bench_e2e.py, tests/test_bench_topology.py): step records and whole runs of a
raw results file."""

from __future__ import annotations

__all__ = ["raw_run", "step_records"]


def step_records(n: int, pauses: dict[int, float] | None = None, step_s: float = 1.0, t0: float = 100.0):
    """Step records: step i ends at t0 + (i + 1) * step_s, plus the pauses before it."""
    out, extra = [], 0.0
    for i in range(n):
        extra += (pauses or {}).get(i, 0.0)
        out.append({"step": i, "time": t0 + (i + 1) * step_s + extra, "wire_bytes": 0, "dense_bytes": 0})
    return out


def raw_run(method, seed, values, step_s, wire_per_step, every=10):
    """One run of a raw benchmark results file: ``values`` evaluated every ``every`` steps of
    ``step_s`` seconds, ``wire_per_step`` bytes a step after a 20-step dense start."""
    n = every * len(values)
    steps = step_records(n, {s: 3.0 for s in range(every, n, every)}, step_s=step_s)
    for i, r in enumerate(steps):
        r["dense_bytes"] = 800.0 * (i + 1)
        r["wire_bytes"] = 800.0 * min(i + 1, 20) + wire_per_step * max(0, i + 1 - 20)
        r["loss"] = 1.0
    evals = [{"time": steps[every * (k + 1) - 1]["time"] + 2.0, "step": every * (k + 1), "epoch": k,
              "eval_loss": v} for k, v in enumerate(values)]
    evals.append(dict(evals[-1]))  # a loop that evaluates at eval_every_steps and at epoch ends
    nic = [[steps[0]["time"] - 1, 0, 0], [steps[-1]["time"] + 1, 1000 * n, 1000 * n]]
    return {"method": method, "seed": seed, "summary": {"status": "succeeded", "steps": n,
                                                         "control_overhead": 0.004},
            "t_start": steps[0]["time"] - 10, "t_end": steps[-1]["time"] + 5, "nic": nic,
            "evals": evals, "steps": steps, "controller_cpu_s": 0.1, "placement": {"rank0": "a", "rank1": "b"}}
