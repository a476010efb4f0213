"""End-to-end benchmark: time to target of every method, Ray nodes over shaped links.

Two network namespaces joined by a veth pair (:mod:`jobs.bench.netns`) each hold one Ray node
(:mod:`jobs.bench.cluster`) with one CPU: the head in ``a``, a worker node in ``b``. The driver runs inside ``a``. Each
training worker needs one CPU, so Ray Train places one on each node
(``scaling.placement_strategy=SPREAD`` too) and every gradient byte crosses the link; gloo
is bound to the veth of each node (``GLOO_SOCKET_IFNAME``). The link is ``--link 100mbit``
(``tbf`` on both ends) or ``--link fast`` (the bare veth).

One invocation = one workload x one link x ``--seeds``:

====================  ==================================================================
``gpt``               ``jobs/configs/gpt_kjv.yaml``: 3.2M-parameter char transformer on the
                      KJV (AdamW), validation loss on 128 fixed held-out windows
``cnn``               ``jobs/configs/cnn_fashion.yaml``: 2.5M-parameter BatchNorm CNN on
                      Fashion-MNIST (SGD), accuracy on the first 2,000 test images
``lstm``              ``jobs/configs/lstm_kjv.yaml``: character LSTM on the KJV (SGD)
``mlp``               the old digits MLP (234,762 parameters): a smoke case
====================  ==================================================================

Methods (:mod:`jobs.bench.e2e.methods`). The default run: ``dense`` (torch ``allreduce_hook``),
``torch_bf16``, torch's PowerSGD at the workload's best rank (``torch_powersgd_r4``),
``raycomp_int4``, the local-step family -- ``torch_postlocalsgd`` (torch's post-local SGD),
``torchft_diloco`` (torchft's DiLoCo; when torchft is installed), ``raycomp_local`` (raycomp's
local steps, ``compression.local.mode=fixed``), each a grid over H in {4, 8, 16} run at the
workload's best H where an earlier run of the whole grid found it (``WORKLOADS[...]["best_h"]``,
as the PowerSGD rank), else at every H -- and ``raycomp_adaptive`` (the shipped default with
``compression.local.mode=auto``, nothing else tuned; ``raycomp_adaptive_per_step`` runs it with
local steps off, the library's own default, when named). A grid's name in ``--methods`` runs
every H; a grid is reported under its name with its best H. ``raycomp_dense``
(raycomp's hook and controller on a static dense plan) runs when named; what the path costs
a step where it compresses nothing is measured more finely, in alternating blocks within
one fit, by ``python -m jobs.bench overhead``. ``--all-methods`` adds torch's
fp16 hook and PowerSGD r1/r2, and raycomp's static Top-K, DGC, PowerSGD, sign and int8: the
per-step lossy ones never reach an AdamW target.

Rules: every method runs the same config file, seed, data order, LR schedule (over the same
``--steps`` budget, default 320), evaluation cadence and validation set. No shared warm-up:
each method warms up as its authors recommend, and the warm-up counts in its time (torch
PowerSGD's ``start_powerSGD_iter``: 10% of the budget; post-local SGD's ``start_localSGD_iter``:
about as much, aligned so that evaluations see averaged weights (31 of 320); torch's casts and torchft's DiLoCo: none; raycomp: its own config). torch's
``powerSGD_hook`` gets one DDP bucket (``bucket_cap_mb`` above the model's fp32 size), which
it needs on gloo; every other DDP method gets the buckets raycomp's hook gets
(``compression.bucket_cap_mb``, "auto": about 8 buckets).

Target: ``--target auto`` (the default) is dense's median validation metric at a fixed step
(``--target-step``, default 3/4 of the budget): dense runs first on every seed, its whole
budget; every other run then stops once the target held at two consecutive evaluations
(``workload.stop_at_target``). A fixed ``--target`` stops dense too. Time to target: training
wall time (from the end of step 0; evaluation and report pauses subtracted) at the first of
those two evaluations; the median over seeds counts a seed that never got there as infinitely
slow (so the median is null when most seeds miss). Beside every ratio the report puts the
physical limit, ``compute_bound_time_to_target_s``: dense's steps to target x the step
without communication (torch's ``noop_hook``, each seed's own run). The goals
(:mod:`jobs.bench.e2e.goals`, a table) are judged on the medians over seeds.

Topology (``--topology KxL``, :mod:`jobs.bench.e2e.topology`): ``2x1`` (the default) is the
two-node veth link above; ``4x1``, ``2x2`` and the like are K Ray nodes of L workers behind a
switch, each node's link shaped both ways, the workers of one node meeting over its loopback.

Output: ``<output-dir>/e2e-<workload>-<link>.json`` (``e2e-<workload>-<KxL>-<link>`` for
another topology), ``.md`` and ``.png``; raw traces of every
run stay in ``--work-dir`` (``--reanalyze WORK_DIR`` rebuilds the reports from them; several
directories merge the phases of one benchmark, :mod:`jobs.bench.e2e.merge`).
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

from jobs.bench.cluster import REPO, driver_env, head, measure_link, ray_nodes, ray_temp
from jobs.bench.e2e.analysis import analyze
from jobs.bench.e2e.merge import merge_work
from jobs.bench.e2e.methods import (
    DEFAULT_BUDGET,
    GRIDS,
    QUICK_METHODS,
    WORKLOADS,
    grid_setting,
    parse_methods,
)
from jobs.bench.e2e.report import show, write_reports
from jobs.bench.e2e.topology import FLAT, check_switch, parse_topology
from jobs.bench.netns import parse_rate, rate_label
from jobs.bench.report import command_line, eprint, machine_info

__all__ = ["HELP", "NAME", "add_arguments", "results_from", "run", "settings_from"]

HELP = "time to target of dense, torch, local-step and raycomp methods over shaped links between Ray nodes (network namespaces)"
NAME = "e2e"
DRIVER_TIMEOUT_S = {"quick": 1200, "full": 4 * 3600}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m jobs.bench e2e``."""
    parser.add_argument("--workload", default="gpt", choices=sorted(WORKLOADS),
                        help="gpt (KJV transformer, default), cnn (Fashion BatchNorm CNN), lstm (KJV character "
                             "LSTM, SGD), mlp (digits smoke)")
    parser.add_argument("--link", "--bandwidth", dest="link", default="100mbit",
                        help="link rate each way in tc units (default 100mbit), or 'fast' (unshaped veth)")
    parser.add_argument("--topology", default="2x1",
                        help="KxL: K Ray nodes of L workers each (default 2x1, the two-node veth link; any other "
                             "shape is a switch of K nodes, each node's link shaped, e.g. 4x1 or 2x2)")
    parser.add_argument("--latency", default="0",
                        help="one-way delay added with netem when the kernel has it (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: 1 seed, {', '.join(QUICK_METHODS)}, 64 steps")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; quick: 0)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"step budget of every run, the LR schedule's length (default {DEFAULT_BUDGET}; "
                             "320-480 suits the shipped workloads; quick: 64)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="evaluation cadence in steps (default 16; every grid's H must divide it)")
    parser.add_argument("--target", default="auto",
                        help="target value of the validation metric (every run, dense too, stops once it "
                             "held twice), or 'auto' (default): dense's median at --target-step")
    parser.add_argument("--target-step", type=int, default=None,
                        help="--target auto: the step of dense's curve that sets the target (default: 3/4 "
                             "of the budget)")
    parser.add_argument("--localsgd-start", type=int, default=None,
                        help="torch post-local SGD's warm-up W, the DDP steps before local SGD (default: "
                             "about 10%% of the budget, W + 1 a multiple of 16: 31 of 320)")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"],
                        help="ddp (default) or fsdp (FSDP2: FSDP's own reduce-scatter fp32/bf16 against "
                             "raycomp's compressed one; reports fsdp-<workload>-<link>.*)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset (a grid's name, e.g. torch_postlocalsgd, runs all its "
                             "settings), or 'all' (default: the methods that matter, each local-step grid at the "
                             "workload's best H; quick: "
                             f"{','.join(QUICK_METHODS)})")
    parser.add_argument("--all-methods", action="store_true",
                        help="every method, the per-step lossy ones that never reach an AdamW target included")
    parser.add_argument("--output-dir", default="docs/benchmarks",
                        help="where e2e-<workload>-<link>.{json,md,png} go (default docs/benchmarks)")
    parser.add_argument("--work-dir", default=None,
                        help="run outputs and raw traces (default outputs/e2e/<workload>-<link>-<suffix>)")
    parser.add_argument("--reanalyze", metavar="WORK_DIR", nargs="+", default=None,
                        help="rebuild the reports from a finished run's raw traces (no training); several "
                             "directories: the phases of one benchmark merged (same workload, budget, link, target)")


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a run depends on, from the command line (recorded in meta.json)."""
    mode = "quick" if args.quick else "full"
    spec = WORKLOADS[args.workload]
    steps = args.steps or (spec["quick"]["steps"] if args.quick else spec.get("steps", DEFAULT_BUDGET))
    eval_every = args.eval_every or (spec["quick"]["eval_every"] if args.quick else spec["eval_every"])
    if steps < 2 * eval_every or steps % eval_every:
        raise SystemExit(f"error: --steps {steps} must be a multiple of --eval-every {eval_every}, at least two "
                         "evaluations")
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",") if s.strip()]
    target = None if str(args.target).lower() == "auto" else float(args.target)
    if args.target_step is not None and not 0 < args.target_step <= steps:
        raise SystemExit(f"error: --target-step must be in 1..{steps} (the budget), got {args.target_step}")
    if args.localsgd_start is not None and not 0 <= args.localsgd_start < steps:
        raise SystemExit(f"error: --localsgd-start must be in 0..{steps - 1}, got {args.localsgd_start}")
    try:
        topology = parse_topology(args.topology)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    methods = parse_methods(args.methods, args.quick, args.strategy, args.workload, args.all_methods)
    periods = sorted({grid_setting(m) for grid in GRIDS.values() for m in grid if m in methods})
    if any(eval_every % h for h in periods):
        raise SystemExit(f"error: --eval-every {eval_every} must be a multiple of every local-step H run "
                         f"({', '.join(map(str, periods))}), so that evaluations see synced weights")
    averaged = [grid_setting(m) for m in methods if m in GRIDS["torch_postlocalsgd"]]
    if args.localsgd_start is not None and any((args.localsgd_start + 1) % h for h in averaged):
        raise SystemExit(f"error: --localsgd-start {args.localsgd_start}: W + 1 must be a multiple of every post-local "
                         f"SGD period run ({', '.join(map(str, averaged))}): torch's averager first averages after "
                         "step W + 1, and evaluations must see averaged weights")
    return {"workload": args.workload, "config": spec["config"], "extra": spec.get("overrides", []),
            "mode": mode, "steps": steps, "eval_every": eval_every, "seeds": seeds, "target": target,
            "target_step": args.target_step, "localsgd_start": args.localsgd_start,
            "methods": methods, "strategy": args.strategy, "topology": topology.label,
            "workers": topology.workers,
            "link": rate_label(parse_rate(args.link)), "idle_s": 3.0 if args.quick else 10.0,
            "link_check_s": 1.0 if args.quick else 2.0}


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Build the link and the cluster, run the driver in namespace a, write the reports
    (or only rebuild them with ``--reanalyze``); the exit status."""
    if args.reanalyze:
        works = [Path(w) for w in args.reanalyze]
        try:
            raw, meta = merge_work(works)
        except (ValueError, FileNotFoundError) as error:
            eprint(f"e2e: --reanalyze: {error}")
            return 2
        results = analyzed(raw, meta, ", ".join(map(str, works)))
        paths = write_reports(results, Path(args.output_dir))
        eprint(f"e2e: rebuilt {', '.join(map(str, paths))} from {', '.join(map(str, works))}")
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
    topology = parse_topology(settings["topology"])
    try:
        network = topology.network(rate, args.latency)
    except ValueError as error:
        eprint(f"e2e: {error}")
        return 2
    with network as link:
        tag = "" if topology.label == FLAT else f"{topology.label}-"
        work = Path(args.work_dir or REPO / "outputs" / "e2e" /
                    f"{settings['workload']}-{tag}{settings['link']}-{link.suffix}").resolve()
        work.mkdir(parents=True, exist_ok=True)
        check = (measure_link(link, settings["link_check_s"], work) if topology.label == FLAT
                 else check_switch(link, settings["link_check_s"]))
        first = head(link)
        with ray_nodes(link, work, cpus=topology.per_node) as address:
            spec = {"settings": settings, "work": str(work), "dev": link.dev[first], "address": address,
                    "nodes": topology.nodes,
                    "netns_inodes": {str(s): os.stat(f"/run/netns/{ns}").st_ino for s, ns in link.ns.items()},
                    "ray_temp_a": str(ray_temp(link)[first]),
                    "addresses": {str(s): a for s, a in link.addr.items()}}
            (work / "spec.json").write_text(json.dumps(spec, indent=2))
            # written now and again at the end: a run stopped early can still be re-analysed
            _write_meta(work, settings, link.shaping(), check, argv, info, None, load_start)
            driver = link.popen(first, [sys.executable, "-m", "jobs.bench.e2e.driver", str(work / "spec.json")],
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
    return analyzed(json.loads((work / "raw.json").read_text()), meta, str(work))


def analyzed(raw: dict[str, Any], meta: dict[str, Any], work_dir: str) -> dict[str, Any]:
    results = analyze(raw, meta["settings"], meta["shaping"], meta["check"])
    results.update({k: meta[k] for k in ("command", "machine", "benchmark_seconds", "load_average")},
                   work_dir=work_dir)
    return results
