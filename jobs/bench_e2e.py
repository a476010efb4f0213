"""End-to-end benchmark: time to target of 15 methods, 2 Ray nodes over a veth link.

Two network namespaces joined by a veth pair (:mod:`jobs.netns`) each hold one Ray node
with one CPU: the head in ``a``, a worker node in ``b``. The driver runs inside ``a``. Each
training worker needs one CPU, so Ray Train places one on each node
(``scaling.placement_strategy=SPREAD`` too) and every gradient byte crosses the link; gloo
is bound to the veth of each node (``GLOO_SOCKET_IFNAME``). The link is ``--link 100mbit``
(``tbf`` on both ends) or ``--link fast`` (the bare veth).

One invocation = one workload x one link x ``--seeds``:

====================  ==================================================================
``gpt``               ``jobs/configs/gpt_kjv.yaml``: 3.2M-parameter char transformer on the
                      KJV, validation loss on 128 fixed held-out windows
``cnn``               ``jobs/configs/cnn_fashion.yaml``: 2.5M-parameter BatchNorm CNN on
                      Fashion-MNIST, accuracy on the first 2,000 test images
``mlp``               the old digits MLP (234,762 parameters): a smoke case
====================  ==================================================================

Methods (:data:`METHODS`): ``dense`` (torch ``allreduce_hook``), ``torch_fp16``,
``torch_bf16``, ``torch_powersgd_r1|r2|r4`` (torch's hooks), raycomp static ``topk`` (1%),
``dgc`` (sampled-threshold Top-0.1%), ``powersgd_r1|r2|r4``, ``sign``, ``int8``, ``int4``, and
``raycomp_adaptive`` (the shipped default ``compression.policy``, untuned).

Fairness: every method runs the same config file, seed, data order, LR schedule (over the
same step budget), evaluation cadence and validation set, and the same dense warm-up: raycomp's
first compressed plan is installed at step ``W`` (``compression.warmup_steps = W - K`` with
control interval ``K``: the plan decided at the boundary after warm-up reaches the ranks at the
next one; the step logs show where it really started and the report prints it), torch's
PowerSGD starts at ``start_powerSGD_iter = W`` and the fp16/bf16 hooks all-reduce fp32 for the
first ``W`` steps. torch's ``powerSGD_hook`` gets one DDP bucket (``bucket_cap_mb`` above the
model's fp32 size), which it needs on gloo; every other method gets the buckets raycomp's
hook gets (``compression.bucket_cap_mb``, "auto" by default: about 8 buckets), so that they
overlap communication with backward alike and the comparison is the hook's.

Time to target: training wall time (from the end of step 0; evaluation and report pauses
subtracted) at the first evaluation from which the target holds at two consecutive
evaluations; the median over seeds counts a seed that never got there as infinitely slow
(so the median is null when most seeds miss). ``--target auto`` (the default) takes the
dense runs' median metric at the evaluation at 3/4 of the step budget.

Output: ``<output-dir>/e2e-<workload>-<link>.json``, ``.md`` and ``.png``; raw traces of every
run stay in ``--work-dir`` (``--reanalyze WORK_DIR`` rebuilds the reports from them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HELP = "time to target of 15 methods over a 2-node link (network namespaces)"
NAME = "e2e"
REPO = Path(__file__).resolve().parents[1]

_STATIC_TOPK = "compression.static.compressor={name: topk, ratio: 0.01}"
#: method name -> config overrides (on top of the workload's config and the shared ones)
METHODS: dict[str, list[str]] = {
    "dense": ["compression.baseline_hook=torch_allreduce"],
    "torch_fp16": ["compression.baseline_hook=torch_fp16"],
    "torch_bf16": ["compression.baseline_hook=torch_bf16"],
    **{f"torch_powersgd_r{r}": ["compression.baseline_hook=torch_powersgd", f"compression.baseline_powersgd_rank={r}"]
       for r in (1, 2, 4)},
    "raycomp_topk": ["compression.policy=static", _STATIC_TOPK],
    "raycomp_dgc": ["compression.policy=static", "compression.static.compressor={name: dgc_topk, ratio: 0.001}"],
    **{f"raycomp_powersgd_r{r}": ["compression.policy=static", f"compression.static.compressor={{name: powersgd, rank: {r}}}"]
       for r in (1, 2, 4)},
    "raycomp_sign": ["compression.policy=static", "compression.static.compressor={name: sign}"],
    "raycomp_int8": ["compression.policy=static", "compression.static.compressor={name: int8}"],
    "raycomp_int4": ["compression.policy=static", "compression.static.compressor={name: int4}"],
    "raycomp_adaptive": [],  # the shipped default policy, untuned
}
#: torch baselines: which hook (for the byte model); raycomp's own plan stays dense and unused
TORCH_HOOKS = {"dense": "allreduce", "torch_fp16": "fp16", "torch_bf16": "bf16",
               **{f"torch_powersgd_r{r}": "powersgd" for r in (1, 2, 4)}}
TORCH_BASELINE_OVERRIDES = ["compression.policy=static", "compression.static.compressor={name: none}"]
#: ``--strategy fsdp`` (issue 14): FSDP2 runs, the same names for the same roles. dense and
#: torch_bf16 are FSDP's own reduce-scatter (fp32; ``MixedPrecisionPolicy(reduce_dtype=bf16)``,
#: which FSDP cannot switch on mid-run: bf16 from step 0, no dense warm-up); raycomp_* replace
#: it with the compressed all-to-all, adaptive choosing int8/bf16/dense per unit
FSDP_METHODS: dict[str, list[str]] = {
    "dense": ["compression.baseline_hook=torch_fsdp"],
    "torch_bf16": ["compression.baseline_hook=torch_fsdp_bf16"],
    "raycomp_bf16": ["compression.policy=static", "compression.static.compressor={name: bf16}"],
    "raycomp_int8": ["compression.policy=static", "compression.static.compressor={name: int8}"],
    "raycomp_adaptive": [],
}
#: FSDP's own reduce-scatter: the byte model's dtype (bytes per element)
FSDP_BASELINES = {"dense": 4, "torch_bf16": 2}
QUICK_METHODS = ["dense", "torch_powersgd_r2", "raycomp_topk", "raycomp_adaptive"]
FSDP_QUICK_METHODS = ["dense", "raycomp_int8", "raycomp_adaptive"]
COMPUTE = "compute_only"
#: the step without the network: both workers, DDP and the same buckets, torch's noop_hook in
#: place of any collective (each rank keeps its own gradient). One at the start of each seed's
#: group, so that a step is divided by a no-communication step of the same hour: one worker
#: alone (COMPUTE) has the machine's two cores, caches and memory to itself
NO_COMM = "no_comm"
REFERENCES = {COMPUTE: ["scaling.num_workers=1"], NO_COMM: ["compression.baseline_hook=torch_noop"]}

#: per workload: config file, step budget, eval cadence, dense warm-up W (first compressed
#: step), quick settings. Budgets: see the report's "Budget" line and docs in the configs.
WORKLOADS: dict[str, dict[str, Any]] = {
    "gpt": {"config": "jobs/configs/gpt_kjv.yaml", "full": {"steps": 160, "eval_every": 20},
            "quick": {"steps": 40, "eval_every": 10}, "warmup": 20},
    "cnn": {"config": "jobs/configs/cnn_fashion.yaml", "full": {"steps": 160, "eval_every": 20},
            "quick": {"steps": 40, "eval_every": 10}, "warmup": 20},
    # half the config's 400 steps: dense at 100 Mbit/s is ~0.4 s a step (4.4 MB fp32)
    "lstm": {"config": "jobs/configs/lstm_kjv.yaml", "full": {"steps": 200, "eval_every": 20},
             "quick": {"steps": 40, "eval_every": 10}, "warmup": 20},
    "mlp": {"config": "jobs/configs/digits.yaml",
            "overrides": ["workload.model_width=448", "workload.batch_size=32", "workload.lr=0.05",
                          "workload.momentum=0.9", "workload.lr_schedule=cosine"],
            "full": {"steps": 440, "eval_every": 22}, "quick": {"steps": 66, "eval_every": 22}, "warmup": 20},
}
COMMON = ["scaling.num_workers=2", "scaling.cpus_per_worker=1", "checkpoint.every_epochs=10000",
          "checkpoint.max_failures=0", "scaling.placement_strategy=SPREAD",
          "scaling.collective_timeout_s=120", "controller.metrics_enabled=false"]
TARGET_AT = 0.75  # --target auto: dense's median metric at the evaluation at this share of the budget
CONSECUTIVE = 2  # the target must hold at this many consecutive evaluations
DRIVER_TIMEOUT_S = {"quick": 1200, "full": 4 * 3600}

# goals (issue 12), checked on the medians over seeds
GOAL_VS_DENSE = 5.0
GOAL_VS_TORCH_POWERSGD = 1.5
GOAL_VS_BEST_STATIC = 1.05  # adaptive time <= 1.05 x the best non-adaptive method
GOAL_FINAL_METRIC = 0.01  # adaptive final metric within 1% of dense (not worse by more)
GOAL_NIC_RATIO = 50.0
GOAL_STEP_RATIO = 1.2
GOAL_CONTROL_SHARE = 0.01
GOAL_FAST_LINK = 1.05

ETH_OVERHEAD = 14 + 20 + 32  # Ethernet + IPv4 + TCP with timestamps, per segment
MSS = 1448

RAY_ENV = {
    "RAY_AUTH_MODE": "token",  # Ray >= 2.59 starts clusters with token auth (~/.ray/auth_token)
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "180",
    "OMP_NUM_THREADS": "1",
}


# --- arguments ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="gpt", choices=sorted(WORKLOADS),
                        help="gpt (KJV transformer, default), cnn (Fashion BatchNorm CNN), lstm (KJV character "
                             "LSTM, SGD), mlp (digits smoke)")
    parser.add_argument("--link", "--bandwidth", dest="link", default="100mbit",
                        help="link rate each way in tc units (default 100mbit), or 'fast' (unshaped veth)")
    parser.add_argument("--latency", default="0",
                        help="one-way delay added with netem when the kernel has it (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: 1 seed, {len(QUICK_METHODS)} methods, a few dozen steps")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; quick: 0)")
    parser.add_argument("--steps", type=int, default=None, help="step budget per run (default per workload)")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluation cadence in steps")
    parser.add_argument("--warmup", type=int, default=None,
                        help="dense warm-up: the step at which every method starts compressing")
    parser.add_argument("--target", default="auto",
                        help="target value of the validation metric, or 'auto' (dense's median at 3/4 "
                             "of the budget)")
    parser.add_argument("--stop-at-target", action="store_true",
                        help="let runs stop once the target held twice (workload.stop_at_target; needs "
                             "a fixed --target and a training loop that honours it)")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"],
                        help="ddp (default: DDP, the 15 methods) or fsdp (FSDP2: FSDP's own reduce-scatter "
                             "fp32/bf16 against raycomp's compressed one; reports fsdp-<workload>-<link>.*)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset, or 'all' (default: all; quick: "
                             f"{','.join(QUICK_METHODS)})")
    parser.add_argument("--output-dir", default="docs/benchmarks",
                        help="where e2e-<workload>-<link>.{json,md,png} go (default docs/benchmarks)")
    parser.add_argument("--work-dir", default=None,
                        help="run outputs and raw traces (default outputs/e2e/<workload>-<link>-<suffix>)")
    parser.add_argument("--reanalyze", metavar="WORK_DIR", default=None,
                        help="rebuild the reports from a finished run's raw traces (no training)")


def methods_of(strategy: str) -> dict[str, list[str]]:
    return FSDP_METHODS if strategy == "fsdp" else METHODS


def parse_methods(text: str | None, quick: bool, strategy: str = "ddp") -> list[str]:
    methods = methods_of(strategy)
    if text is None:
        return list((FSDP_QUICK_METHODS if strategy == "fsdp" else QUICK_METHODS) if quick else methods)
    if text.strip() == "all":
        return list(methods)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in methods]
    if unknown or not names:
        raise SystemExit(f"error: --methods: unknown {unknown or text!r}; allowed with --strategy {strategy}: "
                         f"{', '.join(methods)}")
    return [n for n in methods if n in names]


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a run depends on, from the command line (recorded in meta.json)."""
    from jobs.netns import parse_rate, rate_label

    mode = "quick" if args.quick else "full"
    spec = WORKLOADS[args.workload]
    steps = args.steps or spec[mode]["steps"]
    eval_every = args.eval_every or spec[mode]["eval_every"]
    if steps % eval_every:
        raise SystemExit(f"error: --steps {steps} must be a multiple of --eval-every {eval_every}")
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",") if s.strip()]
    target = None if str(args.target).lower() == "auto" else float(args.target)
    if args.stop_at_target and target is None:
        raise SystemExit("error: --stop-at-target needs a fixed --target (auto is known only after dense ran)")
    warmup = args.warmup if args.warmup is not None else spec["warmup"]
    if warmup < 2:
        raise SystemExit("error: --warmup must be >= 2 (torch's PowerSGD needs start_powerSGD_iter > 1)")
    return {"workload": args.workload, "config": spec["config"], "extra": spec.get("overrides", []),
            "mode": mode, "steps": steps, "eval_every": eval_every, "seeds": seeds, "target": target,
            "stop_at_target": bool(args.stop_at_target), "warmup": warmup,
            "methods": parse_methods(args.methods, args.quick, args.strategy), "strategy": args.strategy,
            "link": rate_label(parse_rate(args.link)), "idle_s": 3.0 if args.quick else 10.0,
            "link_check_s": 1.0 if args.quick else 2.0}


