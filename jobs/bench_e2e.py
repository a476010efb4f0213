"""End-to-end benchmark: 2-node data-parallel training over a throttled link.

Two network namespaces joined by a veth pair shaped with ``tbf`` to ``--bandwidth`` each
way (:mod:`jobs.netns`) each hold one Ray node with one CPU: the head in ``a``, a worker
node in ``b``. The driver runs inside ``a``. Both training workers need one CPU, so Ray
Train places one on each node (``scaling.placement_strategy=SPREAD`` too) and every
gradient byte crosses the throttled link; gloo is bound to the veth of each node
(``GLOO_SOCKET_IFNAME``), because inside a namespace the host name resolves to loopback.

Every method trains the same workload for the same number of steps (same seed, same
data order, same per-worker batch):

====================  =============================================================
``dense``             DDP all-reduce (torch ``allreduce_hook``)
``torch_fp16``        torch ``fp16_compress_hook``
``torch_powersgd``    torch ``powerSGD_hook``, rank 2, ``start_powerSGD_iter`` = 10%
                      of the steps (torch's documented starting point)
``raycomp_topk``      raycomp static Top-K 1% + error feedback
``raycomp_int8``      raycomp static 8-bit (min-max per chunk)
``raycomp_powersgd``  raycomp static PowerSGD rank 2
``raycomp_adaptive``  raycomp default policy (``critical``), untuned
====================  =============================================================

and a single-worker run of the same loop (no DDP, no communication) gives the
compute-only step time. raycomp methods keep their default dense warm-up (20 steps).

Measured per method: time from the first step to the first epoch whose test accuracy
reaches the target, final accuracy, wire bytes (raycomp's ledger for raycomp methods; the
exact byte model of torch's hooks for the torch baselines, which raycomp does not see),
bytes read from the veth counters over the training phase (minus the idle Ray traffic
rate measured before), steady-state step time, and the controller's CPU time.

Output: ``<output-dir>/e2e-<bandwidth>.json``, ``.md`` and ``.png``; the raw traces of
every run stay in ``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HELP = "time to accuracy of 7 methods over a throttled 2-node link (network namespaces)"
NAME = "e2e"
REPO = Path(__file__).resolve().parents[1]

#: method name -> config overrides (on top of the workload's)
METHODS: dict[str, list[str]] = {
    "dense": ["compression.baseline_hook=torch_allreduce"],
    "torch_fp16": ["compression.baseline_hook=torch_fp16"],
    "torch_powersgd": ["compression.baseline_hook=torch_powersgd", "compression.baseline_powersgd_rank=2"],
    "raycomp_topk": ["compression.policy=static", "compression.static.compressor={name: topk, ratio: 0.01}"],
    "raycomp_int8": ["compression.policy=static", "compression.static.compressor={name: int8}"],
    "raycomp_powersgd": ["compression.policy=static",
                         "compression.static.compressor={name: powersgd, rank: 2}"],
    "raycomp_adaptive": [],
}
TORCH_HOOKS = {"dense": "allreduce", "torch_fp16": "fp16", "torch_powersgd": "powersgd"}
#: torch baselines: raycomp's own plan stays dense and unused
TORCH_BASELINE_OVERRIDES = ["compression.policy=static", "compression.static.compressor={name: none}"]
COMPUTE = "compute_only"
POWERSGD_START_FRACTION = 0.10  # torch: "start with 10% of total training steps"

#: workload and step budget: (epochs, target accuracy) per mode; the rest is shared
MODES = {"quick": {"epochs": 6, "target": 0.92, "idle_s": 3.0, "link_check_s": 1.0},
         "full": {"epochs": 30, "target": 0.96, "idle_s": 10.0, "link_check_s": 2.0}}
#: width 448: 234,762 parameters (0.94 MB) fit DDP's first 1 MiB bucket. With two buckets
#: torch's powerSGD_hook, which issues its P/Q all-reduces from future callbacks, races
#: across buckets on gloo (a size-mismatch abort or a hang from the first PowerSGD step).
WORKLOAD = ["workload.name=digits", "workload.model_width=448", "workload.batch_size=32",
            "workload.lr=0.05", "workload.momentum=0.9", "workload.lr_schedule=cosine"]
COMMON = ["run.seed=0", "scaling.num_workers=2", "scaling.cpus_per_worker=1",
          "checkpoint.every_epochs=1000", "checkpoint.max_failures=0"]
#: used when this JobConfig has them: spread placement; a hung collective fails the run
#: instead of the benchmark; no Prometheus exporter (it writes a shared file-SD list)
OPTIONAL = ["scaling.placement_strategy=SPREAD", "scaling.collective_timeout_s=60",
            "controller.metrics_enabled=false"]
INTERVAL = 10  # controller.interval_steps default
DRIVER_TIMEOUT_S = {"quick": 900, "full": 3600}

# goals from the issue
GOAL_VS_DENSE = 3.0
GOAL_VS_POWERSGD = 1.3
GOAL_ACC_LOSS = 0.005
GOAL_STEP_RATIO = 1.15
GOAL_RATIO = 50.0

ETH_OVERHEAD = 14 + 20 + 32  # Ethernet + IPv4 + TCP with timestamps, per segment
MSS = 1448
#: NIC bytes per payload byte of a bulk transfer: full segments, plus one bare ACK
#: (66 bytes) per two segments flowing the other way
FRAMING = (MSS + ETH_OVERHEAD) / MSS + ETH_OVERHEAD / (2 * MSS)

RAY_ENV = {
    "RAY_AUTH_MODE": "token",  # Ray >= 2.59 starts clusters with token auth (~/.ray/auth_token)
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "120",
    "OMP_NUM_THREADS": "1",
}


# --- arguments ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bandwidth", default="100mbit",
                        help="link rate each way, tc units (default 100mbit)")
    parser.add_argument("--latency", default="1ms",
                        help="one-way delay added with netem when the kernel has it (default 1ms; "
                             "recorded as not applied otherwise)")
    parser.add_argument("--quick", action="store_true",
                        help=f"short run: {MODES['quick']['epochs']} epochs, target "
                             f"{MODES['quick']['target']} (full: {MODES['full']['epochs']} epochs, "
                             f"target {MODES['full']['target']})")
    parser.add_argument("--epochs", type=int, default=None, help="override the epochs of the mode")
    parser.add_argument("--target", type=float, default=None, help="override the target accuracy")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated subset (default: all seven)")
    parser.add_argument("--output-dir", default="docs/benchmarks",
                        help="where e2e-<bandwidth>.{json,md,png} go (default docs/benchmarks)")
    parser.add_argument("--work-dir", default=None,
                        help="run outputs and raw traces (default outputs/e2e/<link suffix>)")
    parser.add_argument("--reanalyze", metavar="WORK_DIR", default=None,
                        help="rebuild the reports from a finished run's raw traces (no training)")


def _methods(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise SystemExit(f"error: --methods: unknown {unknown or text!r}; allowed: {', '.join(METHODS)}")
    return [n for n in METHODS if n in names]


# --- the orchestrator (root namespace) --------------------------------------------------------
def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from jobs._report import eprint, machine_info
    from jobs.netns import parse_rate, rate_label

    if args.reanalyze:
        work = Path(args.reanalyze)
        meta = json.loads((work / "meta.json").read_text())
        results = _results(work, meta)
        paths = write_reports(results, Path(args.output_dir), meta["label"])
        eprint(f"e2e: rebuilt {', '.join(map(str, paths))} from {work}")
        return 0
    mode = "quick" if args.quick else "full"
    settings = dict(MODES[mode])
    if args.epochs:
        settings["epochs"] = args.epochs
    if args.target:
        settings["target"] = args.target
    methods = _methods(args.methods)
    label = rate_label(parse_rate(args.bandwidth))
    started = time.time()
    info = machine_info(1)
    load_start = os.getloadavg()
    if os.geteuid() != 0:
        eprint("e2e: needs root (network namespaces)")
        return 2
    try:
        return _run(args, argv, settings, mode, methods, label, started, info, load_start)
    except KeyboardInterrupt:
        eprint("e2e: interrupted; the namespaces, the veth pair and the Ray nodes are torn down")
        return 130


def _run(args: argparse.Namespace, argv: Sequence[str], settings: dict[str, Any], mode: str,
         methods: list[str], label: str, started: float, info: dict[str, Any],
         load_start: tuple[float, float, float]) -> int:
    from jobs._report import command_line, eprint
    from jobs.netns import ThrottledLink

    with ThrottledLink(args.bandwidth, args.latency) as link:
        work = Path(args.work_dir or REPO / "outputs" / "e2e" / link.suffix).resolve()
        work.mkdir(parents=True, exist_ok=True)
        eprint(f"e2e: namespaces {link.ns_a} / {link.ns_b}, {link.shaping()['qdisc']['a']}, work {work}")
        if link.shaping()["note"]:
            eprint(f"e2e: WARNING {link.shaping()['note']}")
        check = {"a_to_b": link.measure_throughput(settings["link_check_s"], "a"),
                 "b_to_a": link.measure_throughput(settings["link_check_s"], "b"),
                 "rtt": link.measure_rtt(20)}
        eprint("e2e: link " + ", ".join(f"{k} {v['bits_per_s'] / 1e6:.1f} Mbit/s"
                                        for k, v in check.items() if "bits_per_s" in v)
               + f", rtt {check['rtt']['median_s'] * 1e6:.0f} us")
        temp = {side: Path(f"/tmp/rcb-{link.suffix}-{side}") for side in ("a", "b")}
        try:
            port = start_cluster(link, temp, work)
            spec = {"methods": methods, "settings": settings, "work": str(work),
                    "dev": link.dev["a"], "address": f"{link.addr_a}:{port}",
                    "netns_inodes": {s: os.stat(f"/run/netns/{link.ns[s]}").st_ino for s in ("a", "b")},
                    "ray_temp_a": str(temp["a"]), "addresses": dict(link.addr)}
            (work / "spec.json").write_text(json.dumps(spec, indent=2))
            env = {**os.environ, **RAY_ENV, "PYTHONPATH": _pythonpath(),
                   "RAY_ADDRESS": spec["address"], "GLOO_SOCKET_IFNAME": link.dev["a"]}
            driver = link.popen("a", [sys.executable, "-m", "jobs.bench_e2e", "--driver",
                                      str(work / "spec.json")], env=env, cwd=REPO)
            try:
                code = driver.wait(timeout=DRIVER_TIMEOUT_S[mode])
            except subprocess.TimeoutExpired:
                eprint(f"e2e: the driver ran past {DRIVER_TIMEOUT_S[mode]} s; stopped. Logs in {work}")
                return 1
            if code != 0:
                eprint(f"e2e: driver failed with exit code {code}; logs in {work}")
                return 1
            shaping = link.shaping()
        finally:
            link.close()
            for side, path in temp.items():  # keep Ray's logs with the run outputs
                logs = path / "session_latest" / "logs"
                if logs.is_dir():
                    shutil.copytree(logs, work / f"ray-logs-{side}", dirs_exist_ok=True,
                                    ignore_dangling_symlinks=True)
                shutil.rmtree(path, ignore_errors=True)
    meta = {"settings": settings, "mode": mode, "label": label, "shaping": shaping, "check": check,
            "command": command_line("jobs.bench", argv), "machine": info,
            "benchmark_seconds": time.time() - started,
            "load_average": {"start": list(load_start), "end": list(os.getloadavg())}}
    (work / "meta.json").write_text(json.dumps(meta, indent=2))
    results = _results(work, meta)
    paths = write_reports(results, Path(args.output_dir), label)
    eprint(f"e2e: wrote {', '.join(map(str, paths))} in {time.time() - started:.0f} s")
    return 0


def _results(work: Path, meta: dict[str, Any]) -> dict[str, Any]:
    raw = json.loads((work / "raw.json").read_text())
    results = analyze(raw, meta["settings"], meta["mode"], meta["label"], meta["shaping"], meta["check"])
    results.update({k: meta[k] for k in ("command", "machine", "benchmark_seconds", "load_average")},
                   work_dir=str(work))
    return results


def _pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def start_cluster(link: Any, temp: dict[str, Path], work: Path, port: int = 6379) -> int:
    """``ray start --block`` in both namespaces; returns the GCS port (in namespace a)."""
    ray = str(Path(sys.executable).with_name("ray"))
    if not Path(ray).exists():
        ray = shutil.which("ray") or "ray"
    for side in ("a", "b"):
        shutil.rmtree(temp[side], ignore_errors=True)
    common = ["--block", "--num-cpus", "1", "--disable-usage-stats", "--include-log-monitor=false",
              "--object-store-memory", str(200 * 2**20)]
    argv = {
        "a": [ray, "start", "--head", "--node-ip-address", link.addr_a, "--port", str(port),
              "--include-dashboard=false", "--temp-dir", str(temp["a"]), *common],
        "b": [ray, "start", "--address", f"{link.addr_a}:{port}", "--node-ip-address", link.addr_b,
              "--temp-dir", str(temp["b"]), *common],
    }
    for side in ("a", "b"):  # the worker node needs the head's GCS up
        env = {**os.environ, **RAY_ENV, "PYTHONPATH": _pythonpath(), "GLOO_SOCKET_IFNAME": link.dev[side]}
        env.pop("RAY_ADDRESS", None)
        log_path = work / f"ray-{side}.log"
        with open(log_path, "w") as log:
            proc = link.popen(side, argv[side], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        _wait_for(log_path, "Ray runtime started", proc, timeout=180)
    return port


def _wait_for(log_path: Path, text: str, proc: subprocess.Popen[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log_path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"ray start did not come up ({log_path}):\n{tail}")


# --- the driver (inside namespace a) ----------------------------------------------------------
class Tracker(threading.Thread):
    """Samples the veth counters and watches rank 0's step log, every ``period`` seconds.

    The step log is flushed at every control boundary (``interval_steps``) and at the end
    of every epoch; each flush's mtime with the line count at that moment gives when the
    run reached that step. The file is created (empty) by the session right before step 0.
    """

    def __init__(self, step_log: Path, dev: str, period: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.step_log, self.period = step_log, period
        self.stats = Path(f"/sys/class/net/{dev}/statistics")
        self.nic: list[tuple[float, int, int]] = []
        self.flushes: list[tuple[float, int]] = []
        self.t0: float | None = None
        self.t0_exact = True
        self._last: tuple[int, int] | None = None
        self._halt = threading.Event()

    def counters(self) -> tuple[int, int]:
        return (int((self.stats / "tx_bytes").read_text()), int((self.stats / "rx_bytes").read_text()))

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.sample()

    def sample(self) -> None:
        now = time.time()
        tx, rx = self.counters()
        self.nic.append((now, tx, rx))
        try:
            st = os.stat(self.step_log)
        except FileNotFoundError:
            return
        key = (st.st_size, st.st_mtime_ns)
        if key == self._last:
            return
        if self.t0 is None:
            self.t0 = st.st_mtime_ns / 1e9 if st.st_size == 0 else now
            self.t0_exact = st.st_size == 0
        lines = self.step_log.read_bytes().count(b"\n")
        st2 = os.stat(self.step_log)
        if (st2.st_size, st2.st_mtime_ns) != key:
            return  # written meanwhile: take it at the next tick
        self._last = key
        if lines:
            self.flushes.append((st.st_mtime_ns / 1e9, lines))


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
    """world rank -> namespace, from the newest Ray Train controller log ("Started training
    worker group ... (ip=..., pid=...) world_rank=r") written after ``since``."""
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


def method_overrides(name: str, settings: dict[str, Any], steps: int, known: set[str]) -> list[str]:
    """Config overrides of one method (``known``: optional keys this JobConfig accepts)."""
    overrides = [*WORKLOAD, f"workload.epochs={settings['epochs']}", *COMMON,
                 *[o for o in OPTIONAL if o.split("=")[0] in known]]
    if name == COMPUTE:
        return [*overrides, "scaling.num_workers=1", *TORCH_BASELINE_OVERRIDES,
                f"compression.warmup_steps={10 * steps}"]
    overrides += METHODS[name]
    if name in TORCH_HOOKS:
        overrides += TORCH_BASELINE_OVERRIDES
    if name == "torch_powersgd":
        overrides.append(f"compression.baseline_powersgd_start_iter={max(1, round(POWERSGD_START_FRACTION * steps))}")
    return overrides


def _known_keys() -> set[str]:
    from raycomp.config import JobConfig

    keys = set()
    for section, field in JobConfig.model_fields.items():
        model = field.annotation
        for sub in getattr(model, "model_fields", {}):
            keys.add(f"{section}.{sub}")
    return keys


def driver(spec_path: str) -> int:
    """Inside namespace a: run every method on the 2-node cluster; write raw.json."""
    import logging

    import ray

    from jobs import train
    from jobs.workloads import build
    from raycomp.config import load_config

    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(Path(spec_path).read_text())
    work, settings = Path(spec["work"]), spec["settings"]
    inodes = {k: int(v) for k, v in spec["netns_inodes"].items()}
    ray.init(address=spec["address"], log_to_driver=False)
    deadline = time.time() + 120
    while sum(n["Alive"] for n in ray.nodes()) < 2:
        if time.time() > deadline:
            raise RuntimeError(f"the worker node never joined: {ray.nodes()}")
        time.sleep(0.5)
    _log(f"cluster: {[(n['NodeManagerAddress'], n['Resources'].get('CPU')) for n in ray.nodes() if n['Alive']]}")
    known = _known_keys()
    base = load_config(None, [*WORKLOAD, f"workload.epochs={settings['epochs']}", *COMMON])
    workload = build(base.workload, 0, 2, base.run.seed)
    spe = workload.steps_per_epoch
    steps = spe * settings["epochs"]
    layers = {n: list(p.shape) for n, p in workload.model.named_parameters()}
    raw: dict[str, Any] = {"spec": spec, "steps_per_epoch": spe, "steps": steps, "layers": layers,
                           "interval_steps": base.controller.interval_steps, "runs": {}}

    raw["idle"] = []

    controller_pid = None
    for name in [COMPUTE, *spec["methods"]]:
        overrides = method_overrides(name, settings, steps, known)
        run_id = f"e2e-{name.replace('_', '-')}-{os.urandom(3).hex()}"
        output = work / run_id
        config, run_id, output = train.prepare(["--run-id", run_id, "--output", str(output), *overrides])
        if name == COMPUTE:
            config = config.model_copy(update={"workload": config.workload.model_copy(
                update={"steps_per_epoch": spe, "epochs": min(settings["epochs"], 3)})})
        evals = output / "evals.jsonl"
        output.mkdir(parents=True, exist_ok=True)
        tracker = Tracker(output / "steps" / "rank0.jsonl", spec["dev"])
        cpu_before = _cpu_seconds(controller_pid)
        _log(f"{name}: {' '.join(METHODS.get(name, ['scaling.num_workers=1']))}")
        load_before = os.getloadavg()[0]
        t_start = time.time()
        tracker.start()
        try:
            summary = train.run(config, run_id, output)
        except Exception as error:  # noqa: BLE001 - recorded, the other methods still run
            summary = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
        t_end = time.time()
        tracker.stop()
        if controller_pid is None:
            try:
                handle = ray.get_actor(config.controller.name, namespace=config.controller.namespace)
                controller_pid = ray.get(handle.pid.remote(), timeout=30)
                raw["controller"] = {"pid": controller_pid, "node": _node_of(controller_pid, inodes)}
            except Exception as error:  # noqa: BLE001
                raw["controller"] = {"error": str(error)}
        cpu_after = _cpu_seconds(controller_pid)
        placement = _placement(spec["ray_temp_a"], t_start, spec["addresses"])
        step_log = output / "steps" / "rank0.jsonl"
        records = [json.loads(line) for line in step_log.read_text().splitlines()] if step_log.exists() else []
        raw["runs"][name] = {
            "run_id": run_id, "output": str(output), "overrides": overrides,
            "summary": {k: v for k, v in summary.items() if k not in ("config", "final_plan")},
            "config": config.model_dump(mode="json"),
            "t_start": t_start, "t_end": t_end, "t0": tracker.t0, "t0_exact": tracker.t0_exact,
            "flushes": tracker.flushes, "nic": tracker.nic,
            "evals": [json.loads(line) for line in evals.read_text().splitlines()] if evals.exists() else [],
            "steps": [{k: r[k] for k in ("step", "epoch", "wire_bytes", "dense_bytes", "loss", "dense")}
                      for r in records],
            "controller_cpu_s": None if cpu_before is None or cpu_after is None else cpu_after - cpu_before,
            "load_average": [load_before, os.getloadavg()[0]],
            "placement": placement,
        }
        acc = summary.get("final_eval_accuracy")
        _log(f"{name}: {summary.get('status')} in {t_end - t_start:.1f} s, "
             f"{summary.get('steps')} steps, accuracy {acc}, placement {placement}"
             + (f", error {summary.get('error')}" if summary.get("error") else ""))
        if name == COMPUTE:
            raw["idle"].append(_idle(spec["dev"], work, settings["idle_s"]))
        (work / "raw.json").write_text(json.dumps(raw))
    raw["idle"].append(_idle(spec["dev"], work, settings["idle_s"]))
    (work / "raw.json").write_text(json.dumps(raw))
    ray.shutdown()
    return 0


def _idle(dev: str, work: Path, seconds: float) -> dict[str, float]:
    """Bytes on the link while the cluster (and the controller actor) sit idle."""
    tracker = Tracker(work / "idle.none", dev)
    t1, tx1, rx1 = time.time(), *tracker.counters()
    time.sleep(seconds)
    t2, tx2, rx2 = time.time(), *tracker.counters()
    _log(f"idle Ray traffic: {(tx2 + rx2 - tx1 - rx1) / (t2 - t1):.0f} B/s over {t2 - t1:.1f} s")
    return {"seconds": t2 - t1, "tx_bytes": tx2 - tx1, "rx_bytes": rx2 - rx1}


def _log(message: str) -> None:
    print(f"[e2e driver] {message}", file=sys.stderr, flush=True)


# --- analysis (pure: raw traces -> results) ---------------------------------------------------
def torch_hook_bytes(hook: str, layers: dict[str, list[int]], world: int, steps: int,
                     rank: int = 2, start_iter: int = 0, min_compression_rate: float = 2.0) -> list[float]:
    """Bytes one rank transmits per step under torch's hook (ring all-reduce model)."""
    factor = 2 * (world - 1) / world
    numel = sum(math.prod(s) for s in layers.values())
    if hook == "allreduce":
        return [factor * 4 * numel] * steps
    if hook == "fp16":
        return [factor * 2 * numel] * steps
    compressed = 0
    for shape in layers.values():  # powerSGD_hook: tensor.view(shape[0], -1)
        n = shape[0]
        m = math.prod(shape) // n
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            compressed += (n + m) * r
        else:
            compressed += n * m
    return [factor * 4 * (numel if step < start_iter else compressed) for step in range(steps)]


def _interp(samples: list[list[float]], t: float) -> tuple[float, float]:
    """Counters (tx, rx) at time ``t`` by linear interpolation of the samples."""
    if not samples:
        return (0.0, 0.0)
    if t <= samples[0][0]:
        return (samples[0][1], samples[0][2])
    for (t1, tx1, rx1), (t2, tx2, rx2) in zip(samples, samples[1:], strict=False):
        if t1 <= t <= t2:
            w = (t - t1) / (t2 - t1) if t2 > t1 else 1.0
            return (tx1 + w * (tx2 - tx1), rx1 + w * (rx2 - rx1))
    return (samples[-1][1], samples[-1][2])


def step_time(flushes: list[list[float]], spe: int, start: int) -> tuple[float | None, int]:
    """Seconds per step over flush intervals that touch no epoch end (eval/report) and
    begin at or after step ``start``: sum of their durations / sum of their steps."""
    total_t, total_n = 0.0, 0
    for (t1, n1), (t2, n2) in zip(flushes, flushes[1:], strict=False):
        if n1 < max(start, 1) or n2 <= n1:
            continue
        if any(n1 <= e * spe <= n2 for e in range(n1 // spe, n2 // spe + 1)):
            continue  # an epoch ended in it, at its start, or at its end (the eval may be inside)
        total_t += t2 - t1
        total_n += int(n2 - n1)
    return (total_t / total_n if total_n else None), total_n


def analyze_run(name: str, run: dict[str, Any], raw: dict[str, Any], target: float,
                idle_rate: float) -> dict[str, Any]:
    spe, layers = raw["steps_per_epoch"], raw["layers"]
    summary = run["summary"]
    world = 1 if name == COMPUTE else 2
    steps_done = int(summary.get("steps") or len(run["steps"]))
    compression = run["config"]["compression"]
    start_iter = compression.get("baseline_powersgd_start_iter", 0)
    if name in TORCH_HOOKS:
        per_step = torch_hook_bytes(TORCH_HOOKS[name], layers, world, steps_done,
                                    compression.get("baseline_powersgd_rank", 2), start_iter)
        cumulative = [world * sum(per_step[: s + 1]) for s in range(steps_done)]
        wire_source = "model of torch's hook"
    else:
        cumulative = [world * r["wire_bytes"] for r in run["steps"]]  # rank 0's ledger x ranks
        wire_source = "raycomp ledger"
    wire_total = float(summary.get("wire_bytes_total") or 0.0) if name not in TORCH_HOOKS else \
        (cumulative[-1] if cumulative else 0.0)
    dense_total = world * sum(torch_hook_bytes("allreduce", layers, world, steps_done)) if world > 1 else 0.0
    flushes, t0 = run["flushes"], run["t0"]
    t_last = flushes[-1][0] if flushes else None

    def time_at(step: int) -> float | None:
        return next((t - t0 for t, n in flushes if n >= step), None) if t0 else None

    curve = []
    for ev in run["evals"]:
        acc = ev.get("eval_accuracy")
        step = int(ev.get("step", 0))
        if acc is None or step <= 0:
            continue
        curve.append({"epoch": int(ev.get("epoch", 0)), "step": step, "accuracy": acc,
                      "time_s": time_at(step), "report_time_s": ev["time"] - t0 if t0 else None,
                      "wire_bytes": cumulative[step - 1] if 0 < step <= len(cumulative) else None})
    hit = next((p for p in curve if p["accuracy"] >= target and p["time_s"] is not None), None)
    warm = compression.get("warmup_steps", 0) \
        if compression.get("baseline_hook", "none") == "none" and name != COMPUTE else 0
    steady_from = max(warm, start_iter if name == "torch_powersgd" else 0) + INTERVAL
    step_s, step_n = step_time(flushes, spe, steady_from)
    all_s, _ = step_time(flushes, spe, 0)
    nic = None
    if t0 and t_last and run["nic"]:
        (tx0, rx0), (tx1, rx1) = _interp(run["nic"], t0), _interp(run["nic"], t_last)
        raw_bytes = (tx1 - tx0) + (rx1 - rx0)
        nic = {"tx_bytes": tx1 - tx0, "rx_bytes": rx1 - rx0, "raw_bytes": raw_bytes,
               "idle_bytes": idle_rate * (t_last - t0),
               "bytes": raw_bytes - idle_rate * (t_last - t0)}
    wire_window = cumulative[-1] if cumulative else 0.0
    steady_nic = None  # the same comparison over the steady (compressed) phase only
    t_steady = time_at(steady_from)
    if nic and t_steady is not None and len(cumulative) > steady_from:
        (tx0, rx0), (tx1, rx1) = _interp(run["nic"], t0 + t_steady), _interp(run["nic"], t_last)
        seconds = t_last - t0 - t_steady
        nic_bytes = (tx1 - tx0) + (rx1 - rx0) - idle_rate * seconds
        wire = cumulative[-1] - cumulative[steady_from - 1]
        n_steps = len(cumulative) - steady_from
        steady_nic = {"from_step": steady_from, "steps": n_steps, "seconds": seconds,
                      "nic_bytes": nic_bytes, "wire_bytes": wire, "ratio": nic_bytes / wire if wire else None,
                      # beyond the payload in full TCP segments + delayed ACKs (FRAMING x wire):
                      # control all-gathers, plan broadcasts, Ray RPCs, small-message framing
                      "other_bytes_per_step": (nic_bytes - FRAMING * wire) / n_steps}
    steady_bytes = None
    if len(cumulative) > steady_from + 1:
        steady_bytes = (cumulative[-1] - cumulative[steady_from - 1]) / (len(cumulative) - steady_from) / world \
            if world > 1 else 0.0
    return {
        "name": name,
        "status": summary.get("status"),
        "error": summary.get("error"),
        "steps": steps_done,
        "time_to_target_s": hit["time_s"] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "final_accuracy": summary.get("final_eval_accuracy"),
        "wire_bytes": wire_total,
        "wire_bytes_source": wire_source,
        "nic_bytes": nic["bytes"] if nic else None,
        "nic": nic,
        "nic_over_wire": nic["bytes"] / wire_window if nic and wire_window else None,
        "nic_steady": steady_nic,
        "dense_bytes": dense_total,
        "compression_ratio": dense_total / wire_total if wire_total else None,
        "step_s": step_s,
        "step_s_steps": step_n,
        "step_s_from_step": steady_from,
        "step_s_all": all_s,
        "bytes_per_rank_per_step_steady": steady_bytes,
        "training_s": (t_last - t0) if t0 and t_last else None,
        "fit_s": run["t_end"] - run["t_start"],
        "controller_cpu_s": run.get("controller_cpu_s"),
        "control_overhead": summary.get("control_overhead"),
        "control_seconds": summary.get("control_seconds"),
        "plan_switches": summary.get("plan_switches"),
        "placement": run.get("placement"),
        "load_average": run.get("load_average"),
        "curve": curve,
        "overrides": run["overrides"],
    }


def analyze(raw: dict[str, Any], settings: dict[str, Any], mode: str, label: str,
            shaping: dict[str, Any], check: dict[str, Any]) -> dict[str, Any]:
    idles = raw["idle"] if isinstance(raw["idle"], list) else [raw["idle"]]
    idle_rate = sum(i["tx_bytes"] + i["rx_bytes"] for i in idles) / max(1e-9, sum(i["seconds"] for i in idles))
    target = settings["target"]
    runs = {name: analyze_run(name, run, raw, target, idle_rate) for name, run in raw["runs"].items()}
    compute = runs.pop(COMPUTE, None)
    compute_step = compute["step_s"] if compute else None
    methods = []
    for name in METHODS:
        if name not in runs:
            continue
        r = runs[name]
        r["step_over_compute"] = r["step_s"] / compute_step if r["step_s"] and compute_step else None
        methods.append(r)
    results = {
        "bandwidth": label,
        "bandwidth_bps": shaping["rate_bps"],
        "latency_requested_s": shaping["latency_requested_s"],
        "latency_applied": shaping["latency_applied"],
        "target_accuracy": target,
        "compute_step_s": compute_step,
        "methods": methods,
        "mode": mode,
        "workload": {"overrides": WORKLOAD, "epochs": settings["epochs"], "steps": raw["steps"],
                     "steps_per_epoch": raw["steps_per_epoch"], "world_size": 2,
                     "parameters": sum(math.prod(s) for s in raw["layers"].values())},
        "link": {"shaping": shaping, "check": check,
                 "idle_ray_bytes_per_s": idle_rate},
        "controller": raw.get("controller"),
        "compute_only": compute,
    }
    results["goals"] = goals(results)
    results["cost_model"] = cost_model(results, raw)
    return results


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    by = {m["name"]: m for m in results["methods"]}
    out: list[dict[str, Any]] = []
    ada = by.get("raycomp_adaptive")
    if not ada:
        return out

    def speedup(other: str) -> float | None:
        o = by.get(other)
        if not o or not o["time_to_target_s"] or not ada["time_to_target_s"]:
            return None
        return o["time_to_target_s"] / ada["time_to_target_s"]

    dense = by.get("dense")
    loss = (dense["final_accuracy"] - ada["final_accuracy"]) \
        if dense and dense["final_accuracy"] is not None and ada["final_accuracy"] is not None else None
    out.append({"goal": f"adaptive time to target >= {GOAL_VS_DENSE:g}x faster than dense",
                "value": speedup("dense"), "ok": (speedup("dense") or 0) >= GOAL_VS_DENSE})
    out.append({"goal": f"adaptive time to target >= {GOAL_VS_POWERSGD:g}x faster than torch powerSGD_hook",
                "value": speedup("torch_powersgd"), "ok": (speedup("torch_powersgd") or 0) >= GOAL_VS_POWERSGD})
    out.append({"goal": f"adaptive final accuracy loss vs dense <= {GOAL_ACC_LOSS * 100:g} points",
                "value": None if loss is None else loss * 100, "ok": loss is not None and loss <= GOAL_ACC_LOSS})
    ratio = ada["step_over_compute"]
    out.append({"goal": f"adaptive step time <= {GOAL_STEP_RATIO:g}x the compute-only step",
                "value": ratio, "ok": ratio is not None and ratio <= GOAL_STEP_RATIO})
    out.append({"goal": f"adaptive whole-run compression ratio >= {GOAL_RATIO:g}x",
                "value": ada["compression_ratio"], "ok": (ada["compression_ratio"] or 0) >= GOAL_RATIO})
    return out


#: how a method's per-rank bytes grow with N ranks, from the 2-rank value b2
SCALING = {"dense": "allreduce", "torch_fp16": "allreduce", "torch_powersgd": "allreduce",
           "raycomp_powersgd": "allreduce", "raycomp_int8": "allreduce",  # all-to-all + all-gather
           "raycomp_topk": "allgather", "raycomp_adaptive": "allgather"}
#: sequential message rounds per step at N ranks (ring algorithms), for the latency term
ROUNDS = {"allreduce": lambda n: 2 * (n - 1), "allgather": lambda n: n - 1}
PROJECT_N = (2, 8, 32)
PROJECT_BW = (1e7, 1e8, 1e9, 1e10)
PROJECT_LATENCY = 1e-3


def bytes_at(kind: str, b2: float, n: int) -> float:
    """Per-rank bytes at ``n`` ranks given the 2-rank value ``b2``."""
    return 2 * (n - 1) / n * b2 if kind == "allreduce" else (n - 1) * b2


def cost_model(results: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """t_step = t_compute + t_codec + bytes_per_rank / goodput + rounds x latency.

    ``goodput`` = link rate x MSS / (MSS + 66 header bytes). ``t_codec`` (compression,
    Python and gloo software cost) is the residual of the 2-node measurement, so the check
    column is the prediction *without* it; projections keep it constant in N.
    """
    compute = results["compute_step_s"]
    rate = results["bandwidth_bps"] / 8 * MSS / (MSS + ETH_OVERHEAD)
    latency = results["latency_requested_s"] if results["latency_applied"] else 0.0
    rows = []
    for m in results["methods"]:
        b2 = m["bytes_per_rank_per_step_steady"]
        if b2 is None or compute is None or m["step_s"] is None:
            continue
        kind = SCALING[m["name"]]
        comm = b2 / rate + ROUNDS[kind](2) * latency
        predicted = compute + comm
        codec = max(0.0, m["step_s"] - predicted)
        projections = {}
        for n in PROJECT_N:
            for bw in PROJECT_BW:
                goodput = bw / 8 * MSS / (MSS + ETH_OVERHEAD)
                t = compute + codec + bytes_at(kind, b2, n) / goodput + ROUNDS[kind](n) * PROJECT_LATENCY
                projections[f"N={n}@{_bw(bw)}"] = t
        rows.append({"name": m["name"], "scaling": kind, "bytes_per_rank_per_step": b2,
                     "comm_s": comm, "predicted_step_s": predicted, "measured_step_s": m["step_s"],
                     "error": (predicted - m["step_s"]) / m["step_s"], "codec_s": codec,
                     "projected_step_s": projections})
    return {"goodput_bytes_per_s": rate, "latency_s": latency, "projection_latency_s": PROJECT_LATENCY,
            "rows": rows}


def _bw(bps: float) -> str:
    from jobs.netns import rate_label

    return rate_label(bps)


# --- reports ----------------------------------------------------------------------------------
def _f(value: Any, fmt: str = "{:.2f}", none: str = "—") -> str:
    return none if value is None else fmt.format(value)


def render_markdown(results: dict[str, Any]) -> str:
    from jobs._report import machine_markdown, markdown_table

    methods = results["methods"]
    by = {m["name"]: m for m in methods}
    dense_ttt = by.get("dense", {}).get("time_to_target_s")
    link, wl = results["link"], results["workload"]
    check, shaping = link["check"], link["shaping"]
    compute_ms = results["compute_step_s"] * 1e3 if results["compute_step_s"] else None
    table = markdown_table(
        ["method", "time to target s", "vs dense", "steps to target", "final acc", "wire bytes",
         "NIC bytes", "NIC / wire", "ratio", "step ms", "step / compute"],
        [[m["name"],
          _f(m["time_to_target_s"]),
          _f(dense_ttt / m["time_to_target_s"] if dense_ttt and m["time_to_target_s"] else None, "{:.2f}x"),
          _f(m["steps_to_target"], "{}"),
          _f(m["final_accuracy"], "{:.4f}"),
          _f(m["wire_bytes"], "{:,.0f}") + ("*" if m["wire_bytes_source"] != "raycomp ledger" else ""),
          _f(m["nic_bytes"], "{:,.0f}"),
          _f(m["nic_over_wire"], "{:.3f}"),
          _f(m["compression_ratio"], "{:.1f}x"),
          _f(m["step_s"] * 1e3 if m["step_s"] else None, "{:.1f}"),
          _f(m["step_over_compute"], "{:.2f}x")] for m in methods],
        align="l" + "r" * 10,
    )
    overhead = markdown_table(
        ["method", "steady from step", "steady wire B/rank/step", "NIC / wire steady",
         "other NIC B/step", "control share of step", "controller CPU s", "fit s (incl. start-up)",
         "load avg"],
        [[m["name"], _f(m["step_s_from_step"], "{}"),
          _f(m["bytes_per_rank_per_step_steady"], "{:,.0f}"),
          _f((m.get("nic_steady") or {}).get("ratio"), "{:.3f}"),
          _f((m.get("nic_steady") or {}).get("other_bytes_per_step"), "{:,.0f}"),
          _f(m["control_overhead"] * 100 if m["control_overhead"] is not None else None, "{:.1f}%"),
          _f(m["controller_cpu_s"], "{:.2f}"), _f(m["fit_s"], "{:.1f}"),
          "→".join(f"{v:.1f}" for v in m.get("load_average") or [])] for m in methods],
        align="l" + "r" * 8,
    )
    goal_lines = [f"- {g['goal']}: **{_f(g['value'], '{:.2f}')}** — **{'PASS' if g['ok'] else 'MISS'}**"
                  for g in results["goals"]]
    cm = results["cost_model"]
    cols = [f"N={n}@{_bw(bw)}" for n in PROJECT_N for bw in (1e8, 1e9)]
    cost_table = markdown_table(
        ["method", "scaling", "bytes/rank/step", "model ms (no codec)", "measured ms", "model error",
         "codec+sw ms", *[c + " ms" for c in cols]],
        [[r["name"], r["scaling"], f"{r['bytes_per_rank_per_step']:,.0f}", f"{r['predicted_step_s'] * 1e3:.1f}",
          f"{r['measured_step_s'] * 1e3:.1f}", f"{r['error'] * 100:+.0f}%", f"{r['codec_s'] * 1e3:.1f}",
          *[f"{r['projected_step_s'][c] * 1e3:.1f}" for c in cols]] for r in cm["rows"]],
        align="llrrrrr" + "r" * len(cols),
    )
    placements = sorted({", ".join(f"{k} in {v}" for k, v in sorted((m.get("placement") or {}).items()))
                         for m in methods})
    ctrl = results.get("controller") or {}
    compute = results.get("compute_only") or {}
    load = results.get("load_average") or {}
    lat_note = (f"netem one-way delay {results['latency_requested_s'] * 1e3:g} ms on each end"
                if results["latency_applied"] else
                f"the requested {results['latency_requested_s'] * 1e3:g} ms one-way delay was **not applied**: "
                "this kernel has no `sch_netem` (tbf only), so the link has its own sub-millisecond round trip")
    parts = [
        f"# End-to-end benchmark: 2 nodes over a {results['bandwidth']} link",
        "",
        f"Generated by `jobs/bench_e2e.py`; all numbers in `e2e-{results['bandwidth']}.json`, "
        f"plots (accuracy vs wall time and vs wire bytes) in `e2e-{results['bandwidth']}.png`.",
        "",
        "## Command",
        "",
        f"```\n{results['command']}\n```",
        "",
        f"Mode **{results['mode']}**; the whole benchmark took {results['benchmark_seconds']:.0f} s "
        f"(load average {_f((load.get('start') or [None])[0], '{:.1f}')} at the start, "
        f"{_f((load.get('end') or [None])[0], '{:.1f}')} at the end: the machine is shared).",
        "",
        "## Machine",
        "",
        machine_markdown(results["machine"]),
        "",
        "## Set-up",
        "",
        f"- Link: a veth pair between network namespaces `{shaping['namespaces']['a']}` and "
        f"`{shaping['namespaces']['b']}` ({shaping['addresses']['a']} / {shaping['addresses']['b']}); "
        f"the egress of each end is shaped with `{shaping['qdisc']['a']}`; {lat_note}.",
        f"- Link check (one bulk TCP flow each way): a→b {check['a_to_b']['bits_per_s'] / 1e6:.1f} Mbit/s "
        f"of payload ({check['a_to_b']['wire_bits_per_s'] / 1e6:.1f} Mbit/s of frames), b→a "
        f"{check['b_to_a']['bits_per_s'] / 1e6:.1f} Mbit/s; TCP round trip median "
        f"{check['rtt']['median_s'] * 1e6:.0f} µs.",
        "- Ray: `ray start --head --num-cpus 1` in namespace a, `ray start --num-cpus 1` in b (token "
        "auth on, `GLOO_SOCKET_IFNAME` = the node's veth); the driver, Ray Train's controller and the "
        f"raycomp controller actor run in a (controller process found in namespace `{ctrl.get('node')}`). "
        f"Train workers (from Ray Train's log): {'; '.join(placements)} — one per node, so all "
        "gradient traffic crosses the link.",
        f"- Workload: digits MLP of width 448 ({wl['parameters']:,} parameters, "
        f"{wl['parameters'] * 4 / 1e6:.2f} MB fp32, one DDP bucket: see Notes), 2 workers x batch 32, "
        f"SGD momentum 0.9, lr 0.05 cosine, seed 0, {wl['epochs']} epochs = {wl['steps']} steps "
        f"({wl['steps_per_epoch']} per epoch), test accuracy on the 359 held-out digits after every "
        "epoch. Every method trains exactly these steps on the same data order.",
        f"- Target accuracy **{results['target_accuracy']}**. Time to target: wall time from the first "
        "training step (rank 0's step log is created) to the end of the first epoch whose evaluation "
        "reaches it (per-epoch evaluation and report stalls included, Ray start-up excluded).",
        "- Wire bytes: the sum over ranks of what each transmitted: raycomp's ledger for raycomp "
        "methods; for the torch baselines (*) the exact byte model of torch's hook (ring all-reduce "
        "2(N-1)/N x payload per rank; PowerSGD: the P and Q factors of the compressible layers plus the "
        "rest uncompressed, dense before `start_powerSGD_iter`), because raycomp cannot see those bytes.",
        "- NIC bytes: veth tx + rx in namespace a between the first and the last step-log flush, minus "
        f"the idle Ray traffic rate ({link['idle_ray_bytes_per_s']:,.0f} B/s, measured with the cluster "
        f"idle) x that time. A bulk TCP transfer costs {FRAMING:.3f} NIC bytes per payload byte "
        f"({ETH_OVERHEAD} header bytes per {MSS}-byte segment plus one ACK per two segments).",
        "- Step time: steady state (after the dense warm-up or `start_powerSGD_iter`, plus one control "
        f"interval), from the mtimes of rank 0's step-log flushes (every {INTERVAL} steps) over the "
        "intervals that touch no epoch end, total time / total steps. Compute-only: the same loop with "
        "1 worker (no DDP, no communication) and the same per-worker batch: "
        f"**{_f(compute_ms, '{:.2f}')} ms** per step ({compute.get('step_s_steps', 0)} steps measured).",
        "",
        "## Results",
        "",
        table,
        "",
        "Bytes and overheads:",
        "",
        overhead,
        "",
        "- *other NIC B/step*: steady-phase NIC bytes minus the framing model of the wire bytes, per "
        "step: raycomp's per-step control all-gather (guard vector) and plan broadcasts, the workers' "
        "statistics to the controller actor (rank on node b), Ray Train's polling, and the framing of "
        "small messages. *control share*: the session's control time (guard all-gather + control "
        "boundaries) over its step time, from the run summary; the torch baselines pay it too, since "
        "they run in the same session. *controller CPU*: CPU seconds of the controller actor during "
        "the run. *load avg*: the machine's 1-minute load average before → after the run (2 cores, "
        "shared: step times move with it).",
        "",
        "## Goals",
        "",
        *goal_lines,
        "",
        "## Cost model check and projection",
        "",
        "t_step = t_compute + t_codec + bytes_per_rank / goodput + rounds x latency (derivation in "
        "`docs/cost-model.md`). *model ms* leaves t_codec out: compute-only step + steady bytes per rank "
        f"/ {cm['goodput_bytes_per_s'] / 1e6:.2f} MB/s goodput ({results['bandwidth']} x {MSS}/{MSS + ETH_OVERHEAD})"
        "; its error shows how much of the step the bytes alone explain. *codec+sw* is the residual "
        "(compression, Python, gloo, scheduling), kept constant in the projections, which add "
        f"{cm['projection_latency_s'] * 1e3:g} ms per sequential message round and scale the bytes per "
        "rank as all-reduce 2(N-1)/N x B or all-gather (N-1) x C.",
        "",
        cost_table,
        "",
        "## Notes",
        "",
        "- Placement: each node offers one CPU and each worker needs one, so the two workers can only "
        "land on different nodes; `scaling.placement_strategy=SPREAD` is set as well.",
        "- gloo must bind to the veth: inside a namespace the host name resolves to 127.0.0.1, a "
        "different loopback per namespace; `GLOO_SOCKET_IFNAME` is set in the environment of each "
        "`ray start`, which the worker processes inherit.",
        "- torch's `powerSGD_hook` chains its all-reduces in future callbacks; on gloo, with more than "
        "one DDP bucket, the chains of different buckets interleave differently on the two ranks "
        "(`op.preamble.length <= op.nbytes` abort, or a hang, from the first PowerSGD step; reproduced "
        "without Ray). The model is sized to fit DDP's first 1 MiB bucket so the baseline runs.",
        "- Where the time goes, and why some goals cannot be met by this workload on this machine "
        "(a compute step of a few ms next to a fixed per-step cost; Top-K 1% at 2 ranks caps the "
        "per-step compression ratio at 1/(N x 1%) = 50x): `docs/cost-model.md`.",
        "- The raycomp methods keep their default dense warm-up (20 steps; the compressed plan reaches "
        "the workers at the next control boundary, step 30); torch's PowerSGD starts at 10% of the "
        "steps, as torch's documentation suggests.",
        "",
    ]
    return "\n".join(parts)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in results["methods"]:
        pts = [p for p in m["curve"] if p["time_s"] is not None]
        if not pts:
            continue
        style = "--" if m["name"] in TORCH_HOOKS else "-"
        left.plot([p["time_s"] for p in pts], [p["accuracy"] for p in pts], style, marker=".", label=m["name"])
        wpts = [p for p in pts if p["wire_bytes"]]
        right.plot([p["wire_bytes"] for p in wpts], [p["accuracy"] for p in wpts], style, marker=".",
                   label=m["name"])
    for ax in (left, right):
        ax.axhline(results["target_accuracy"], color="grey", lw=0.8, ls=":")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    left.set_xlabel("wall time since the first step (s)")
    right.set_xlabel("wire bytes, all ranks (log)")
    right.set_xscale("log")
    left.legend(fontsize=8)
    fig.suptitle(f"2 nodes over {results['bandwidth']} ({results['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: dict[str, Any], out: Path, label: str) -> list[Path]:
    from jobs._report import _write_atomic

    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out / f"e2e-{label}.{ext}" for ext in ("json", "md", "png"))
    compact = json.loads(json.dumps(results))
    _write_atomic(json_path, json.dumps(compact, indent=2, allow_nan=False) + "\n")
    _write_atomic(md_path, render_markdown(results))
    try:
        plot(results, png_path)
    except Exception as error:  # noqa: BLE001 - the numbers matter more than the plot
        print(f"e2e: plot failed: {error}", file=sys.stderr)
    return [json_path, md_path, png_path]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "--driver":
        from jobs import (
            bench_e2e,  # not __main__: the callback must pickle as jobs.bench_e2e.EvalLog
        )

        return bench_e2e.driver(argv[1])
    from jobs.bench import main as bench_main

    return bench_main(["e2e", *argv])


if __name__ == "__main__":
    sys.exit(main())

