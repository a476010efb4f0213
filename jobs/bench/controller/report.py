"""The controller load benchmark's markdown report: method, the figures, latency and memory
over time, the scrapes, the runs, and a plain-language reading of it all."""

from __future__ import annotations

import json
import os
from typing import Any

from jobs.bench.controller.stats import BOUNDED_GROWTH
from jobs.bench.report import machine_markdown, markdown_table

__all__ = ["interpretation", "render_markdown"]


def interpretation(res: dict[str, Any]) -> list[str]:
    """Plain-language reading of the figures (rules stated in the text)."""
    cfg, lat, rss = res["config"], res["latency"], res["rss"]
    cores = os.cpu_count() or 1
    target = res["target_rate"]
    per_report = res["controller_cpu_ms_per_report"]
    needed = target * per_report / 1e3  # cores the controller needs at the target rate
    windows = res["latency_by_window"]
    behind = res["answered_rate_during_load"] < 0.95 * res["sent_rate"] or (
        len(windows) > 1 and windows[-1]["p50_ms"] > 4 * max(windows[0]["p50_ms"], 5.0))
    lines = [
        f"- Offered load: {res['due_rate']:.0f} of {target:.0f} reports/s due on schedule "
        f"({res['due_fraction'] * 100:.1f}%, generator send lag p99 {res['send_lag_p99_ms']:.0f} ms): "
        + ("the generators kept their schedule." if res["due_fraction"] >= 0.95 else
           "the generators fell behind their schedule.")
        + f" Sent {res['sent_rate']:.0f}/s; "
        + (f"dropped by the workers' backpressure rule (a rank with {cfg['max_in_flight']} reports "
           f"unanswered drops the next): {res['dropped']:,} ({res['dropped_fraction'] * 100:.2f}%). "
           if cfg.get("max_in_flight") else "open loop: nothing dropped by design. ")
        + f"Answered during the load: {res['answered_rate_during_load']:.0f} reports/s; "
        + f"achieved (all answered reports per second of load): {res['achieved_rate']:.0f}/s "
        + f"({res['achieved_fraction'] * 100:.1f}% of the target).",
        f"- Controller cost: {per_report:.2f} ms of controller-process CPU per report (all its threads: "
        f"Ray core worker, ingest, snapshots, exporter; from before the load to the last answer), i.e. "
        f"{needed:.2f} cores at {target:.0f} reports/s; during the load it got "
        f"{res['controller_cpu_cores']:.2f} cores. Generators used {res['generator_cpu_cores']:.2f} cores. "
        f"Machine: {res['machine_cpu_pct_during_load']:.0f}% CPU busy on average, 1-min load average "
        f"{res['load_avg_1m']['before']:.1f} before / {res['load_avg_1m']['after']:.1f} after on {cores} "
        "cores (other users' jobs included).",
    ]
    if res["dropped_fraction"] > 0.01:
        cap = cfg["max_in_flight"] * cfg["workers"]
        lines.append(
            f"- **Overloaded**: the controller answered {res['answered_rate_during_load']:.0f} reports/s of "
            f"{target:.0f} due, so the ranks' backpressure dropped {res['dropped_fraction'] * 100:.1f}% of "
            f"their reports (counted, as a worker counts them). Unanswered calls peaked at "
            f"{res['in_flight_max']:,}, within the cap of {cfg['max_in_flight']} per rank x "
            f"{cfg['workers']} ranks = {cap:,}: the queue, and with it latency and memory, stays bounded "
            "however far the offered load exceeds what the controller can take."
        )
    elif behind:
        lines.append(
            f"- **The controller fell behind**: unanswered ingest calls peaked at {res['in_flight_max']:,} "
            f"(t = {res['in_flight_max_t_s']:.0f} s) and latency grew window by window "
            f"(p50 {windows[0]['p50_ms']:.0f} ms in the first window, {windows[-1]['p50_ms']:.0f} ms in the "
            "last). The queue is at the controller actor, not at the generators (they submitted on "
            f"schedule): it needed {needed:.2f} cores for this rate and got "
            f"{res['controller_cpu_cores']:.2f} on a {cores}-core machine shared with the generators, "
            "Ray and other users' jobs."
        )
    else:
        lines.append(f"- The controller kept up: unanswered ingest calls peaked at {res['in_flight_max']:,}.")
    off = res.get("offline") or {}
    if off:
        lines.append(
            f"- Where the CPU goes (controller logic alone, no Ray, on the final state): "
            f"{off['ingest_s'] * 1e3:.2f} ms per report (validation, merge, policy) and "
            f"{off['snapshot_s'] * 1e3:.0f} ms to save every run ({res['snapshot_bytes'] / 2**20:.2f} MiB of "
            f"JSON; {off.get('snapshot_run_s', off['snapshot_s'] / cfg['runs']) * 1e3:.0f} ms per run). The "
            "actor saves a changed run at most every 2 s (0.5 s after a plan change), one run at a "
            "time under the state lock, for at most 25 ms every 0.25 s; the remaining "
            f"~{max(0.0, per_report - off['ingest_s'] * 1e3):.2f} ms per report is Ray's task handling "
            "(deserialising the report, scheduling, replying) and the snapshots."
        )
        noop = off.get("ray_noop")
        if noop:
            lines.append(
                f"- Ray alone: the same generators driving a no-op actor (threaded, same concurrency "
                f"groups as the controller) for {noop['duration_s']:g} s "
                f"({noop['calls']:,} calls) cost it {noop['cpu_ms_per_call']:.2f} ms CPU per call "
                f"({noop['cpu_cores']:.2f} cores; latency p50 {noop['p50_ms']:.1f} ms, p99 "
                f"{noop['p99_ms']:.1f} ms), i.e. {noop['cpu_ms_per_call'] / per_report * 100:.0f}% of the "
                "controller's cost per report is Ray's per-call handling of a report this size."
            )
    lines.append(
        f"- Latency (submit to resolved ObjectRef, every call): p50 {lat['p50_ms']:.1f} ms, "
        f"p99 {lat['p99_ms']:.1f} ms, max {lat['max_ms']:.0f} ms."
    )
    history_fill_s = 256 / cfg["rate"]
    filled = cfg["duration_s"] / 2 >= history_fill_s
    memory = (
        f"- Memory: RSS {rss['start_mb']:.0f} MB before the load, {rss['mid_mb']:.0f} MB at mid-run, "
        f"{rss['end_mb']:.0f} MB at the end (max {rss['max_mb']:.0f}); second-half growth "
        f"{rss['second_half_growth'] * 100:+.1f}% ({rss['second_half_slope_mb_per_min']:+.1f} MB/min): "
        + ("**bounded**" if rss["bounded"] else "**not bounded by this definition**")
    )
    if filled:
        memory += (f". Run histories (256 steps) are full after {history_fill_s:.1f} s, before the "
                   "midpoint, so a correct controller's state no longer grows in the second half")
        if not rss["bounded"] and behind:
            memory += ("; the growth here rises with the backlog of queued ingest calls (each holds "
                       "its report; see the in-flight column), and RSS stays at its high-water mark after "
                       "the queue drains (freed memory is not necessarily returned to the OS), so this "
                       "run alone cannot tell queue memory from a leak: re-run at a rate the controller "
                       "sustains (short queue) to test the state's bound")
    else:
        memory += (f". Run histories (256 steps) fill after {history_fill_s:.1f} s, after the midpoint of "
                   "this short run, so some growth is expected and the verdict is not a leak test")
    lines.append(memory + ".")
    scrapes = [s for s in res["scrapes"] if s.get("ok")]
    if scrapes:
        lines.append(
            f"- /metrics answered {len(scrapes)}/{len(res['scrapes'])} scrapes during and after the load "
            f"in {min(s['latency_ms'] for s in scrapes):.0f}-{max(s['latency_ms'] for s in scrapes):.0f} ms "
            f"({scrapes[-1]['series']} series, {scrapes[-1]['bytes'] / 1024:.0f} KiB); the exporter runs "
            "on its own thread, so it answers even while ingest calls queue."
        )
    return lines


