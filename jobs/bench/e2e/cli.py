"""End-to-end benchmark: time to target of 15 methods, 2 Ray nodes over a veth link.

Two network namespaces joined by a veth pair (:mod:`jobs.bench.netns`) each hold one Ray node
(:mod:`jobs.bench.cluster`) with one CPU: the head in ``a``, a worker node in ``b``. The driver runs inside ``a``. Each
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

Methods (:mod:`jobs.bench.e2e.methods`): ``dense`` (torch ``allreduce_hook``), ``torch_fp16``,
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
dense runs' median metric at the evaluation at 3/4 of the step budget. The goals
(:mod:`jobs.bench.e2e.goals`, a table) are judged on the medians over seeds.

Output: ``<output-dir>/e2e-<workload>-<link>.json``, ``.md`` and ``.png``; raw traces of every
run stay in ``--work-dir`` (``--reanalyze WORK_DIR`` rebuilds the reports from them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobs.bench.cluster import REPO, driver_env, measure_link, ray_nodes, ray_temp
from jobs.bench.e2e.analysis import analyze
from jobs.bench.e2e.methods import QUICK_METHODS, WORKLOADS, parse_methods
from jobs.bench.e2e.report import show, write_reports
from jobs.bench.netns import ThrottledLink, parse_rate, rate_label
from jobs.bench.report import command_line, eprint, machine_info

__all__ = ["HELP", "NAME", "add_arguments", "results_from", "run", "settings_from"]

HELP = "time to target of 15 methods over a 2-node link (network namespaces)"
NAME = "e2e"
DRIVER_TIMEOUT_S = {"quick": 1200, "full": 4 * 3600}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m jobs.bench e2e``."""
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


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a run depends on, from the command line (recorded in meta.json)."""
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


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Build the link and the cluster, run the driver in namespace a, write the reports
    (or only rebuild them with ``--reanalyze``); the exit status."""
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
            driver = link.popen("a", [sys.executable, "-m", "jobs.bench.e2e.driver", str(work / "spec.json")],
                                env=driver_env(link, address), cwd=REPO)
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
        eprint(f"e2e: {'PASS' if g['ok'] else 'MISS'} {g['goal']}: {g.get('note') or show(g['value'])}")
    return 0


def _write_meta(work: Path, settings: dict[str, Any], shaping: dict[str, Any], check: dict[str, Any],
                argv: Sequence[str], info: dict[str, Any], seconds: float | None,
                load_start: tuple[float, float, float]) -> dict[str, Any]:
    meta = {"settings": settings, "shaping": shaping, "check": check,
            "command": command_line("jobs.bench", argv), "machine": info, "benchmark_seconds": seconds,
            "load_average": {"start": list(load_start),
                             "end": None if seconds is None else list(os.getloadavg())}}
    (work / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def results_from(work: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The results of a run's work directory (``raw.json`` analysed, ``meta.json`` added)."""
    raw = json.loads((work / "raw.json").read_text())
    results = analyze(raw, meta["settings"], meta["shaping"], meta["check"])
    results.update({k: meta[k] for k in ("command", "machine", "benchmark_seconds", "load_average")},
                   work_dir=str(work))
    return results
