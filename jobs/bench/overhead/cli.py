"""``python -m jobs.bench overhead``: what the ``raycomp.train`` step costs where it compresses
nothing, against plain DDP (or on a bf16 plan, against torch's bf16 hook), on a model whose
step is well under 100 ms.

One Ray Train fit on this machine's local Ray (2 workers, one thread each, loopback: a fast
link). Each worker holds copies of the same small model (``--model cnn``:
``jobs.models.fashion_cnn``, 420k parameters, a batch of ``--batch`` Fashion-MNIST images
per worker; ``--model lstm``: ``jobs.models.char_lstm`` of width 128, ``--batch`` windows of
64 KJV characters): one wrapped by
``ray.train.torch.prepare_model`` and stepped as a user writes plain DDP (``backward``,
``optimizer.step``, ``zero_grad``), one by ``raycomp.train.prepare_model`` on a static dense
plan and stepped by ``raycomp.train.step`` (raycomp's hook, the guard, the controller link,
statistics, plan agreement after every boundary, the step log). A third copy, for reference,
carries raycomp's hook alone (``raycomp.CompressionState`` on a dense plan, raycomp's
buckets, no training loop) and is stepped as plain DDP. All see the same batches. They train
in blocks of ``--block`` steps, in turn (plain, hook, raycomp; then the reverse, so that no
side always goes first); a pair is one block of each. The result is the median over pairs of
raycomp's block time over plain DDP's: the hour's drift, which moves whole runs by 10-40% on
this machine, hits every side of a pair alike. The first ``--warmup-pairs`` pairs are not
counted.

Goal: the raycomp.train path on a dense plan costs no more than plain DDP, within noise:
median ratio <= 1.03. The report gives the spread of the ratios (their quartiles) beside it,
and how well the median is known (a 95% bootstrap interval over the pairs): whether 3% is
resolved.

``--plan bf16`` asks the same of a bf16 plan against torch's own ``bf16_compress_hook`` on
plain DDP (the reference side carries it; the hook-alone side and raycomp.train a static
bf16 plan). ``--workers`` (default 2) puts more workers on the same cores, where what each
step's codec, copies and collectives cost weighs more.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from jobs.bench.overhead.report import DESCRIPTIONS, write_report
from jobs.bench.overhead.summary import PLANS, step_places, summarize
from jobs.bench.overhead.worker import train_func
from jobs.bench.report import command_line, machine_info

__all__ = ["HELP", "MODELS", "add_arguments", "check", "run"]

HELP = "the raycomp.train step on a dense (or bf16) plan against plain DDP (or torch's bf16 hook), blocks in turn"
MODELS = tuple(DESCRIPTIONS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=40, help="block pairs counted (default 40)")
    parser.add_argument("--warmup-pairs", type=int, default=3, help="block pairs not counted (default 3)")
    parser.add_argument("--block", type=int, default=20, help="steps per block (default 20)")
    parser.add_argument("--batch", type=int, default=32, help="images per worker and step (default 32)")
    parser.add_argument("--bucket-cap-mb", default="auto",
                        help="raycomp's compression.bucket_cap_mb (default auto; plain DDP keeps torch's 25)")
    parser.add_argument("--dense-control", default=None, choices=("every_step", "at_boundaries"),
                        help="raycomp's controller.dense_control (default: the library's)")
    parser.add_argument("--model", default="cnn", help=f"the model: {', '.join(MODELS)} (default cnn)")
    parser.add_argument("--plan", default="dense", help=f"the plan: {', '.join(PLANS)} (default dense; bf16 "
                                                        "against torch's bf16 hook)")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers, one CPU each (default 2)")
    parser.add_argument("--output-dir", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--name", default=None, help="the report's file name (default overhead-<model>-loopback)")


def check(args: argparse.Namespace) -> None:
    """One line naming the option and what it allows, before Ray starts."""
    for name, low in (("pairs", 1), ("warmup_pairs", 0), ("block", 1), ("batch", 1), ("workers", 2)):
        if getattr(args, name) < low:
            raise SystemExit(f"overhead: --{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.model not in MODELS:
        raise SystemExit(f"overhead: --model must be one of {', '.join(MODELS)}, got {args.model!r}")
    if args.plan not in PLANS:
        raise SystemExit(f"overhead: --plan must be one of {', '.join(PLANS)}, got {args.plan!r}")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    check(args)
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raycomp.train
    from raycomp.config import ControllerSection

    default_control = ControllerSection().dense_control
    args.dense_control = args.dense_control or default_control
    started = time.time()
    storage = Path(tempfile.mkdtemp(prefix="raycomp-overhead-"))
    controller = f"overhead-{int(started)}"
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, args.workers), include_dashboard=False)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"controller": controller, "output_dir": str(storage / "run"), "block": args.block,
                           "batch": args.batch, "pairs": args.pairs, "warmup_pairs": args.warmup_pairs,
                           "bucket_cap_mb": args.bucket_cap_mb, "model": args.model,
                           "dense_control": args.dense_control, "plan": args.plan},
        scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="overhead", storage_path=str(storage),
                             callbacks=[raycomp.train.ControllerCallback(ControllerSection(
                                 name=controller, metrics_enabled=False))]))
    result = trainer.fit().return_value
    result["summary"] = summarize(result["rows"], args.block, args.plan)
    places = result.pop("places")
    log = Path(places.pop("steps_log"))
    if log.exists():
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        result["step_places"] = step_places(records, **places, skip=args.warmup_pairs * args.block)
    meta = {"command": command_line("jobs.bench", argv), "machine": machine_info(1),
            "seconds": time.time() - started, "batch": args.batch, "warmup_pairs": args.warmup_pairs,
            "bucket_cap_mb": args.bucket_cap_mb, "model": args.model, "dense_control": args.dense_control,
            "plan": args.plan, "workers": args.workers}
    other = "" if args.dense_control == default_control else "-" + args.dense_control.replace("_", "-")
    other += ("" if args.plan == "dense" else f"-{args.plan}") + ("" if args.workers == 2 else f"-w{args.workers}")
    default_name = f"overhead-{args.model}-loopback{other}"
    json_path, md_path = write_report(result, meta, args.output_dir, args.name or default_name)
    s = result["summary"]
    print(f"overhead: wrote {json_path}, {md_path}")
    print(f"overhead: {'PASS' if s['ok'] else 'MISS'} {s['goal']}: {s['ratio_median']:.3f} "
          f"(95% interval of the median {s['ratio_median_low']:.3f}-{s['ratio_median_high']:.3f}, "
          f"quartiles {s['ratio_q1']:.3f}-{s['ratio_q3']:.3f}; steps {s['plain_step_ms']:.1f} / "
          f"{s['raycomp_step_ms']:.1f} ms)")
    return 0
