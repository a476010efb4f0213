"""Outage drill: training over the benchmark's 2-node link survives the link going dark.

Two network namespaces, one Ray node in each (:mod:`jobs.bench.cluster`), the ranks spread
over them so that every collective crosses the link. For each mode (per-step int4, and local
steps with H=4 and int4 pseudo-gradients) the digits job runs twice through
``python -m jobs.train``: once undisturbed, once with the link cut both ways for
``--seconds`` (15 by default) once rank 0 has logged ``--at-step``. The cut drops every
frame at both ends (:meth:`~jobs.bench.netns.ThrottledLink.blackout`); the next collective
waits out ``scaling.collective_timeout_s`` (8 s), the worker group fails, Ray Train starts a
new one (``checkpoint.max_failures``) once the link is back, and it resumes from the latest
step checkpoint (every 5 steps).

PASS for a mode when the cut run resumed from a checkpoint, logged every step once, and ends
with the same checkpoint as the undisturbed run, bit for bit: the shared weights and
optimizer, and each rank's error-feedback state, guard, random state and (local steps) its
own weights and optimizer; and the same final accuracy. Random packet loss is not drilled:
this kernel has no ``sch_netem`` and no traffic classifiers to drop a share of the frames with.

Output: ``--output`` (JSON, default ``<work-dir>/outage.json``) and a table on stdout; exit
status 0 only if every mode passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobs.bench.cluster import REPO, driver_env, ray_nodes
from jobs.bench.e2e.driver import read_jsonl
from jobs.bench.netns import ThrottledLink
from jobs.bench.report import eprint

__all__ = ["HELP", "MODES", "NAME", "add_arguments", "compare", "run"]

HELP = "a run in each mode survives the 2-node link cut for 15 s and ends bit for bit as an undisturbed one"
NAME = "outage"

#: what every run of the drill shares: the digits job, long enough to be cut mid-way, its
#: ranks on the two nodes, a step checkpoint every 5 steps, a short collective timeout and
#: worker-group restarts allowed
COMMON = ["compression.policy=static", "compression.warmup_steps=0", "workload.epochs=6",
          "scaling.placement_strategy=SPREAD", "checkpoint.every_steps=5", "checkpoint.max_failures=3"]
MODES: dict[str, list[str]] = {
    "per_step": ["compression.static.compressor={name: int4}"],
    "local": ["compression.local.mode=fixed", "compression.local.sync_every=4", "compression.local.compressor=int4"],
}
RUN_TIMEOUT_S = 900


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m jobs.bench outage``."""
    parser.add_argument("--link", default="100mbit", help="link rate each way in tc units, or 'fast'")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the link stays cut (default 15)")
    parser.add_argument("--at-step", type=int, default=25, help="cut once rank 0 has logged this step (default 25)")
    parser.add_argument("--collective-timeout", type=float, default=8.0,
                        help="scaling.collective_timeout_s of the runs (default 8; must be below --seconds)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--work-dir", default=None, help="run outputs (default: a new temporary directory)")
    parser.add_argument("--output", default=None, help="the JSON result (default <work-dir>/outage.json)")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"error: --modes: unknown {unknown or modes}; allowed: {', '.join(MODES)}")
    if args.collective_timeout >= args.seconds:
        raise SystemExit(f"error: --collective-timeout {args.collective_timeout} must be below --seconds "
                         f"{args.seconds}: a shorter cut would not fail a collective")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rc-outage-"))
    work.mkdir(parents=True, exist_ok=True)
    link = ThrottledLink(args.link)
    results: dict[str, Any] = {"command": "python -m jobs.bench " + " ".join(argv), "link": args.link,
                               "seconds": args.seconds, "at_step": args.at_step, "modes": {}}
    with link, ray_nodes(link, work) as address:
        for mode in modes:
            overrides = [*COMMON, *MODES[mode], f"scaling.collective_timeout_s={args.collective_timeout}"]
            reference = _train(link, address, work / f"{mode}-reference", overrides)
            cut = _train(link, address, work / f"{mode}-outage", overrides, cut=(args.at_step, args.seconds))
            results["modes"][mode] = {**compare(reference, cut), "overrides": overrides}
            eprint(f"outage {mode}: {'PASS' if results['modes'][mode]['pass'] else 'MISS'} "
                   f"{results['modes'][mode]['why']}")
    output = Path(args.output or work / "outage.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    print("| mode | cut at step | resumed from | steps | differences | result |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, r in results["modes"].items():
        print(f"| {mode} | {r['cut_at_step']} | {r['restored_from_step']} | {r['steps']} | "
              f"{len(r['differences'])} | {'PASS' if r['pass'] else 'MISS'}: {r['why']} |")
    return 0 if all(r["pass"] for r in results["modes"].values()) else 1


def _train(link: ThrottledLink, address: str, output: Path, overrides: list[str],
           cut: tuple[int, float] | None = None) -> dict[str, Any]:
    """One ``python -m jobs.train`` run in namespace a; with ``cut = (step, seconds)`` the link
    goes dark for ``seconds`` once rank 0 has logged ``step``."""
    argv = [sys.executable, "-m", "jobs.train", "--config", "jobs/configs/digits.yaml", "--output", str(output),
            "--run-id", f"outage-{output.name}-{os.urandom(3).hex()}", *overrides]
    output.parent.mkdir(parents=True, exist_ok=True)
    watcher = _Cutter(link, output / "steps" / "rank0.jsonl", *cut) if cut else None
    with open(output.parent / f"{output.name}.log", "w") as log:
        proc = link.popen("a", argv, env=driver_env(link, address), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        if watcher:
            watcher.start()
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if watcher:
                watcher.stop()
    summary_path = output / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": f"exit {code}"}
    return {"output": str(output), "exit_code": code, "summary": summary,
            "cut_at_step": watcher.cut_at_step if watcher else None, "cut_error": watcher.error if watcher else None}


class _Cutter(threading.Thread):
    """Cuts the link once the step log shows ``step``, gives it back ``seconds`` later."""

    def __init__(self, link: ThrottledLink, step_log: Path, step: int, seconds: float) -> None:
        super().__init__(daemon=True)
        self.link, self.step_log, self.step, self.seconds = link, step_log, step, seconds
        self.cut_at_step: int | None = None
        self.error: str | None = None
        self._done = threading.Event()

    def run(self) -> None:
        try:
            while not self._done.is_set():
                records = read_jsonl(self.step_log)
                if records and records[-1]["step"] >= self.step:
                    self.cut_at_step = records[-1]["step"]
                    self.link.blackout(True)
                    self._done.wait(self.seconds)
                    self.link.blackout(False)
                    return
                time.sleep(0.02)
        except Exception as error:  # noqa: BLE001 - reported in the result
            self.error = f"{type(error).__name__}: {error}"

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=self.seconds + 30)
        if self.link.blacked_out:
            self.link.blackout(False)


def compare(reference: dict[str, Any], cut: dict[str, Any]) -> dict[str, Any]:
    """PASS/MISS of one mode: the cut run resumed, logged every step once, and its last
    checkpoint equals the reference's bit for bit."""
    import torch

    ref, got = reference["summary"], cut["summary"]
    result: dict[str, Any] = {"cut_at_step": cut["cut_at_step"], "restored_from_step": got.get("restored_from_step"),
                              "steps": got.get("steps"), "final_eval_accuracy": got.get("final_eval_accuracy"),
                              "reference_final_eval_accuracy": ref.get("final_eval_accuracy"),
                              "differences": [], "pass": False}
    problems = []
    if ref.get("status") != "succeeded" or got.get("status") != "succeeded":
        problems.append(f"status {ref.get('status')} / {got.get('status')}")
    if cut["cut_error"] or cut["cut_at_step"] is None:
        problems.append(f"the link was not cut ({cut['cut_error'] or 'the run ended first'})")
    if not problems:
        if got.get("restored_from_step") is None:
            problems.append("no worker-group restart: the cut failed no collective")
        if got.get("steps") != ref.get("steps"):
            problems.append(f"steps {got.get('steps')} against {ref.get('steps')}")
        for rank_log in sorted((Path(cut["output"]) / "steps").glob("rank*.jsonl")):
            steps = [json.loads(line)["step"] for line in rank_log.read_text().splitlines()]
            if steps != list(range(ref.get("steps") or 0)):
                problems.append(f"{rank_log.name}: steps missing or repeated")
        a_dir, b_dir = (_latest_checkpoint(Path(r["output"])) for r in (reference, cut))
        for name in ["shared.pt", "rank0.pt", "rank1.pt"]:
            a, b = (torch.load(d / name, weights_only=False) for d in (a_dir, b_dir))
            if name != "shared.pt":  # counters of restarts and outages differ by design
                a, b = ({k: v for k, v in x.items() if k != "counters"} for x in (a, b))
            result["differences"] += [f"{name}:{p}" for p in _differences(a, b)]
        if result["differences"]:
            problems.append(f"{len(result['differences'])} differences, first {result['differences'][0]}")
        if got.get("final_eval_accuracy") != ref.get("final_eval_accuracy"):
            problems.append(f"accuracy {got.get('final_eval_accuracy')} against {ref.get('final_eval_accuracy')}")
    result["pass"] = not problems
    result["why"] = "; ".join(problems) if problems else (
        f"cut after step {cut['cut_at_step']}, resumed from step {got.get('restored_from_step')}, "
        f"{got.get('steps')} steps, the last checkpoint bit-identical")
    return result


def _latest_checkpoint(output: Path) -> Path:
    return sorted(p for p in output.glob("checkpoint_*") if p.is_dir())[-1]


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two saved states differ (tensors compared bit for bit)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path or "/"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}/keys"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}/len"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}/{i}")]
    return [] if a == b else [path or "/"]
