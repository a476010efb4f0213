"""The simulated ranks of the controller load benchmark: valid ``GradStats`` reports whose
gradient norms make the ``critical`` policy decide during the load, and the load-generator
actor that sends them on schedule, dropping like a worker's session under backpressure."""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from jobs.bench.controller.stats import percentile
from raycomp._internal.train.reporter import (
    MAX_REPORTS_IN_FLIGHT,  # the workers' backpressure, mirrored here
)

__all__ = [
    "LATENCY_SAMPLE_CAP", "LAYER_NUMEL", "MAX_REPORTS_IN_FLIGHT", "PHASE_STEPS", "TOPK_RATIOS", "WINDOW_STEPS",
    "LoadGenerator", "grad_norm", "layer_names", "make_report",
]

WINDOW_STEPS = 10  # critical-policy detection window (production default 50): more decisions
PHASE_STEPS = 100  # which half of the layers has a moving gradient norm flips this often
LAYER_NUMEL = 65_536
TOPK_RATIOS = ("0.001", "0.01", "0.1")
LATENCY_SAMPLE_CAP = 200_000  # latencies kept per generator (every call up to this many)


def layer_names(n: int) -> list[str]:
    """``n`` layer names, as a model's parameters would be named."""
    return [f"block{i:03d}.weight" for i in range(n)]


def grad_norm(layer_index: int, step: int, rank: int) -> float:
    """Half of the layers (alternating every PHASE_STEPS) have a norm that doubles and halves
    every WINDOW_STEPS steps (critical regime); the others hold steady (not critical)."""
    moving = (layer_index + step // PHASE_STEPS) % 2 == 0
    base = (2.0 if (step // WINDOW_STEPS) % 2 else 1.0) if moving else 1.0
    return base * (1.0 + 0.001 * rank)


def make_report(run_id: str, rank: int, step: int, names: Sequence[str]) -> dict[str, Any]:
    """A valid ``GradStats.to_dict()`` with per-layer statistics, as a worker sends it."""
    dense = 4.0 * LAYER_NUMEL
    layers = [
        {"layer": name, "compressor": "topk", "numel": LAYER_NUMEL,
         "grad_norm": grad_norm(i, step, rank), "compression_error": 0.5, "residual_norm": 0.1,
         "wire_bytes": dense / 50 * (step + 1), "dense_bytes": dense * (step + 1),
         "topk_errors": {r: 0.9 - 0.2 * j for j, r in enumerate(TOPK_RATIOS)}}
        for i, name in enumerate(names)
    ]
    return {
        "run_id": run_id, "rank": rank, "step": step, "epoch": step // 1000, "plan_version": 0,
        "loss": 2.0 * math.exp(-step / 2000) + 0.01 * rank, "step_seconds": 0.1,
        "compute_seconds": 0.08, "comm_seconds": 0.02, "samples_per_second": 640.0,
        "wire_bytes": dense / 50 * len(names) * (step + 1), "dense_bytes": dense * len(names) * (step + 1),
        "fallback_active": False, "layers": layers, "events": [], "eval_metric": None, "outages": 0,
    }


class LoadGenerator:
    """Drives a share of the simulated ranks from one thread (a Ray actor, num_cpus=0)."""

    def attach(self, controller: Any) -> int:
        """Keep the controller's handle (deserialising it imports the service: seconds)."""
        self.controller = controller
        return os.getpid()

    def drive(self, ranks: list[tuple[str, int, float]], n_layers: int,
              rate: float, duration: float, start_at: float,
              max_in_flight: int | None = MAX_REPORTS_IN_FLIGHT) -> dict[str, Any]:
        """Send reports for ``ranks`` ((run id, rank, offset s)) on schedule; latency per call.

        Like a worker's session, a rank with ``max_in_flight`` reports unanswered drops
        (and counts) the next one instead of queueing it; ``None``: never drop (open loop).
        """
        import heapq

        controller = self.controller
        names = layer_names(n_layers)
        lock = threading.Lock()
        samples: list[tuple[float, float]] = []  # (seconds since start, latency s)
        outcome = {"accepted": 0, "rejected": 0, "errors": 0, "dropped": 0}
        in_flight = [0] * len(ranks)
        lags: list[float] = []
        futures: list[concurrent.futures.Future] = []
        submit_s = 0.0
        delay = start_at - time.time()
        if delay > 0:
            time.sleep(delay)
        t0, cpu0, wall0 = time.perf_counter(), time.process_time(), time.time()

        def done(i: int, sent_at: float, future: concurrent.futures.Future) -> None:
            latency = time.perf_counter() - sent_at
            try:
                key = "accepted" if future.result() else "rejected"
            except Exception:  # noqa: BLE001 - counted, reported
                key = "errors"
            with lock:
                in_flight[i] -= 1
                outcome[key] += 1
                if len(samples) < LATENCY_SAMPLE_CAP:
                    samples.append((sent_at - t0, latency))

        queue = [(offset, i, 0) for i, (_, _, offset) in enumerate(ranks)]
        heapq.heapify(queue)
        while queue:
            due, i, step = heapq.heappop(queue)
            if due >= duration:
                continue
            now = time.perf_counter() - t0
            if due > now:
                time.sleep(due - now)
                now = time.perf_counter() - t0
            lags.append(now - due)
            heapq.heappush(queue, (due + 1.0 / rate, i, step + 1))
            with lock:
                if max_in_flight is not None and in_flight[i] >= max_in_flight:
                    outcome["dropped"] += 1
                    continue
                in_flight[i] += 1
            run_id, rank, _ = ranks[i]
            report = make_report(run_id, rank, step, names)
            sent_at = time.perf_counter()
            future = controller.ingest.remote(report).future()
            submit_s += time.perf_counter() - sent_at
            future.add_done_callback(lambda f, i=i, s=sent_at: done(i, s, f))
            futures.append(future)
        send_wall = time.perf_counter() - t0
        _, unresolved = concurrent.futures.wait(futures, timeout=60)
        with lock:  # callbacks may still be running for the last futures
            result = {
                "pid": os.getpid(), "started_at": wall0, "late_start_s": wall0 - start_at,
                "sent": len(futures), "unresolved": len(unresolved), **outcome,
                "samples": list(samples), "send_wall_s": send_wall,
                "drain_s": time.perf_counter() - t0 - send_wall,
                "cpu_s": time.process_time() - cpu0, "submit_s": submit_s,
                "lag_p99_s": percentile(sorted(lags), 99), "lag_max_s": max(lags, default=0.0),
            }
        return result
