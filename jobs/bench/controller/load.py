"""The controller load itself: a fresh controller actor, the runs registered, the generators
driving the simulated ranks while the driver samples the controller's memory and CPU and
scrapes its ``/metrics``; then the controller's logic timed alone (no Ray) and, optionally,
Ray's own cost per call against a no-op actor."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from jobs.bench.controller.ranks import (
    LAYER_NUMEL,
    MAX_REPORTS_IN_FLIGHT,
    WINDOW_STEPS,
    LoadGenerator,
    layer_names,
    make_report,
)
from jobs.bench.controller.stats import latency_summary
from jobs.bench.controller.summary import summarise
from jobs.bench.report import eprint
from raycomp.controllers.snapshots import SnapshotStore

__all__ = ["MIN_COMPRESS_NUMEL", "WARMUP_STEPS", "NoopService", "noop_baseline", "offline_costs", "run_load",
           "world_sizes"]

WARMUP_STEPS = 20
MIN_COMPRESS_NUMEL = 1024


def _proc(pid: int) -> Any:
    import psutil

    return psutil.Process(pid)


def _sample(proc: Any, t: float) -> dict[str, float]:
    import psutil

    cpu = proc.cpu_times()
    return {"t_s": t, "rss_mb": proc.memory_info().rss / 2**20, "cpu_s": cpu.user + cpu.system,
            "machine_cpu_pct": psutil.cpu_percent(interval=None), "load_1m": os.getloadavg()[0]}


def _scrape(url: str, t: float) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = answer.read().decode()
            status = answer.status
    except OSError as error:
        return {"t_s": t, "ok": False, "error": str(error), "latency_ms": (time.perf_counter() - start) * 1e3}
    latency = (time.perf_counter() - start) * 1e3
    reports = sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                  if line.startswith("raycomp_controller_reports_total{"))
    return {"t_s": t, "ok": status == 200, "latency_ms": latency, "bytes": len(body),
            "series": sum(1 for line in body.splitlines() if line and not line.startswith("#")),
            "reports_total": reports}


def world_sizes(workers: int, runs: int) -> list[int]:
    """``workers`` ranks split over ``runs`` runs as evenly as possible."""
    return [workers // runs + (1 if i < workers % runs else 0) for i in range(runs)]


def run_load(workers: int = 16, rate: float = 10.0, duration: float = 5.0, runs: int = 4,
             n_layers: int = 20, generators: int = 4, sample_every_s: float | None = None,
             scrapes: int = 5, baseline_s: float = 0.0, max_in_flight: int | None = MAX_REPORTS_IN_FLIGHT,
             log: Any = eprint) -> dict[str, Any]:
    """Run the load against a fresh controller actor on the current Ray cluster; results.

    With ``baseline_s`` > 0 the same generators then drive a no-op actor (same calls, same
    reports) for that long: Ray's own cost per call, to compare with the controller's.

    Ray must be initialised. The controller and generator actors are killed and the
    temporary snapshot / service-discovery directory removed before returning.
    """
    import ray

    from raycomp.controllers.policies import CriticalOptions
    from raycomp.controllers.service import get_or_create

    if runs > workers:
        raise ValueError(f"--runs ({runs}) cannot exceed --workers ({workers})")
    generators = min(generators, workers)
    sample_every_s = sample_every_s or max(0.25, min(1.0, duration / 20))
    tmp = Path(tempfile.mkdtemp(prefix="raycomp-bench-controller-"))
    name = f"raycomp-controller-bench-{uuid.uuid4().hex[:8]}"
    metrics = {"host": "127.0.0.1", "port": 0, "sd_file": str(tmp / "targets.json")}
    controller = get_or_create(name, "raycomp-bench", str(tmp / "snapshots"), max_restarts=0,
                               metrics=metrics)
    gens: list[Any] = []
    try:
        pid, url = ray.get([controller.pid.remote(), controller.metrics_url.remote()], timeout=120)
        proc = _proc(pid)
        names = layer_names(n_layers)
        options = CriticalOptions(window_steps=WINDOW_STEPS).model_dump(mode="json")
        sizes = world_sizes(workers, runs)
        run_ids = [f"load-{i:03d}" for i in range(runs)]
        ray.get([controller.register_run.remote(rid, size, dict.fromkeys(names, LAYER_NUMEL), "critical",
                                                options, WARMUP_STEPS, 1, MIN_COMPRESS_NUMEL)
                 for rid, size in zip(run_ids, sizes, strict=True)], timeout=60)
        # rank g: run g // size, spread round-robin over generators, staggered over 1 / rate
        ranks = [(rid, r) for rid, size in zip(run_ids, sizes, strict=True) for r in range(size)]
        shares: list[list[tuple[str, int, float]]] = [[] for _ in range(generators)]
        for g, (rid, r) in enumerate(ranks):
            shares[g % generators].append((rid, r, (g / workers) / rate))
        remote = ray.remote(num_cpus=0, max_restarts=0)(LoadGenerator)
        gens = [remote.remote() for _ in range(generators)]
        gen_pids = ray.get([g.attach.remote(controller) for g in gens], timeout=120)
        ray.get(controller.health.remote(), timeout=30)

        load_avg_before = os.getloadavg()
        start_at = time.time() + 1.0
        refs = [g.drive.remote(share, n_layers, rate, duration, start_at, max_in_flight)
                for g, share in zip(gens, shares, strict=True)]
        log(f"controller: {workers} ranks x {rate:g}/s for {duration:g} s, {runs} runs x {n_layers} layers, "
            f"{generators} generators; controller pid {pid}, metrics {url}")
        timeline = [_sample(proc, time.time() - start_at)]
        scrape_at = [duration * (i + 0.5) / scrapes for i in range(scrapes)]
        scraped: list[dict[str, Any]] = []
        pending = list(refs)
        next_sample = time.time()
        while pending:
            now = time.time()
            if now >= next_sample:
                timeline.append(_sample(proc, now - start_at))
                next_sample = now + sample_every_s
            if scrape_at and now - start_at >= scrape_at[0]:
                scrape_at.pop(0)
                scraped.append(_scrape(url, now - start_at))
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(
                next_sample, start_at + (scrape_at[0] if scrape_at else math.inf)) - time.time()))
        results = ray.get(refs)
        timeline.append(_sample(proc, time.time() - start_at))
        load_avg_after = os.getloadavg()
        health = ray.get(controller.health.remote(), timeout=30)
        summaries = {rid: ray.get(controller.summary.remote(rid), timeout=30) for rid in run_ids}
        scraped.append(_scrape(url, time.time() - start_at))
        snapshots = tmp / "snapshots"
        offline = offline_costs(snapshots, run_ids, sizes, names) if snapshots.is_dir() else {}
        if baseline_s > 0:
            ray.kill(controller, no_restart=True)  # out of the way of the baseline
            offline["ray_noop"] = noop_baseline(gens, shares, n_layers, rate, baseline_s)
        return summarise(
            config={"workers": workers, "rate": rate, "duration_s": duration, "runs": runs,
                    "layers": n_layers, "generators": generators, "world_sizes": sizes,
                    "policy": "critical", "window_steps": WINDOW_STEPS, "warmup_steps": WARMUP_STEPS,
                    "layer_numel": LAYER_NUMEL, "sample_every_s": sample_every_s,
                    "max_in_flight": max_in_flight},
            results=results, timeline=timeline, scraped=scraped, health=health, summaries=summaries,
            pids={"controller": pid, "generators": gen_pids},
            load_avg=(load_avg_before, load_avg_after),
            snapshot_bytes=SnapshotStore(snapshots).size_bytes(), offline=offline,
        )
    finally:
        for actor in [*gens, controller]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
        shutil.rmtree(tmp, ignore_errors=True)


class NoopService:
    """Accepts ``ingest`` like the controller and does nothing: Ray's cost alone."""

    @ray.method(concurrency_group="ingest")
    def ingest(self, report: Any) -> bool:
        return isinstance(report, dict)

    def pid(self) -> int:
        return os.getpid()