def render_markdown(res: dict[str, Any], command: str, info: dict[str, Any]) -> str:
    """The markdown report of :func:`~jobs.bench.controller.summary.summarise`'s results."""
    cfg, lat, rss = res["config"], res["latency"], res["rss"]
    ms = "{:.1f}".format
    summary = markdown_table(["figure", "value"], [
        ["simulated ranks x rate x duration", f"{cfg['workers']} x {cfg['rate']:g}/s x {cfg['duration_s']:g} s"],
        ["runs x ranks each x layers", f"{cfg['runs']} x {'/'.join(map(str, sorted(set(cfg['world_sizes']))))} "
                                       f"x {cfg['layers']} (critical policy, window {cfg['window_steps']})"],
        ["reports sent / accepted / rejected / errors",
         f"{res['sent']:,} / {res['accepted']:,} / {res['rejected']:,} / {res['errors']:,}"],
        ["reports dropped by worker backpressure",
         f"{res['dropped']:,} ({res['dropped_fraction'] * 100:.2f}%)" if cfg.get("max_in_flight")
         else "- (open loop)"],
        ["target / due on schedule / achieved (answered) rate (reports/s)",
         f"{res['target_rate']:.0f} / {res['due_rate']:.1f} / {res['achieved_rate']:.1f} "
         f"({res['achieved_fraction'] * 100:.1f}%)"],
        ["ingest latency p50 / p90 / p99 (ms)", f"{ms(lat['p50_ms'])} / {ms(lat['p90_ms'])} / {ms(lat['p99_ms'])}"],
        ["ingest latency p99.9 / max (ms)", f"{ms(lat['p99_9_ms'])} / {ms(lat['max_ms'])}"],
        ["controller RSS start / mid / end / max (MB)",
         f"{rss['start_mb']:.1f} / {rss['mid_mb']:.1f} / {rss['end_mb']:.1f} / {rss['max_mb']:.1f}"],
        ["RSS growth over the second half", f"{rss['second_half_growth'] * 100:+.1f}% -> "
                                            + ("bounded" if rss["bounded"] else "NOT bounded")],
        ["controller CPU (cores, during load)", f"{res['controller_cpu_cores']:.2f}"],
        ["controller CPU per report (ms, all threads)", f"{res['controller_cpu_ms_per_report']:.2f}"],
        ["answered rate during the load (reports/s)", f"{res['answered_rate_during_load']:.1f}"],
        ["max ingest calls in flight (at t)", f"{res['in_flight_max']:,} ({res['in_flight_max_t_s']:.0f} s)"],
        ["machine CPU busy during load (all users)", f"{res['machine_cpu_pct_during_load']:.0f}%"],
        ["generators CPU (cores, all)", f"{res['generator_cpu_cores']:.2f}"],
        ["generator send lag p99 / max (ms)", f"{ms(res['send_lag_p99_ms'])} / {ms(res['send_lag_max_ms'])}"],
        ["controller health() at the end", f"`{json.dumps(res['health'], sort_keys=True)}`"],
        ["snapshot files at the end (all runs)", f"{res['snapshot_bytes'] / 2**20:.2f} MiB"],
    ], align="ll")
    windows = markdown_table(
        ["window (s)", "reports", "p50 ms", "p90 ms", "p99 ms", "max ms"],
        [[f"{w['from_s']:.0f}-{w['to_s']:.0f}", w["samples"], ms(w["p50_ms"]), ms(w["p90_ms"]),
          ms(w["p99_ms"]), ms(w["max_ms"])] for w in res["latency_by_window"]], align="lrrrrr")
    step = max(1, len(res["timeline"]) // 12)
    shown = res["timeline"][::step] + ([res["timeline"][-1]] if (len(res["timeline"]) - 1) % step else [])
    memory = markdown_table(
        ["t (s)", "RSS MB", "controller CPU s", "ingest calls in flight", "machine CPU %", "load 1m"],
        [[f"{s['t_s']:.1f}", f"{s['rss_mb']:.1f}", f"{s['cpu_s']:.2f}", f"{s['in_flight']:,}",
          f"{s['machine_cpu_pct']:.0f}", f"{s['load_1m']:.1f}"] for s in shown], align="rrrrrr")
    scrapes = markdown_table(["t (s)", "ok", "latency ms", "series", "KiB", "reports_total (sum)"],
                             [[f"{s['t_s']:.1f}", s["ok"], ms(s["latency_ms"]), s.get("series", "-"),
                               f"{s.get('bytes', 0) / 1024:.0f}", f"{s.get('reports_total', 0):,.0f}"]
                              for s in res["scrapes"]], align="lrrrrr")
    runs = markdown_table(["run", "reports", "last step", "detections", "plan version", "plan switches"],
                          [[rid, r["reports"], r["last_step"], r["detections"], r["plan_version"],
                            r["plan_switches"]] for rid, r in res["runs"].items()], align="lrrrrr")
    parts = [
        "# Controller load benchmark", "",
        "Generated by `jobs/bench/controller/`; everything measured is in `controller.json`.", "",
        "## Command", "", f"```\n{command}\n```", "",
        "## Machine", "", machine_markdown(info), "",
        "## Method", "",
        "- One embedded Ray cluster (`num_cpus=2`); a fresh controller actor from "
        "`raycomp.controllers.service.get_or_create` with snapshots and the Prometheus exporter on "
        "(port 0, file-SD list in a temporary directory), as in production.",
        f"- {cfg['runs']} runs registered with the `critical` policy (warm-up {cfg['warmup_steps']} steps, "
        f"window {cfg['window_steps']} steps, {cfg['layers']} layers of {cfg['layer_numel']:,} elements); "
        "half of the layers have a gradient norm that doubles and halves (critical), the other half "
        "holds steady, and the halves swap every 100 steps, so plans change during the load.",
        f"- {cfg['generators']} load-generator actors (`num_cpus=0`) each drive their ranks from one "
        "thread: report k of a rank is due at start + k / rate and submitted fire-and-forget "
        + (f"unless that rank has {cfg['max_in_flight']} reports unanswered, in which case it is dropped "
           "and counted, exactly as a worker's session does (`raycomp._internal.train.reporter.MAX_REPORTS_IN_FLIGHT`). "
           if cfg.get("max_in_flight") else "whether or not earlier ones were answered (open loop). ")
        + "Reports are valid "
        "`GradStats` dicts (per-layer norms, errors, byte counts, Top-K error profile), step "
        "increasing by one per report.",
        "- Latency: for every `ingest.remote()` call, submit to ObjectRef resolution, timestamped in "
        "Ray's completion callback.",
        f"- Memory and CPU: the controller process's RSS and CPU time via `psutil` every "
        f"{cfg['sample_every_s']:g} s. Bounded = the largest RSS of the second half of the load is "
        f"< {BOUNDED_GROWTH * 100:.0f}% above the RSS at its midpoint.",
        "- `/metrics` scraped a few times during the load and once after.",
        "- Offline: on a copy of the final snapshot, the controller logic alone (plain `Controller`, "
        "no Ray) is timed (CPU time) for one full snapshot and per ingested report."
        + (" Then the same generators drive a no-op actor (same actor options, same reports) "
           "for a few seconds: Ray's own CPU cost per call." if (res.get("offline") or {}).get("ray_noop")
           else ""), "",
        "## Results", "", summary, "",
        "### Latency over time", "", windows, "",
        "### Controller memory over time", "", memory, "",
        "### /metrics scrapes", "", scrapes, "",
        "### Runs at the end", "", runs, "",
        "## Interpretation", "", *interpretation(res), "",
    ]
    return "\n".join(parts)
