"""The controller load benchmark's results: the generators' counts, latencies and timelines
folded into one dict (rates against the target, latency per window, the controller's backlog
over time, memory, CPU per report)."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from typing import Any

from jobs.bench.controller.stats import latency_summary, memory_verdict

__all__ = ["summarise"]


def summarise(config: dict[str, Any], results: Sequence[dict[str, Any]], timeline: list[dict[str, float]],
              scraped: list[dict[str, Any]], health: dict[str, Any], summaries: dict[str, Any],
              pids: dict[str, Any], load_avg: tuple[Any, Any], snapshot_bytes: int,
              offline: dict[str, float]) -> dict[str, Any]:
    """The benchmark's results from the generators' results and the driver's samples."""
    duration, rate, workers = config["duration_s"], config["rate"], config["workers"]
    samples = [s for r in results for s in r["samples"]]
    sent = sum(r["sent"] for r in results)
    dropped = sum(r["dropped"] for r in results)
    # answered: the controller replied (accepted or rejected); dropped reports never reached it
    answered_total = sum(r["accepted"] + r["rejected"] for r in results)
    target = workers * rate
    during = [s for s in timeline if 0 <= s["t_s"] <= duration]
    first, last = (during[0], during[-1]) if during else (timeline[0], timeline[-1])
    controller_cpu = (last["cpu_s"] - first["cpu_s"]) / max(1e-9, last["t_s"] - first["t_s"])
    windows = max(1, min(6, int(duration // 5)))
    width = duration / windows
    by_window = []
    for w in range(windows):
        lat = [lat for t, lat in samples if w * width <= t < (w + 1) * width]
        by_window.append({"from_s": w * width, "to_s": (w + 1) * width, **latency_summary(lat)})
    rss = [s["rss_mb"] for s in timeline]
    # ingest calls submitted but not yet answered at each sample: the controller's backlog
    sends = sorted(t for t, _ in samples)
    answers = sorted(t + lat for t, lat in samples)
    for s in timeline:
        s["in_flight"] = bisect.bisect_right(sends, s["t_s"]) - bisect.bisect_right(answers, s["t_s"])
    events = sorted([(t, 1) for t in sends] + [(t, -1) for t in answers])
    in_flight, peak, peak_t = 0, 0, 0.0
    for t, delta in events:  # exact peak (answers sort before sends at equal times)
        in_flight += delta
        if in_flight > peak:
            peak, peak_t = in_flight, t
    answered = [t for t in answers if t <= duration]
    return {
        "config": config,
        "sent": sent,
        "dropped": dropped,
        "dropped_fraction": dropped / max(1, sent + dropped),
        "accepted": sum(r["accepted"] for r in results),
        "rejected": sum(r["rejected"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "unresolved": sum(r["unresolved"] for r in results),
        "target_rate": target,
        # due: reports the generators' schedule produced (sent + dropped): did they keep up?
        "due_rate": (sent + dropped) / duration,
        "due_fraction": (sent + dropped) / duration / target,
        # achieved: reports the controller answered (dropped ones are not), per second of load
        "achieved_rate": answered_total / duration,
        "achieved_fraction": answered_total / duration / target,
        "sent_rate": sent / duration,
        "latency": latency_summary([lat for _, lat in samples]),
        "latency_by_window": by_window,
        "rss": {"start_mb": rss[0], "mid_mb": min(timeline, key=lambda s: abs(s["t_s"] - duration / 2))["rss_mb"],
                "end_mb": rss[-1], "max_mb": max(rss), **memory_verdict(timeline, duration)},
        "controller_cpu_cores": controller_cpu,
        # all controller CPU from just before the load to after the last answer, per report
        "controller_cpu_ms_per_report": (timeline[-1]["cpu_s"] - timeline[0]["cpu_s"]) / max(1, sent) * 1e3,
        "answered_rate_during_load": len(answered) / duration,
        "in_flight_max": peak,
        "in_flight_max_t_s": peak_t,
        "machine_cpu_pct_during_load": statistics.fmean(s["machine_cpu_pct"] for s in during[1:]) if len(during) > 1 else 0.0,
        "generators": [{k: v for k, v in r.items() if k != "samples"} for r in results],
        "generator_cpu_cores": sum(r["cpu_s"] for r in results) / duration,
        "send_lag_p99_ms": max(r["lag_p99_s"] for r in results) * 1e3,
        "send_lag_max_ms": max(r["lag_max_s"] for r in results) * 1e3,
        "drain_s": max(r["drain_s"] for r in results),
        "late_start_s": max(r["late_start_s"] for r in results),
        "health": health,
        "runs": {rid: {k: s[k] for k in ("plan_version", "plan_switches", "reports", "last_step")}
                 | {"detections": s["policy_details"].get("detections")} for rid, s in summaries.items()},
        "scrapes": scraped,
        "snapshot_bytes": snapshot_bytes,
        "offline": offline,
        "load_avg_1m": {"before": load_avg[0][0], "after": load_avg[1][0]},
        "pids": pids,
        "timeline": timeline,
    }
