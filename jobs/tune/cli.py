"""``python -m jobs.tune``: parse, validate (exit 2 on bad input, one line), search, report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from jobs.config import ConfigError
from jobs.tune.objective import METRIC
from jobs.tune.results import report
from jobs.tune.search import search
from jobs.tune.spec import TuneSetup, load_tune_config

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "main", "parse_args", "prepare", "run"]

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # the package docstring's user part: its last paragraph maps the modules, for readers of the code
    usage = (sys.modules[__package__].__doc__ or "").partition("\nThe parts,")[0]
    parser = argparse.ArgumentParser(prog="python -m jobs.tune", description=usage,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="tune config YAML, e.g. jobs/configs/tune_digits.yaml")
    parser.add_argument("--output", help="output root (default: output_dir of the tune config)")
    parser.add_argument("--name", help="search name (default: name of the tune config)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="tune config overrides, e.g. num_samples=4 objective.byte_budget=5e7")
    return parser.parse_args(argv)


def prepare(argv: list[str] | None = None) -> TuneSetup:
    """Everything that can fail on bad input, before Ray is touched."""
    args = parse_args(argv)
    tuning = load_tune_config(args.config, args.overrides, args.output, args.name)
    saved = tuning.exp_dir / "tune_config.json"
    if saved.exists():
        try:
            before = json.loads(saved.read_text())
        except (OSError, ValueError):
            before = None
        if not (isinstance(before, dict) and isinstance(before.get("spec"), dict) and "base" in before):
            raise ConfigError(f"output: {str(saved)!r} is unreadable or not a tune config; use another "
                              "--name or --output, or delete that folder to start over")
        if before != json.loads(json.dumps(tuning.fingerprint())):
            changed = sorted(k for k in before["spec"] if before["spec"].get(k) != tuning.fingerprint()["spec"].get(k))
            if before["base"] != tuning.fingerprint()["base"]:
                changed.append("base config")
            raise ConfigError(
                f"output: {str(tuning.exp_dir)!r} holds a search with a different config "
                f"(changed: {', '.join(changed) or 'search space'}); use another --name or --output, "
                "or delete that folder to start over")
    return tuning


def run(tuning: TuneSetup) -> dict[str, Any]:
    import ray

    tuning.exp_dir.mkdir(parents=True, exist_ok=True)
    (tuning.exp_dir / "tune_config.json").write_text(json.dumps(tuning.fingerprint(), indent=2))
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address or "local", log_to_driver=True,
                 runtime_env=None if address else {"env_vars": {"PYTHONPATH": str(REPO)}})
    grid = search(tuning)
    return report(tuning, grid)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        tuning = prepare(argv)
        outputs = run(tuning)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    best = outputs["best"]
    print(f"search {tuning.spec.name}: {outputs['trials']} of {outputs['expected_trials']} trials")
    if not outputs["complete"]:
        print(f"search interrupted: partial results in {outputs['results_md']}; "
              "run the same command again to resume it")
        return EXIT_INTERRUPTED
    if best is None:
        print("no trial completed: no best config (see results.md)")
    else:
        print(f"best: trial {best['trial_id']} ({best['variant']}), {tuning.spec.objective.kind} "
              f"{best[METRIC]:.6g}, {tuning.metric_key.replace('_', ' ')} {best[tuning.metric_key]:.4f}, "
              f"wire bytes {best['wire_bytes']:.4g}")
        print(f"best config: {outputs['best_config']}")
    print(f"results: {outputs['results_md']} (+ results.csv)")
    print(f"pareto plot: {outputs['pareto_png']}")
    print(f"output: {tuning.exp_dir}")
    return 0 if best is not None else 1
