"""The end-to-end benchmark's driver, run inside namespace ``a`` against the two-node cluster:
every seed x method through ``jobs.train``, the veth's byte counters sampled during each run,
the controller's CPU time and where Ray placed the workers; writes ``raw.json``.

    python -m jobs.bench.e2e.driver WORK_DIR/spec.json

(started by ``python -m jobs.bench e2e``; the spec holds the settings and the cluster's address).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobs.bench.cluster import REPO
from jobs.bench.e2e.analysis import auto_target, target_step
from jobs.bench.e2e.methods import (
    COMPUTE,
    NO_COMM,
    REFERENCES,
    method_overrides,
    methods_of,
    policy_default,
)

__all__ = ["NicSampler", "driver", "main", "read_jsonl", "run_phases"]


class NicSampler(threading.Thread):
    """Samples the veth's tx/rx byte counters every ``period`` seconds."""

    def __init__(self, dev: str, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.stats = Path(f"/sys/class/net/{dev}/statistics")
        self.period = period
        self.samples: list[tuple[float, int, int]] = []
        self._halt = threading.Event()

    def counters(self) -> tuple[int, int]:
        return (int((self.stats / "tx_bytes").read_text()), int((self.stats / "rx_bytes").read_text()))

    def sample(self) -> None:
        self.samples.append((time.time(), *self.counters()))

    def run(self) -> None:
        self.sample()
        while not self._halt.wait(self.period):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.sample()


def _cpu_seconds(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


_WORKER_RE = re.compile(r"\(ip=([0-9.]+), pid=(\d+)\) world_rank=(\d+)")


def _placement(ray_temp: str, since: float, addresses: dict[str, str]) -> dict[str, str]:
    """world rank -> namespace, from the newest Ray Train controller log written after ``since``."""
    logs = sorted(Path(ray_temp, "session_latest", "logs", "train").glob("ray-train-sys-controller-*.log"),
                  key=lambda p: p.stat().st_mtime)
    side_of = {ip: side for side, ip in addresses.items()}
    for log in reversed(logs):
        if log.stat().st_mtime < since:
            break
        found = _WORKER_RE.findall(log.read_text(errors="replace"))
        if found:
            return {f"rank{rank}": side_of.get(ip, ip) for ip, _, rank in found}
    return {}


def _node_of(pid: int | None, inodes: dict[str, int]) -> str | None:
    try:
        ino = os.stat(f"/proc/{pid}/ns/net").st_ino
    except (OSError, TypeError):
        return None
    return next((side for side, i in inodes.items() if i == ino), None)


def driver(spec_path: str) -> int:
    """Inside the head's namespace: every seed x method on the cluster; writes raw.json."""
    import logging

    import ray

    from jobs.baselines import one_bucket_cap_mb
    from jobs.config import load_config
    from jobs.workloads import build
    from raycomp._internal.ddp.buckets import ddp_kwargs

    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(Path(spec_path).read_text())
    work, settings = Path(spec["work"]), spec["settings"]
    inodes = {k: int(v) for k, v in spec["netns_inodes"].items()}
    ray.init(address=spec["address"], log_to_driver=False)
    deadline = time.time() + 180
    while sum(n["Alive"] for n in ray.nodes()) < spec.get("nodes", 2):
        if time.time() > deadline:
            raise RuntimeError(f"not every node joined: {ray.nodes()}")
        time.sleep(0.5)
    config_file = str(REPO / settings["config"])
    base = load_config(config_file, [*settings["extra"], f"compression.policy={policy_default()}"])
    workload = build(base.workload, 0, settings.get("workers", 2), 0)
    layers = {n: list(p.shape) for n, p in workload.model.named_parameters() if p.requires_grad}
    cap = one_bucket_cap_mb(workload.model)
    raw: dict[str, Any] = {"spec": spec, "layers": layers, "metric": workload.metric,
                           "interval_steps": base.controller.interval_steps, "bucket_cap_mb": cap,
                           "ddp_bucket_cap_mb": ddp_kwargs(base.compression, workload.model).get("bucket_cap_mb"),  # None: DDP's default
                           "default_policy": policy_default(), "runs": [], "idle": []}
    del workload
    controller_pid = None
    run_settings = dict(settings)
    for index, phase in enumerate(run_phases(settings)):
        if index == 1:  # dense has run on every seed: the target the other runs stop at
            run_settings["target"] = auto_target(raw["runs"], raw["metric"], settings)
            raw["stop_target"] = run_settings["target"]
            _log(f"target for the other methods: {run_settings['target']} (dense's median at step "
                 f"{target_step(settings)})")
        for name, seed in phase:
            controller_pid = _run_one(name, seed, run_settings, spec, raw, work, config_file, base, cap,
                                      inodes, controller_pid)
    raw["idle"].append(_idle(NicSampler(spec["dev"]), settings["idle_s"]))
    (work / "raw.json").write_text(json.dumps(raw))
    ray.shutdown()
    return 0


def run_phases(settings: dict[str, Any]) -> list[list[tuple[str, int]]]:
    """The runs in order, in phases. With ``--target auto``, dense first on every seed (the
    target is its median at a fixed step; dense runs its whole budget), then the other
    methods seed-major, each stopping at that target; with a fixed target, one phase,
    seed-major, dense included. Each seed's group starts with the no-communication run (DDP
    only: FSDP gathers parameters even without a gradient exchange); the compute-only run
    comes first. Seed-major: a drift in machine load hits every method alike."""
    seeds, methods = settings["seeds"], settings["methods"]
    references = [NO_COMM] if settings.get("strategy", "ddp") == "ddp" else []
    first = [(COMPUTE, seeds[0])]
    if settings["target"] is None and "dense" in methods:
        others = [m for m in methods if m != "dense"]
        return [first + [("dense", s) for s in seeds],
                [(m, s) for s in seeds for m in [*references, *others]]]
    return [first + [(m, s) for s in seeds for m in [*references, *methods]]]


def _run_one(name: str, seed: int, settings: dict[str, Any], spec: dict[str, Any], raw: dict[str, Any],
             work: Path, config_file: str, base: Any, cap: float, inodes: dict[str, int],
             controller_pid: int | None) -> int | None:
    """One run through ``jobs.train``, its traces appended to ``raw`` (and raw.json written);
    the controller's pid (learnt at the first run)."""
    import ray

    from jobs import train

    overrides = method_overrides(name, settings, seed, base.controller.interval_steps, cap)
    if name.startswith("raycomp_adaptive") or name == COMPUTE:
        overrides.append(f"compression.policy={policy_default()}")  # a config file may pin one
    run_id = f"e2e-{name.replace('_', '-')}-s{seed}-{os.urandom(3).hex()}"
    output = work / run_id
    config, run_id, output = train.prepare(["--config", config_file, "--run-id", run_id,
                                            "--output", str(output), *overrides])
    if name in REFERENCES:  # a few evaluation intervals suffice for a step time
        config = config.model_copy(update={"workload": config.workload.model_copy(
            update={"epochs": min(config.workload.epochs, max(2, 40 // settings["eval_every"]))})})
    output.mkdir(parents=True, exist_ok=True)
    sampler = NicSampler(spec["dev"])
    cpu_before = _cpu_seconds(controller_pid)
    _log(f"{name} seed {seed}: {' '.join(methods_of(settings.get('strategy', 'ddp')).get(name, REFERENCES.get(name, [])))}")
    load_before = os.getloadavg()[0]
    t_start = time.time()
    sampler.start()
    try:
        summary = train.run(config, run_id, output)
    except Exception as error:  # noqa: BLE001 - recorded, the other runs still go
        summary = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    t_end = time.time()
    sampler.stop()
    if controller_pid is None:
        try:
            handle = ray.get_actor(config.controller.name, namespace=config.controller.namespace)
            controller_pid = ray.get(handle.pid.remote(), timeout=30)
            raw["controller"] = {"pid": controller_pid, "node": _node_of(controller_pid, inodes)}
        except Exception as error:  # noqa: BLE001
            raw["controller"] = {"error": str(error)}
    cpu_after = _cpu_seconds(controller_pid)
    raw["runs"].append({
        "method": name, "seed": seed, "run_id": run_id, "output": str(output), "overrides": overrides,
        "summary": {k: v for k, v in summary.items() if k not in ("config", "final_plan")},
        "t_start": t_start, "t_end": t_end, "nic": sampler.samples,
        "evals": read_jsonl(output / "evals.jsonl"), "plans": read_jsonl(output / "plans.jsonl"),
        "steps": [{k: r.get(k) for k in ("time", "step", "wire_bytes", "dense_bytes", "loss")}
                  for r in read_jsonl(output / "steps" / "rank0.jsonl")],
        "controller_cpu_s": None if cpu_before is None or cpu_after is None else cpu_after - cpu_before,
        "load_average": [load_before, os.getloadavg()[0]],
        "placement": _placement(spec["ray_temp_a"], t_start, spec["addresses"]),
    })
    last = raw["runs"][-1]
    _log(f"{name} seed {seed}: {summary.get('status')} in {t_end - t_start:.1f} s, {summary.get('steps')} "
         f"steps, last eval {last['evals'][-1] if last['evals'] else None}, placement {last['placement']}"
         + (f", error {summary.get('error')}" if summary.get("error") else ""))
    if name == COMPUTE:
        raw["idle"].append(_idle(sampler, settings["idle_s"]))
    (work / "raw.json").write_text(json.dumps(raw))
    return controller_pid


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a line cut short by a crash is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return out


def _idle(sampler: NicSampler, seconds: float) -> dict[str, float]:
    """Bytes on the link while the cluster (and the controller actor) sit idle."""
    t1, tx1, rx1 = time.time(), *sampler.counters()
    time.sleep(seconds)
    t2, tx2, rx2 = time.time(), *sampler.counters()
    _log(f"idle Ray traffic: {(tx2 + rx2 - tx1 - rx1) / (t2 - t1):.0f} B/s over {t2 - t1:.1f} s")
    return {"seconds": t2 - t1, "tx_bytes": tx2 - tx1, "rx_bytes": rx2 - rx1}


def _log(message: str) -> None:
    print(f"[e2e driver] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jobs.bench.e2e.driver SPEC_JSON``; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m jobs.bench.e2e.driver SPEC_JSON", file=sys.stderr)
        return 2
    # not __main__: pickled callbacks resolve by module name
    from jobs.bench.e2e import driver as module

    return module.driver(argv[0])


if __name__ == "__main__":
    sys.exit(main())