def noop_baseline(gens: Sequence[Any], shares: Sequence[Any], n_layers: int, rate: float,
                  duration: float) -> dict[str, float]:
    """Drive a no-op actor (actor options as the controller's) with the same load."""
    import ray

    from raycomp.controllers.service import CONCURRENCY_GROUPS, OTHER_CALL_THREADS

    noop = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(NoopService).options(
        num_cpus=0, max_concurrency=OTHER_CALL_THREADS, max_restarts=0).remote()
    try:
        proc = _proc(ray.get(noop.pid.remote(), timeout=120))
        ray.get([g.attach.remote(noop) for g in gens], timeout=120)
        cpu0 = sum(proc.cpu_times()[:2])
        start_at = time.time() + 0.5
        results = ray.get([g.drive.remote(share, n_layers, rate, duration, start_at, None)
                           for g, share in zip(gens, shares, strict=True)])
        cpu = sum(proc.cpu_times()[:2]) - cpu0
    finally:
        ray.kill(noop, no_restart=True)
    calls = sum(r["sent"] for r in results)
    lat = latency_summary([lat for r in results for _, lat in r["samples"]])
    return {"duration_s": duration, "calls": calls, "cpu_ms_per_call": cpu / max(1, calls) * 1e3,
            "cpu_cores": cpu / duration, "p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"],
            "max_ms": lat["max_ms"]}


def offline_costs(snapshots: Path, run_ids: Sequence[str], sizes: Sequence[int],
                  names: Sequence[str]) -> dict[str, float]:
    """The controller's logic without Ray, on a copy of the final state (CPU seconds)."""
    import logging

    from raycomp.controllers.service import Controller

    quiet = logging.getLogger("raycomp.controller")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "restored N runs" is expected here
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(snapshots, tmp, dirs_exist_ok=True)
        try:
            controller = Controller(snapshot_dir=tmp)
        finally:
            quiet.setLevel(level)
        times = []
        for _ in range(3):
            start = time.process_time()
            controller.snapshot()
            times.append(time.process_time() - start)
        snapshot_s = statistics.median(times)
        controller.store = None  # time ingest alone from here on
        steps = {rid: controller.runs[rid].step + 1 for rid in run_ids}
        reports = [make_report(rid, r, steps[rid] + k, names)
                   for k in range(5) for rid, size in zip(run_ids, sizes, strict=True) for r in range(size)]
        start = time.process_time()
        for report in reports:
            controller.ingest(report)
        ingest_s = (time.process_time() - start) / len(reports)
    return {"snapshot_s": snapshot_s, "snapshot_run_s": snapshot_s / max(1, len(controller.runs)),
            "ingest_s": ingest_s, "ingest_reports": len(reports)}