# --- the orchestrator (root namespace) --------------------------------------------------------
def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from jobs._report import eprint, machine_info

    if args.reanalyze:
        work = Path(args.reanalyze)
        meta = json.loads((work / "meta.json").read_text())
        results = results_from(work, meta)
        paths = write_reports(results, Path(args.output_dir))
        eprint(f"e2e: rebuilt {', '.join(map(str, paths))} from {work}")
        return 0
    settings = settings_from(args)
    if os.geteuid() != 0:
        eprint("e2e: needs root (network namespaces)")
        return 2
    started, info, load_start = time.time(), machine_info(1), os.getloadavg()
    try:
        return _run(args, argv, settings, started, info, load_start)
    except KeyboardInterrupt:
        eprint("e2e: interrupted; the namespaces, the veth pair and the Ray nodes are torn down")
        return 130


def _run(args: argparse.Namespace, argv: Sequence[str], settings: dict[str, Any], started: float,
         info: dict[str, Any], load_start: tuple[float, float, float]) -> int:
    from jobs._report import eprint
    from jobs.netns import ThrottledLink

    rate = None if settings["link"] == "fast" else args.link
    with ThrottledLink(rate, args.latency) as link:
        work = Path(args.work_dir or REPO / "outputs" / "e2e" /
                    f"{settings['workload']}-{settings['link']}-{link.suffix}").resolve()
        work.mkdir(parents=True, exist_ok=True)
        check = measure_link(link, settings["link_check_s"], work)
        with ray_nodes(link, work) as address:
            spec = {"settings": settings, "work": str(work), "dev": link.dev["a"], "address": address,
                    "netns_inodes": {s: os.stat(f"/run/netns/{link.ns[s]}").st_ino for s in ("a", "b")},
                    "ray_temp_a": str(ray_temp(link)["a"]), "addresses": dict(link.addr)}
            (work / "spec.json").write_text(json.dumps(spec, indent=2))
            # written now and again at the end: a run stopped early can still be re-analysed
            _write_meta(work, settings, link.shaping(), check, argv, info, None, load_start)
            driver = link.popen("a", [sys.executable, "-m", "jobs.bench_e2e", "--driver",
                                      str(work / "spec.json")], env=driver_env(link, address), cwd=REPO)
            timeout = DRIVER_TIMEOUT_S[settings["mode"]]
            try:
                code = driver.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                eprint(f"e2e: the driver ran past {timeout} s; stopped. Logs in {work}")
                return 1
            if code != 0:
                eprint(f"e2e: driver failed with exit code {code}; logs in {work}")
                return 1
            shaping = link.shaping()
    meta = _write_meta(work, settings, shaping, check, argv, info, time.time() - started, load_start)
    results = results_from(work, meta)
    paths = write_reports(results, Path(args.output_dir))
    eprint(f"e2e: wrote {', '.join(map(str, paths))} in {time.time() - started:.0f} s")
    for g in results["goals"]:
        eprint(f"e2e: {'PASS' if g['ok'] else 'MISS'} {g['goal']}: {g.get('note') or _f(g['value'])}")
    return 0


