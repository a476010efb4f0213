"""A Ray Tune search of compression schedules over the end-to-end benchmark's link.

    python -m jobs.bench tune --config jobs/configs/tune_gpt.yaml --link 100mbit

The search is ``python -m jobs.tune`` unchanged (same tune config, same trials, same
outputs), run as the driver of the two-node cluster of ``jobs.bench e2e``
(:mod:`jobs.bench.cluster`): a Ray head in namespace ``a`` and a worker node in ``b``, one
CPU each, joined by a veth pair shaped with ``tbf`` (``--link 100mbit``) or bare
(``--link fast``). Each trial's two workers land one per node (the tune config asks for
``scaling.placement_strategy=SPREAD``), so every gradient byte crosses the link and a
``time_to_target`` objective measures what a user on that link would see. Trials run one at
a time (two one-CPU workers on two CPUs).

Writes ``<output-dir>/tune-<search name>-<link>.{md,json,png}``: the search's table, the
untuned adaptive default against the best searched schedule and dense, the Pareto plot. The
search's own outputs (``results.*``, ``best_config.yaml``, every trial's run) stay in
``--work-dir``/search.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobs.bench.cluster import REPO, driver_env, measure_link, ray_nodes
from jobs.bench.netns import ThrottledLink, parse_rate, rate_label
from jobs.bench.report import command_line, eprint, machine_info

__all__ = ["HELP", "NAME", "add_arguments", "compare", "read_rows", "render_markdown", "run", "write_report"]

HELP = "a Ray Tune search of compression schedules over a 2-node link (network namespaces)"
NAME = "tune"
DRIVER_TIMEOUT_S = 4 * 3600
NUMBER = re.compile(r"-?(\d+(\.\d*)?([eE][-+]?\d+)?|nan|inf)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m jobs.bench tune``."""
    parser.add_argument("--config", default="jobs/configs/tune_gpt.yaml", help="tune config (jobs.tune)")
    parser.add_argument("--link", "--bandwidth", default="100mbit",
                        help="link rate each way in tc units (default 100mbit), or 'fast' (unshaped veth)")
    parser.add_argument("--latency", default="0", help="one-way delay added with netem (default 0)")
    parser.add_argument("--output-dir", default="docs/benchmarks", help="where the report goes")
    parser.add_argument("--work-dir", default=None,
                        help="the search's outputs and Ray's logs (default outputs/tune-bench/<name>-<link>)")
    parser.add_argument("--reanalyze", metavar="WORK_DIR", default=None,
                        help="rebuild the report from a finished search's work dir (no search)")
    parser.add_argument("overrides", nargs="*", help="tune config overrides, as for jobs.tune")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Build the link and the cluster, run ``jobs.tune`` as the driver in namespace a, write the
    report (or only rebuild it with ``--reanalyze``); the exit status."""
    import os

    from jobs.config import ConfigError
    from jobs.tune import load_tune_config

    if args.reanalyze:
        work = Path(args.reanalyze)
        meta = json.loads((work / "meta.json").read_text())
        paths = write_report(work / "search" / meta["name"], meta, Path(args.output_dir), meta["stem"])
        eprint(f"tune: rebuilt {', '.join(map(str, paths))} from {work}")
        return 0
    link_name = "fast" if args.link == "fast" else rate_label(parse_rate(args.link))
    try:  # bad input ends here, before any namespace or Ray node exists
        probe = load_tune_config(args.config, list(args.overrides), output=str(Path("/tmp") / "rc-tune-probe"))
    except ConfigError as error:
        eprint(f"error: {error}")
        return 2
    name = probe.spec.name
    shutil.rmtree(Path("/tmp") / "rc-tune-probe", ignore_errors=True)
    if os.geteuid() != 0:
        eprint("tune: needs root (network namespaces)")
        return 2
    work = Path(args.work_dir or REPO / "outputs" / "tune-bench" / f"{name}-{link_name}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    started, info = time.time(), machine_info(1)
    with ThrottledLink(None if args.link == "fast" else args.link, args.latency) as link:
        check = measure_link(link, 2.0, work, NAME)
        with ray_nodes(link, work) as address:
            argv_driver = [sys.executable, "-m", "jobs.tune", "--config", str(Path(args.config).resolve()),
                           "--output", str(work / "search"), *args.overrides]
            with open(work / "driver.log", "w") as log:
                driver = link.popen("a", argv_driver, env=driver_env(link, address), cwd=REPO,
                                    stdout=log, stderr=subprocess.STDOUT)
                try:
                    code = driver.wait(timeout=DRIVER_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    driver.kill()
                    eprint(f"tune: the search ran past {DRIVER_TIMEOUT_S} s; stopped. Logs in {work}")
                    return 1
            shaping = link.shaping()
    eprint(f"tune: the search exited with code {code} after {time.time() - started:.0f} s; log {work / 'driver.log'}")
    outputs_path = work / "search" / name / "outputs.json"
    if not outputs_path.exists():
        return 1
    meta = {"command": command_line("jobs.bench", argv), "machine": info, "link": link_name,
            "check": check, "shaping": shaping, "seconds": time.time() - started, "exit_code": code,
            "name": name, "stem": f"tune-{name}-{link_name}"}
    (work / "meta.json").write_text(json.dumps(meta, indent=2))
    paths = write_report(work / "search" / name, meta, Path(args.output_dir), meta["stem"])
    eprint(f"tune: wrote {', '.join(map(str, paths))}")
    return 0 if code == 0 else 1


def read_rows(exp: Path) -> list[dict[str, Any]]:
    """The search's table (``results.csv``), numbers parsed, best first."""
    import csv

    def value(text: str) -> Any:
        if text == "":
            return None
        if NUMBER.fullmatch(text):  # not int(): it reads trial id 10248_00001 as 1024800001
            return float(text) if any(c in text for c in ".eE") or text in ("nan", "inf") else int(text)
        return {"True": True, "False": False}.get(text, text)

    with (exp / "results.csv").open() as handle:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The untuned default, dense and the best searched schedule (rows are best first)."""
    def first(variant: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["variant"] == variant and r["status"] == "completed"), None)

    default, dense, best = first("default"), first("dense"), first("search")
    ratio = (default["objective"] / best["objective"]
             if default and best and default.get("reached_target") and best.get("reached_target") else None)
    winner = next((r for r in rows if r["status"] == "completed"), None)  # jobs.tune's ranking
    return {"default": default, "dense": dense, "best_searched": best, "default_over_best": ratio,
            "best_variant": winner["variant"] if winner else None}


def write_report(exp: Path, meta: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """Write ``<stem>.json``, ``.md`` and ``.png`` into ``out`` from the search directory ``exp``;
    the paths."""
    tune_config = json.loads((exp / "tune_config.json").read_text())
    rows = read_rows(exp)
    result = {**meta, "name": exp.name, "tune_config": tune_config, "comparison": compare(rows), "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps(result, indent=2, default=str) + "\n")
    paths[1].write_text(render_markdown(result, (exp / "results.md").read_text(), stem))
    shutil.copyfile(exp / "pareto.png", paths[2])
    return paths


def _row(label: str, row: dict[str, Any] | None, metric: str) -> str:
    if row is None:
        return f"| {label} | did not complete | | | |"
    reached = {True: "yes", False: "no (projected)"}.get(row.get("reached_target"), "(budget)")
    return (f"| {label} (`{row['trial_id']}`) | {row['objective']:.4g} | {reached} | {row[metric]:.4f} "
            f"| {row['wire_bytes']:.4g} |")


def render_markdown(result: dict[str, Any], table: str, stem: str) -> str:
    """The markdown report: set-up, the untuned default against the best searched schedule, every trial."""
    from jobs.tune import ObjectiveSection

    spec = result["tune_config"]["spec"]
    objective = spec["objective"]
    section = ObjectiveSection.model_validate(objective)
    metric = f"eval_{section.metric}"
    goal = (f"byte budget {section.byte_budget:.4g}" if section.at_budget
            else f"target {section.metric} {section.target}")
    c = result["comparison"]
    check = result["check"]
    measured = min(check[k]["bits_per_s"] for k in ("a_to_b", "b_to_a") if "bits_per_s" in check[k]) / 1e6
    ratio = c["default_over_best"]
    machine = result["machine"]
    lines = [
        f"# Tune search over a {result['link']} link: {result['name']}",
        "",
        f"Generated by `jobs/bench/tune.py`; every number in `{stem}.json`, the plot in `{stem}.png`.",
        "",
        "## Command", "", "```", result["command"], "```", "",
        f"The whole search took {result['seconds']:.0f} s (exit code {result['exit_code']}); "
        f"{machine['cpu_model']}, {machine['logical_cores']} cores, torch {machine['torch']}, {machine['date_utc']}.",
        "",
        "## Set-up", "",
        f"- Two Ray nodes in network namespaces, one CPU each, joined by a veth pair "
        f"({result['link']}; measured {measured:.1f} Mbit/s of TCP payload each way, min). "
        "Every trial's two workers run one per node: the gradient crosses the link.",
        f"- Objective `{objective['kind']}` ({goal}), as `jobs.tune` scores it (docs/tune.md)"
        + (": the trial's seconds from the start of its Train run (worker start-up included, the same "
           "for every trial) to the first evaluation at the target; before it gets there, a projection."
           if section.kind == "time_to_target" else "."),
        f"- {spec['num_samples']} sampled trials plus the baselines {', '.join(spec['baselines'])}; ASHA "
        f"(grace {spec['asha']['grace_period']} epochs, reduction factor {spec['asha']['reduction_factor']}); "
        f"seed {spec['seed']}. `default` is the base config unchanged: the shipped adaptive policy, untuned.",
        "",
        "## Adaptive untuned against the best tuned schedule", "",
        f"| trial | objective ({section.mode}imise) | reached the target | {metric} | wire bytes |",
        "| --- | ---: | --- | ---: | ---: |",
        _row("default: adaptive, untuned", c["default"], metric),
        _row("best searched schedule", c["best_searched"], metric),
        _row("dense", c["dense"], metric),
        "",
        f"Best trial of the search (jobs.tune's ranking: completed, at the target, objective): "
        f"**{c['best_variant'] or 'none'}**. "
        + (f"Adaptive untuned / best searched: **{ratio:.2f}x** the {section.kind.split('_')[0]} to target."
           if ratio is not None else "No ratio: it compares two trials that reached the target."),
        "",
        "## Every trial (the search's results.md)", "",
        *table.splitlines()[2:],
        "",
    ]
    return "\n".join(lines)
