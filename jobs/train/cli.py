"""Train with adaptive gradient compression as a Ray Train job.

    python -m jobs.train --config jobs/configs/fashion_mnist.yaml [--output DIR] [key=value ...]
    ray job submit --working-dir . -- python -m jobs.train --config jobs/configs/digits.yaml

Runs on the cluster in ``RAY_ADDRESS`` if set, else on an embedded local Ray. The config
is validated (and the data checked) before Ray is touched: a bad config exits with code 2
and one line naming the key. The run writes ``summary.json``, ``plot.png``, per-rank step
logs and checkpoints into its output directory, printed at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import time
from pathlib import Path

from jobs.config import (
    ConfigError,
    JobConfig,
    check_metrics_endpoint,
    check_resources,
    check_writable_dir,
    load_config,
)
from jobs.train.driver import run

__all__ = ["EXIT_BAD_INPUT", "main", "parse_args", "prepare"]

EXIT_BAD_INPUT = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: built-in defaults)")
    parser.add_argument("--output", help="output directory (default: <run.storage_path>/<run id>)")
    parser.add_argument("--run-id", help="run id (default: <run.name>-<time>-<random>)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. compression.policy=static workload.epochs=2")
    return parser.parse_args(argv)


def prepare(argv: list[str] | None = None, schema: type[JobConfig] = JobConfig) -> tuple[JobConfig, str, Path]:
    """Everything that can fail on bad input, before any cluster resource is taken. The
    config is a ``schema``: :class:`JobConfig`, or the fault drill's ``jobs.faults.DrillConfig``."""
    args = parse_args(argv)
    config = load_config(args.config, args.overrides, schema)
    check_resources(config)
    run_id = args.run_id or f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    if not all(c.isalnum() or c in "-_." for c in run_id):
        raise ConfigError(f"--run-id: only letters, digits, '-', '_' and '.' are allowed, got {run_id!r}")
    # the directory the run writes into (summary, step logs, checkpoints): creatable/writable
    if args.output:
        output = check_writable_dir("--output", args.output)
    else:
        output = check_writable_dir("run.storage_path", config.run.storage_path) / run_id
        if output.exists() and not output.is_dir():
            raise ConfigError(f"--run-id: {str(output)!r} exists and is not a directory")
    c = config.controller
    if c.metrics_enabled and not os.environ.get("RAY_ADDRESS"):
        check_metrics_endpoint(c.metrics_host, c.metrics_port)  # the exporter binds it on this machine
    return config, run_id, output


def main(argv: list[str] | None = None, schema: type[JobConfig] = JobConfig) -> int:
    """The command: 0 when the run succeeded, 1 when it failed, 2 (one line) on bad input."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config, run_id, output = prepare(argv, schema)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from jobs.policy_report import intro, outcome

    print("\n".join(intro(config)), flush=True)  # the link the policy plans for
    summary = run(config, run_id, output)
    print("\n".join(outcome(summary)))  # what the policy chose, and why
    ratio = summary["compression_ratio"]
    metric = summary.get("final_eval_accuracy", summary.get("final_eval_loss"))
    print(f"run {run_id}: {summary['status']}, {summary['steps']} steps, eval {metric}, "
          f"compression ratio {ratio:.1f}x" if ratio else f"run {run_id}: {summary['status']}")
    print(f"output: {output}")
    return 0 if summary["status"] == "succeeded" else 1