def _write_meta(work: Path, settings: dict[str, Any], shaping: dict[str, Any], check: dict[str, Any],
                argv: Sequence[str], info: dict[str, Any], seconds: float | None,
                load_start: tuple[float, float, float]) -> dict[str, Any]:
    from jobs._report import command_line

    meta = {"settings": settings, "shaping": shaping, "check": check,
            "command": command_line("jobs.bench", argv), "machine": info, "benchmark_seconds": seconds,
            "load_average": {"start": list(load_start),
                             "end": None if seconds is None else list(os.getloadavg())}}
    (work / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def results_from(work: Path, meta: dict[str, Any]) -> dict[str, Any]:
    raw = json.loads((work / "raw.json").read_text())
    results = analyze(raw, meta["settings"], meta["shaping"], meta["check"])
    results.update({k: meta[k] for k in ("command", "machine", "benchmark_seconds", "load_average")},
                   work_dir=str(work))
    return results


def _pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def measure_link(link: Any, seconds: float, work: Path, label: str = NAME) -> dict[str, Any]:
    """One bulk TCP flow each way and the round trip over ``link``, logged."""
    from jobs._report import eprint

    eprint(f"{label}: namespaces {link.ns_a} / {link.ns_b}, {link.shaping()['qdisc']['a']}, work {work}")
    check = {"a_to_b": link.measure_throughput(seconds, "a"), "b_to_a": link.measure_throughput(seconds, "b"),
             "rtt": link.measure_rtt(20)}
    eprint(f"{label}: link " + ", ".join(f"{k} {v['bits_per_s'] / 1e6:.1f} Mbit/s"
                                       for k, v in check.items() if "bits_per_s" in v)
           + f", rtt {check['rtt']['median_s'] * 1e6:.0f} us")
    return check


def ray_temp(link: Any) -> dict[str, Path]:
    return {side: Path(f"/tmp/rcb-{link.suffix}-{side}") for side in ("a", "b")}


@contextlib.contextmanager
def ray_nodes(link: Any, work: Path) -> Iterator[str]:
    """A Ray head (namespace a) and a worker node (b), one CPU each, for the body; yields the
    GCS address. On the way out the link and both nodes are torn down and Ray's logs are kept
    in ``work/ray-logs-{a,b}``."""
    temp = ray_temp(link)
    try:
        yield f"{link.addr_a}:{start_cluster(link, temp, work)}"
    finally:
        link.close()
        for side, path in temp.items():  # keep Ray's logs with the run outputs
            logs = path / "session_latest" / "logs"
            if logs.is_dir():
                shutil.copytree(logs, work / f"ray-logs-{side}", dirs_exist_ok=True,
                                ignore_dangling_symlinks=True)
            shutil.rmtree(path, ignore_errors=True)


def driver_env(link: Any, address: str) -> dict[str, str]:
    """The environment of a driver run in namespace a against :func:`ray_nodes`' cluster."""
    return {**os.environ, **RAY_ENV, "PYTHONPATH": _pythonpath(), "RAY_ADDRESS": address,
            "GLOO_SOCKET_IFNAME": link.dev["a"]}


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
        _wait_for(log_path, "Ray runtime started", proc, timeout=240)
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


def method_overrides(name: str, settings: dict[str, Any], seed: int, interval: int,
                     bucket_cap_mb: float) -> list[str]:
    """Config overrides of one run (on top of the workload's config file)."""
    steps, every, warmup = settings["steps"], settings["eval_every"], settings["warmup"]
    # the epoch is the evaluation cadence, so a loop that evaluates once per epoch evaluates at
    # the same steps as one that honours workload.eval_every_steps
    overrides = [*settings["extra"], *COMMON, f"run.seed={seed}", f"workload.steps_per_epoch={every}",
                 f"workload.epochs={steps // every}", f"workload.eval_every_steps={every}",
                 f"compression.warmup_steps={max(0, warmup - interval)}",
                 f"compression.baseline_warmup_steps={warmup}",
                 f"compression.baseline_powersgd_start_iter={warmup}"]
    if settings["stop_at_target"] and settings["target"] is not None and name not in REFERENCES:
        overrides += [f"workload.stop_at_target={settings['target']}", f"workload.stop_consecutive={CONSECUTIVE}"]
    if name == COMPUTE:  # one worker, no DDP, no communication; raycomp's plan stays dense
        return [*overrides, *REFERENCES[COMPUTE], *TORCH_BASELINE_OVERRIDES,
                f"compression.warmup_steps={10 * steps}"]
    if name == NO_COMM:
        return [*overrides, *REFERENCES[NO_COMM], *TORCH_BASELINE_OVERRIDES]
    if settings.get("strategy") == "fsdp":
        overrides += ["scaling.strategy=fsdp", *FSDP_METHODS[name]]
        if name in FSDP_BASELINES:
            overrides += TORCH_BASELINE_OVERRIDES
        return overrides
    overrides += METHODS[name]
    if name in TORCH_HOOKS:
        overrides += TORCH_BASELINE_OVERRIDES
    if name.startswith("torch_powersgd"):  # one DDP bucket: powerSGD_hook on gloo needs it
        overrides.append(f"compression.baseline_bucket_cap_mb={bucket_cap_mb}")
    return overrides


def _policy_default() -> str:
    from raycomp.config import CompressionSection

    return CompressionSection.model_fields["policy"].default


def driver(spec_path: str) -> int:
    """Inside namespace a: every seed x method on the 2-node cluster; writes raw.json."""
    import logging

    import ray

    from jobs import train
    from jobs.baselines import one_bucket_cap_mb
    from jobs.config import load_config
    from jobs.workloads import build
    from raycomp.buckets import ddp_kwargs

    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(Path(spec_path).read_text())
    work, settings = Path(spec["work"]), spec["settings"]
    inodes = {k: int(v) for k, v in spec["netns_inodes"].items()}
    ray.init(address=spec["address"], log_to_driver=False)
    deadline = time.time() + 180
    while sum(n["Alive"] for n in ray.nodes()) < 2:
        if time.time() > deadline:
            raise RuntimeError(f"the worker node never joined: {ray.nodes()}")
        time.sleep(0.5)
    config_file = str(REPO / settings["config"])
    base = load_config(config_file, [*settings["extra"], f"compression.policy={_policy_default()}"])
    workload = build(base.workload, 0, 2, 0)
    layers = {n: list(p.shape) for n, p in workload.model.named_parameters() if p.requires_grad}
    cap = one_bucket_cap_mb(workload.model)
    raw: dict[str, Any] = {"spec": spec, "layers": layers, "metric": workload.metric,
                           "interval_steps": base.controller.interval_steps, "bucket_cap_mb": cap,
                           "ddp_bucket_cap_mb": ddp_kwargs(base.compression, workload.model).get("bucket_cap_mb"),  # None: DDP's default
                           "default_policy": _policy_default(), "runs": [], "idle": []}
    del workload
    controller_pid = None
    references = [NO_COMM] if settings.get("strategy", "ddp") == "ddp" else []  # FSDP gathers parameters
    plan = [(COMPUTE, settings["seeds"][0])] + [(m, s) for s in settings["seeds"]
                                                for m in [*references, *settings["methods"]]]
    for name, seed in plan:  # seed-major: a drift in machine load hits every method alike
        overrides = method_overrides(name, settings, seed, base.controller.interval_steps, cap)
        if name == "raycomp_adaptive" or name == COMPUTE:
            overrides.append(f"compression.policy={_policy_default()}")  # a config file may pin one
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
            "evals": read_jsonl(output / "evals.jsonl"),
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
    raw["idle"].append(_idle(NicSampler(spec["dev"]), settings["idle_s"]))
    (work / "raw.json").write_text(json.dumps(raw))
    ray.shutdown()
    return 0


def read_jsonl(path: Path) -> list[dict[str, Any]]:
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


# --- analysis (pure: raw traces -> results) ---------------------------------------------------
def meets(value: float | None, target: float, lower_is_better: bool) -> bool:
    """Whether an evaluation meets the target (equality counts)."""
    if value is None or not math.isfinite(value):
        return False
    return value <= target if lower_is_better else value >= target


def target_index(values: Sequence[float | None], target: float, lower_is_better: bool,
                 consecutive: int = CONSECUTIVE) -> int | None:
    """Index of the first evaluation from which the target holds at ``consecutive``
    consecutive evaluations (that one included); None if it never does. A hit at the last
    evaluation(s) without enough evaluations after it is not confirmed: None."""
    run = 0
    for i, value in enumerate(values):
        run = run + 1 if meets(value, target, lower_is_better) else 0
        if run == consecutive:
            return i - consecutive + 1
    return None


def eval_series(evals: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """Evaluations sorted by step, one per step (the first), steps > 0, with the metric."""
    key, seen, out = f"eval_{metric}", set(), []
    for ev in sorted(evals, key=lambda e: (int(e.get("step", 0)), e.get("time", 0))):
        step = int(ev.get("step", 0))
        if step <= 0 or step in seen or ev.get(key) is None:
            continue
        seen.add(step)
        out.append({"step": step, "value": float(ev[key]), "time": ev.get("time")})
    return out


def training_clock(steps: list[dict[str, Any]], eval_steps: Sequence[int],
                   window: int = 5) -> dict[int, float]:
    """Step count -> training seconds, evaluation pauses taken out.

    ``steps`` are step records (``step``, ``time`` = when the step ended). A run that has done
    ``s`` steps did so at record ``s - 1``'s time; the clock starts at the end of step 0. An
    evaluation after ``s`` steps (and the report that goes with it) sits in the gap between
    records ``s - 1`` and ``s``: its pause is that gap minus the median of the ``window``
    gaps before it. Returns ``{s: seconds}`` for every ``s`` with a record ``s - 1``.
    """
    times = {int(r["step"]): float(r["time"]) for r in steps if r.get("time") is not None}
    if 0 not in times:
        return {}
    ordered = sorted(times)
    gaps = {s: times[s] - times[s - 1] for s in ordered if s - 1 in times}
    evals = set(eval_steps)
    paused, clock = 0.0, {}
    for s in ordered:
        if s in evals and s in gaps:
            before = [gaps[j] for j in range(s - window, s) if j in gaps and j not in evals]
            paused += max(0.0, gaps[s] - statistics.median(before)) if before else 0.0
        clock[s + 1] = times[s] - times[0] - paused
    return clock


def steady_step_s(steps: list[dict[str, Any]], eval_steps: Sequence[int], start: int) -> tuple[float | None, int]:
    """Mean seconds per step over the gaps from step ``start`` on, evaluation gaps excluded
    (control boundaries included: they are part of the cost of a step)."""
    times = {int(r["step"]): float(r["time"]) for r in steps if r.get("time") is not None}
    evals = set(eval_steps)
    gaps = [times[s] - times[s - 1] for s in sorted(times) if s >= max(start, 1) and s - 1 in times
            and s not in evals]
    return (sum(gaps) / len(gaps) if gaps else None), len(gaps)


def first_compressed_step(steps: list[dict[str, Any]]) -> int | None:
    """The first step whose wire bytes grew less than its dense bytes (from the ledger)."""
    prev_w, prev_d = 0.0, 0.0
    for r in sorted(steps, key=lambda r: r["step"]):
        w, d = float(r.get("wire_bytes") or 0), float(r.get("dense_bytes") or 0)
        if d - prev_d > 0 and (w - prev_w) < 0.99 * (d - prev_d):
            return int(r["step"])
        prev_w, prev_d = w, d
    return None


def median_with_misses(values: Sequence[float | None]) -> float | None:
    """Median where None (a miss) counts as +infinity; None when the median is a miss."""
    if not values:
        return None
    keyed = sorted(math.inf if v is None else float(v) for v in values)
    n = len(keyed)
    mid = keyed[n // 2] if n % 2 else (keyed[n // 2 - 1] + keyed[n // 2]) / 2
    return None if math.isinf(mid) else mid


def spread(values: Sequence[float | None]) -> list[float | None]:
    """[min, max] over seeds; max is None if any seed missed."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return [None, None]
    return [min(got), None if len(got) < len(values) else max(got)]


def _median(values: Sequence[float | None]) -> float | None:
    got = [float(v) for v in values if v is not None]
    return statistics.median(got) if got else None


def torch_hook_bytes(hook: str, layers: dict[str, list[int]], world: int, steps: int,
                     rank: int = 2, start_iter: int = 0, min_compression_rate: float = 2.0) -> list[float]:
    """Bytes one rank transmits per step under torch's hook (ring all-reduce model); dense
    fp32 before ``start_iter`` (PowerSGD's start, the casts' warm-up)."""
    factor = 2 * (world - 1) / world
    numel = sum(math.prod(s) for s in layers.values())
    dense = factor * 4 * numel
    if hook == "allreduce":
        return [dense] * steps
    if hook in ("fp16", "bf16"):
        return [dense if step < start_iter else factor * 2 * numel for step in range(steps)]
    compressed = 0
    for shape in layers.values():  # powerSGD_hook: tensor.view(shape[0], -1); 1-D go dense
        n = shape[0]
        m = math.prod(shape) // n
        r = min(n, m, rank)
        if len(shape) > 1 and (n + m) * r * min_compression_rate < n * m:
            compressed += (n + m) * r
        else:
            compressed += n * m
    return [dense if step < start_iter else factor * 4 * compressed for step in range(steps)]


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
        (tx0, rx0), (tx1, rx1) = _interp(run["nic"], times[0]), _interp(run["nic"], times[-1])
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
    value = _median(values)
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
        "final_metric": _median([r["final_metric"] for r in per_seed]),
        "final_metric_seeds": [r["final_metric"] for r in per_seed],
        "wire_bytes": _median([r["wire_bytes"] for r in per_seed]),
        "dense_bytes": _median([r["dense_bytes"] for r in per_seed]),
        "nic_bytes": _median([r["nic_bytes"] for r in per_seed]),
        "nic_bytes_per_step": _median([r["nic_bytes_per_step"] for r in per_seed]),
        "step_s": _median([r["step_s"] for r in per_seed]),
        "control_share": _median([r["control_share"] for r in per_seed]),
        "first_compressed_step_seeds": [r["first_compressed_step"] for r in per_seed],
        "status_seeds": [r["status"] for r in per_seed],
        "errors": [r["error"] for r in per_seed if r["error"]],
        "steps_seeds": [r["steps"] for r in per_seed],
        "runs": per_seed,
    }


def analyze(raw: dict[str, Any], settings: dict[str, Any], shaping: dict[str, Any],
            check: dict[str, Any]) -> dict[str, Any]:
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
        m["step_vs_no_comm"] = _median([r["step_s"] / no_comm[r["seed"]] for r in m["runs"]
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
        "no_comm_step_s": _median(list(no_comm.values())),
        "no_comm_step_s_seeds": {str(k): v for k, v in no_comm.items()},
        "methods": methods,
        "mode": settings["mode"], "strategy": settings.get("strategy", "ddp"),
        "controller": raw.get("controller"),
    }
    results["goals"] = goals(results)
    return results


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def warmup_ceilings(results: dict[str, Any], dense: dict[str, Any]) -> dict[str, float | None]:
    """The best ratios against dense that any method could reach under this benchmark's rules.

    Every method runs the same dense warm-up (steps 0 to ``warmup - 1``), so it pays dense's
    bytes and dense's step time there, whatever it does afterwards. With communication free
    from then on:

    * ``nic``: dense's NIC bytes over the window the benchmark counts (steps 1 to the last)
      divided by the warm-up's share of them: ``(steps - 1) / (warmup - 1)``;
    * ``vs_dense``: dense's time to target divided by the time of a run that reaches the target
      at dense's (median) step, paying dense's step time in the warm-up and only the
      no-communication step after it (the compute-only step in a report without one).

    None where the results lack a number it needs. A goal above its ceiling cannot pass by
    any change of policy: only a shorter warm-up, a longer budget or a looser target could.
    """
    wl = results.get("workload", {})
    steps, warmup = wl.get("steps"), wl.get("warmup_steps")
    nic = (steps - 1) / (warmup - 1) if steps and warmup and warmup > 1 else None
    hit = median_with_misses(dense.get("steps_to_target_seeds") or [])
    ttt, dense_step = dense.get("time_to_target_s"), dense.get("step_s")
    compute = results.get("no_comm_step_s") or results.get("compute_step_s")
    vs_dense = None
    if None not in (hit, ttt, dense_step, compute, warmup) and hit >= warmup:
        vs_dense = ttt / ((warmup - 1) * dense_step + (hit - warmup + 1) * compute)
    return {"nic": nic, "vs_dense": vs_dense}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """PASS/MISS of issue 12's targets on the medians over seeds (a missing number is a MISS)."""
    by = {m["name"]: m for m in results["methods"]}
    ada = by.get("raycomp_adaptive")
    if not ada:
        return []
    t = ada["time_to_target_s"]
    others = [m for m in results["methods"] if m["name"] != "raycomp_adaptive"]
    best = min((m for m in others if m["time_to_target_s"] is not None),
               key=lambda m: m["time_to_target_s"], default=None)
    out: list[dict[str, Any]] = []

    def goal(text: str, value: float | None, ok: bool, note: str | None = None,
             ceiling: float | None = None) -> None:
        """``note``: why a goal without a number is judged anyway (else no number is a MISS);
        ``ceiling``: the best value the benchmark's rules allow (:func:`warmup_ceilings`)."""
        out.append({"goal": text, "value": value, "ok": bool(ok and (value is not None or note)),
                    **({"note": note} if note else {}), **({"ceiling": ceiling} if ceiling is not None else {})})

    best_name = f" ({best['name']})" if best else ""
    if results.get("strategy") == "fsdp":  # issue 14: dense FSDP's target, fewer bytes on the NIC
        dense = by.get("dense") or {}
        value = _ratio(dense.get("time_to_target_s"), t)
        goal("FSDP: adaptive reaches the target dense FSDP reaches (speed-up vs dense)", value, value is not None)
        ratio = _ratio(dense.get("nic_bytes_per_step"), ada["nic_bytes_per_step"])
        goal("FSDP: adaptive NIC bytes per step fewer than dense FSDP's (ratio)", ratio,
             ratio is not None and ratio > 1)
        value = _ratio(t, best["time_to_target_s"] if best else None)
        goal(f"FSDP: adaptive time to target not slower than the best other method{best_name} (ratio)",
             value, value is not None and value <= 1.0)
        return out
    if results["link"]["rate"] == "fast":
        value = _ratio(t, best["time_to_target_s"] if best else None)
        goal(f"fast link: adaptive time to target within {GOAL_FAST_LINK - 1:.0%} of the fastest other "
             f"method{best_name} (ratio)", value, value is not None and value <= GOAL_FAST_LINK)
        return out
    dense = by.get("dense") or {}

    def final_metric_goal() -> None:
        lower = results["target"]["lower_is_better"]
        rel = None
        if ada["final_metric"] is not None and dense.get("final_metric"):
            rel = (ada["final_metric"] - dense["final_metric"]) / abs(dense["final_metric"])
            rel = rel if lower else -rel  # > 0: adaptive is worse
        goal(f"adaptive final validation {results['target']['metric']} within {GOAL_FINAL_METRIC:.0%} of dense "
             "(relative, > 0 = worse)", rel, rel is not None and rel <= GOAL_FINAL_METRIC)

    if results["workload"]["name"] != "gpt":
        value = _ratio(t, best["time_to_target_s"] if best else None)
        goal(f"adaptive time to target not slower than the best non-adaptive method{best_name} (ratio)",
             value, value is not None and value <= 1.0)
        if dense:  # what compression cost in accuracy, where dense ran beside it
            final_metric_goal()
        return out
    ceilings = warmup_ceilings(results, dense)
    speed = _ratio(dense.get("time_to_target_s"), t)
    goal(f"adaptive time to target >= {GOAL_VS_DENSE:g}x faster than dense", speed,
         speed is not None and speed >= GOAL_VS_DENSE, ceiling=ceilings["vs_dense"])
    ranks = [by[n]["time_to_target_s"] for n in by if n.startswith("torch_powersgd")]
    psgd = [v for v in ranks if v is not None]
    speed = _ratio(min(psgd), t) if psgd else None
    text = f"adaptive time to target >= {GOAL_VS_TORCH_POWERSGD:g}x faster than the best torch powerSGD rank"
    if ranks and not psgd and t is not None:  # a miss counts as infinitely slow, as in the medians
        goal(text, None, True, note=f"none of the {len(ranks)} torch powerSGD ranks run reached the target "
                                    "within the step budget; adaptive did")
    else:
        goal(text, speed, speed is not None and speed >= GOAL_VS_TORCH_POWERSGD)
    value = _ratio(t, best["time_to_target_s"] if best else None)
    goal(f"adaptive time to target <= {GOAL_VS_BEST_STATIC:g}x the best static method of any kind{best_name}",
         value, value is not None and value <= GOAL_VS_BEST_STATIC)
    final_metric_goal()
    ratio = _ratio(dense.get("nic_bytes_per_step"), ada["nic_bytes_per_step"])
    goal(f"whole-run NIC bytes (per step) >= {GOAL_NIC_RATIO:g}x fewer than dense", ratio,
         ratio is not None and ratio >= GOAL_NIC_RATIO, ceiling=ceilings["nic"])
    if results.get("no_comm_step_s"):
        ratio = ada.get("step_vs_no_comm")
        text = "the step without communication (2 workers, torch's noop_hook; each seed's own)"
    else:  # a report from before the no-communication runs
        ratio, text = _ratio(ada["step_s"], results["compute_step_s"]), "the compute-only step"
    goal(f"adaptive steady step time <= {GOAL_STEP_RATIO:g}x {text}", ratio,
         ratio is not None and ratio <= GOAL_STEP_RATIO)
    share = ada["control_share"]
    goal(f"adaptive control share <= {GOAL_CONTROL_SHARE:.0%}", share, share is not None and share <= GOAL_CONTROL_SHARE)
    return out


# --- reports ----------------------------------------------------------------------------------
def _f(value: Any, fmt: str = "{:.2f}", none: str = "—") -> str:
    return none if value is None else fmt.format(value)


def _seeds(values: Sequence[Any], fmt: str = "{:.1f}") -> str:
    return " / ".join("miss" if v is None else fmt.format(v) for v in values)


def report_stem(results: dict[str, Any]) -> str:
    prefix = "fsdp" if results.get("strategy") == "fsdp" else "e2e"
    return f"{prefix}-{results['workload']['name']}-{results['link']['rate']}"


def modeled(results: dict[str, Any], name: str) -> bool:
    """Whether ``name``'s wire bytes come from a byte model (torch's hooks, FSDP's own)."""
    return name in (FSDP_BASELINES if results.get("strategy") == "fsdp" else TORCH_HOOKS)


def _fsdp_setup(wl: dict[str, Any]) -> list[str]:
    return [
        "- Strategy **FSDP2** (`scaling.strategy=fsdp`): `fully_shard` on every transformer block, then the "
        "root; parameters are all-gathered fp32 in forward and backward by every method alike (FSDP's default "
        "`reshard_after_forward=True`): only the gradients' reduce-scatter differs.",
        "- `dense`: FSDP's own fp32 reduce-scatter (gloo runs it as an all-reduce: twice the bytes of the "
        "ideal reduce-scatter that the wire column models); `torch_bf16`: FSDP's "
        "`MixedPrecisionPolicy(reduce_dtype=bf16)`, which cannot be switched on mid-run, so it casts from step "
        "0 (no dense warm-up); `raycomp_*`: raycomp's compressed all-to-all per unit, dense (fp32 rows) until "
        f"step {wl['warmup_steps']}, then bf16 / int8 / the adaptive policy (int4, int8, bf16 or dense per unit).",
        "- Compute-only step: 1 worker without FSDP (FSDP at one worker adds local copies, no communication).",
    ]


def render_markdown(results: dict[str, Any]) -> str:
    from jobs._report import machine_markdown, markdown_table

    wl, link, target = results["workload"], results["link"], results["target"]
    methods = results["methods"]
    dense = next((m for m in methods if m["name"] == "dense"), {})
    dense_t = dense.get("time_to_target_s")
    compute = results["compute_step_s"]
    metric = target["metric"]
    mfmt = "{:.4f}"
    table = markdown_table(
        ["method", "time to target s (median)", "per seed", "vs dense", "steps to target", f"final {metric}",
         "wire bytes", "NIC bytes", "NIC B/step", "step ms", "step / compute", "step / no-comm",
         "control share", "compressed from"],
        [[m["name"], _f(m["time_to_target_s"], "{:.1f}"), _seeds(m["time_to_target_s_seeds"]),
          _f(_ratio(dense_t, m["time_to_target_s"]), "{:.2f}x"), _seeds(m["steps_to_target_seeds"], "{}"),
          _f(m["final_metric"], mfmt), _f(m["wire_bytes"], "{:,.0f}") + ("*" if modeled(results, m["name"]) else ""),
          _f(m["nic_bytes"], "{:,.0f}"), _f(m["nic_bytes_per_step"], "{:,.0f}"),
          _f(m["step_s"] * 1e3 if m["step_s"] else None, "{:.0f}"),
          _f(_ratio(m["step_s"], compute), "{:.2f}x"),
          _f(m.get("step_vs_no_comm"), "{:.2f}x"),
          _f(m["control_share"] * 100 if m["control_share"] is not None else None, "{:.1f}%"),
          _seeds(m["first_compressed_step_seeds"], "{}").replace("miss", "never")] for m in methods],
        align="lllrlrrrrrrrrl",
    )
    failures = [f"- {m['name']}: {e}" for m in methods for e in m["errors"]]
    load = results.get("load_average") or {}
    requested = results.get("seeds_requested") or results["seeds"]
    measured = link["measured_mbit_s"]
    check = link["check"]
    parts = [
        f"# {'FSDP end-to-end' if results.get('strategy') == 'fsdp' else 'End-to-end'} benchmark: {wl['name']} "
        f"over a {link['rate']} link, {len(results['seeds'])} seed{'' if len(results['seeds']) == 1 else 's'}",
        "",
        f"Generated by `jobs/bench_e2e.py`; every number in `{report_stem(results)}.json`, curves in "
        f"`{report_stem(results)}.png`.",
        "",
        "## Command",
        "",
        f"```\n{results.get('command', '')}\n```",
        "",
        *([f"**Stopped early: {len(results['seeds'])} of the {len(requested)} requested seeds "
            f"({', '.join(map(str, requested))}) ran**; the medians below are over those.", ""]
          if len(results["seeds"]) < len(requested) else []),
        f"Mode **{results['mode']}**; the whole benchmark took {_f(results.get('benchmark_seconds'), '{:.0f}')} s "
        f"(load average {_f((load.get('start') or [None])[0], '{:.1f}')} at the start, "
        f"{_f((load.get('end') or [None])[0], '{:.1f}')} at the end).",
        "",
        "## Machine",
        "",
        machine_markdown(results.get("machine") or {}),
        "",
        "## Set-up",
        "",
        f"- Workload `{wl['config']}`: {wl['parameters']:,} parameters ({wl['parameters'] * 4 / 1e6:.1f} MB fp32), "
        f"2 workers (one per Ray node, one thread each), {wl['steps']} steps for every method, validation "
        f"{metric} on the fixed validation set every {wl['eval_every_steps']} steps, seeds "
        f"{', '.join(map(str, results['seeds']))}; same data order, LR schedule and step budget for all.",
        f"- Link: {link['shaping']['qdisc'].get('a')} on each veth end; measured (one bulk TCP flow each way) "
        f"{_f(check.get('a_to_b', {}).get('bits_per_s', 0) / 1e6, '{:.1f}')} / "
        f"{_f(check.get('b_to_a', {}).get('bits_per_s', 0) / 1e6, '{:.1f}')} Mbit/s of payload "
        f"(min {_f(measured, '{:.1f}')}), TCP round trip median {_f(check.get('rtt', {}).get('median_s', 0) * 1e6, '{:.0f}')} µs.",
        *(_fsdp_setup(wl) if results.get("strategy") == "fsdp" else [
            f"- Dense warm-up: every method starts compressing at step {wl['warmup_steps']} (raycomp: "
            f"`compression.warmup_steps` = {wl['warmup_steps']} - control interval; torch PowerSGD: "
            f"`start_powerSGD_iter`; fp16/bf16: fp32 all-reduce first). *compressed from* shows where each "
            "raycomp run really started (first step whose ledger bytes fell below dense).",
            f"- torch PowerSGD: one DDP bucket (`bucket_cap_mb={wl['torch_powersgd_bucket_cap_mb']}`, above the "
            "model's fp32 size; with several buckets `powerSGD_hook` aborts or hangs on gloo). Other methods: "
            + (f"the same DDP buckets, `bucket_cap_mb={wl['ddp_bucket_cap_mb']}` (`compression.bucket_cap_mb`), so "
               "they overlap communication with backward alike." if wl.get("ddp_bucket_cap_mb") is not None
               else "DDP's default buckets.")]),
        f"- `raycomp_adaptive` = the shipped default policy (`{wl['adaptive_policy']}`), untuned.",
        f"- Target: validation {metric} {'<=' if target['lower_is_better'] else '>='} "
        f"**{_f(target['value'], mfmt)}** ({target['source']}). Time to target: training wall time from the "
        f"end of step 0, evaluation/report pauses subtracted, at the first evaluation from which the target "
        f"holds at {target['consecutive']} consecutive evaluations; median over seeds with a miss counted as "
        "infinitely slow (— when most seeds missed).",
        f"- Compute-only step (1 worker, no DDP, same per-worker batch, same loop): "
        f"**{_f(compute * 1e3 if compute else None, '{:.0f}')} ms**.",
        *(["- Step without communication (both workers, DDP with the same buckets, torch's `noop_hook` in place "
           "of every collective, so each rank keeps its own gradient; one run before each seed's methods, and "
           "`step / no-comm` divides each seed's step by its own): **"
           + " / ".join(f"{v * 1e3:.0f}" for v in results["no_comm_step_s_seeds"].values())
           + " ms** (seeds " + ", ".join(results["no_comm_step_s_seeds"]) + "). The compute-only worker "
           "has the machine to itself; two workers share its cores, caches and memory even without a network."]
          if results.get("no_comm_step_s_seeds") else []),
        ("- Wire bytes: all ranks, raycomp's ledger (the gradients' reduce-scatter only); * = FSDP's own, byte "
         "model of an ideal reduce-scatter ((N-1)/N x payload). NIC bytes:" if results.get("strategy") == "fsdp" else
         "- Wire bytes: all ranks, raycomp's ledger; * = torch hooks, byte model of the hook (ring all-reduce "
         "2(N-1)/N x payload). NIC bytes:")
        + " veth tx+rx in namespace a from the end of step 0 to the last step, "
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
        *[f"- {g['goal']}: **{g.get('note') or _f(g['value'], '{:.3f}')}** — **{'PASS' if g['ok'] else 'MISS'}**"
          + (f" (ceiling under this benchmark's shared dense warm-up: {g['ceiling']:.2f}x)"
             if g.get("ceiling") is not None else "")
          for g in results["goals"]],
        "",
    ]
    if failures:
        parts += ["## Failed runs", "", *failures, ""]
    return "\n".join(parts)


def plot(results: dict[str, Any], path: Path) -> None:
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
    fig.suptitle(f"{results['workload']['name']} over {results['link']['rate']} ({results['mode']}, "
                 f"{len(results['seeds'])} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: dict[str, Any], out: Path) -> list[Path]:
    from jobs._report import _write_atomic

    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out / f"{report_stem(results)}.{ext}" for ext in ("json", "md", "png"))
    _write_atomic(json_path, json.dumps(results, indent=2, allow_nan=False) + "\n")
    _write_atomic(md_path, render_markdown(results))
    try:
        plot(results, png_path)
    except Exception as error:  # noqa: BLE001 - the numbers matter more than the plot
        print(f"e2e: plot failed: {error}", file=sys.stderr)
    return [json_path, md_path, png_path]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "--driver":
        from jobs import bench_e2e  # not __main__: pickled callbacks resolve as jobs.bench_e2e

        return bench_e2e.driver(argv[1])
    from jobs.bench import main as bench_main

    return bench_main(["e2e", *argv])


if __name__ == "__main__":
    sys.exit(main())
