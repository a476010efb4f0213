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
import copy
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from jobs.bench.report import (
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    write_atomic,
)

HELP = "the raycomp.train step on a dense (or bf16) plan against plain DDP (or torch's bf16 hook), blocks in turn"
GOAL = 1.03
MODELS = ("cnn", "lstm")
#: --plan: the compressor every side's plan holds, and the reference side it is measured against
PLANS = {"dense": ("none", "plain DDP"), "bf16": ("bf16", "torch's bf16 hook")}
#: what each --model trains, for the report
DESCRIPTIONS = {
    "cnn": "`jobs.models.fashion_cnn` (420k parameters), {batch} Fashion-MNIST images per worker and step, "
           "SGD with momentum",
    "lstm": "`jobs.models.char_lstm` (width 128, two layers), {batch} windows of 64 KJV characters per worker "
            "and step, SGD with momentum",
}


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


def train_func(config: dict[str, Any]) -> dict[str, Any]:
    import ray.train
    import ray.train.torch
    import torch
    from torch import nn

    import raycomp
    import raycomp.train
    from jobs.data import fashion_mnist, kjv_corpus
    from jobs.models import char_lstm, fashion_cnn, lm_loss
    from raycomp._internal.ddp.buckets import ddp_kwargs
    from raycomp.config import CompressionSection, ControllerSection

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    block, batch = config["block"], config["batch"]
    pairs = config["pairs"] + config["warmup_pairs"]
    if config["model"] == "lstm":
        corpus = kjv_corpus()

        def build() -> nn.Module:
            return char_lstm(len(corpus.vocab), d_model=128)

        def batches(start: int):
            for i in range(start, start + block):
                x, y = corpus.batch_at("train", 0, i, rank, world, batch, 64)
                yield x, y, len(y)

        def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lm_loss(model(x), y)
    else:
        train, _ = fashion_mnist()
        train_x, train_y = train.x, train.y
        per_step = batch * world

        def build() -> nn.Module:
            return fashion_cnn()

        def batches(start: int):
            for i in range(start, start + block):
                lo = (i * per_step) % (len(train_y) - per_step)
                x, y = train_x[lo + rank:lo + per_step:world], train_y[lo + rank:lo + per_step:world]
                yield x, y, len(y)

        def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(model(x), y)

    torch.manual_seed(0)
    plain_model = build()
    own_model, hook_model = copy.deepcopy(plain_model), copy.deepcopy(plain_model)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)
    own_opt = torch.optim.SGD(own_model.parameters(), lr=0.01, momentum=0.9)
    hook_opt = torch.optim.SGD(hook_model.parameters(), lr=0.01, momentum=0.9)
    plain = ray.train.torch.prepare_model(plain_model)
    compressor = PLANS[config["plan"]][0]
    if compressor == "bf16":  # torch's own cast hook: the reference side
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def casted(state, bucket):  # unannotated: DDP checks a hook's annotations (CUDA only for bf16)
            return default_hooks.bf16_compress_hook(state, bucket)

        plain.register_comm_hook(None, casted)
    options = raycomp.train.TrainOptions(
        compression=CompressionSection.model_validate(
            {"policy": "static", "warmup_steps": 0, "static": {"compressor": {"name": compressor}},
             "bucket_cap_mb": config["bucket_cap_mb"]}),
        controller=ControllerSection(name=config["controller"], metrics_enabled=False,
                                     dense_control=config["dense_control"]),
        output_dir=config["output_dir"], progress_every=0)
    own = raycomp.train.prepare_model(own_model, own_opt, options=options)
    loop = raycomp.train.current()
    # raycomp's hook alone, on raycomp's buckets: what the loop's control work comes on top of
    hook = ray.train.torch.prepare_model(hook_model, parallel_strategy_kwargs=ddp_kwargs(options.compression,
                                                                                          hook_model))
    hook_state = raycomp.CompressionState(hook, raycomp.Plan.uniform(compressor))
    hook.register_comm_hook(hook_state, raycomp.compression_hook)

    def ddp_block(model: nn.Module, optimizer: torch.optim.Optimizer, start: int) -> float:
        began = time.perf_counter()
        for x, y, _ in batches(start):
            loss_of(model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return time.perf_counter() - began

    def own_block(start: int) -> float:
        began = time.perf_counter()
        for x, y, samples in batches(start):
            loss = loss_of(own, x, y)
            loss.backward()
            raycomp.train.step(loss, samples=samples)
        return time.perf_counter() - began

    sides = {"plain_s": lambda start: ddp_block(plain, plain_opt, start),
             "hook_s": lambda start: ddp_block(hook, hook_opt, start), "raycomp_s": own_block}
    rows = []
    for _ in loop.epochs(1, pairs * block):
        for pair in range(pairs):
            order = list(sides) if pair % 2 == 0 else list(reversed(sides))
            times = {side: sides[side](pair * block) for side in order}
            rows.append({"pair": pair, **times, "counted": pair >= config["warmup_pairs"]})
    sync = getattr(loop.strategy, "sync", None)  # how raycomp.train's steps travelled (raycomp._internal.ddp.ddp_sync)
    ways = {} if sync is None else {way.value: n for way, n in sync.steps.items()}
    places = {"interval": loop.interval, "first": loop.first_boundary, "agree_after": loop.agree_after,
              "steps_log": str(loop.log.path)}
    # the boundaries' own work runs after a step's clock stops (the step log leaves it out)
    boundary_ms = 1e3 * loop.boundary_seconds / max(1, loop.global_step)
    totals = raycomp.train.finish()
    hook_state.close()
    return {"rows": rows, "plan": totals["final_plan"], "steps": totals["steps"], "ways": ways, "places": places,
            "boundary_ms_per_step": boundary_ms,
            "wire_bytes_total": totals["wire_bytes_total"], "dense_bytes_total": totals["dense_bytes_total"],
            "controller_outages": totals["controller_outages"], "stats_dropped": totals["stats_dropped"]}


def summarize(rows: list[dict[str, Any]], block: int, plan: str = "dense") -> dict[str, Any]:
    """The counted pairs' ratios (raycomp over the reference side: plain DDP, or torch's
    bf16 hook under ``--plan bf16``): median and quartiles; the median step of each side in
    ms; PASS when the median ratio is at most :data:`GOAL`."""
    counted = [r for r in rows if r["counted"]]
    if not counted:
        raise ValueError("overhead: no counted block pair (every pair was a warm-up pair)")
    ratios = sorted(r["raycomp_s"] / r["plain_s"] for r in counted)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    median = statistics.median(ratios)
    low, high = median_interval(ratios)
    out = {
        "pairs": len(counted), "block_steps": block,
        "ratio_median": median, "ratio_q1": quartiles[0], "ratio_q3": quartiles[2],
        "ratio_median_low": low, "ratio_median_high": high,
        "resolved": high <= GOAL or low > GOAL,
        "plain_step_ms": 1e3 * statistics.median(r["plain_s"] for r in counted) / block,
        "raycomp_step_ms": 1e3 * statistics.median(r["raycomp_s"] for r in counted) / block,
        "goal": f"raycomp.train step with a {plan} plan <= {GOAL:g}x {PLANS[plan][1]}'s (median over block pairs)",
        "ok": median <= GOAL,
    }
    if all("hook_s" in r for r in counted):  # the reference side (reports before it have none)
        out["hook_ratio_median"] = statistics.median(r["hook_s"] / r["plain_s"] for r in counted)
        out["hook_step_ms"] = 1e3 * statistics.median(r["hook_s"] for r in counted) / block
    return out


def step_places(records: list[dict[str, Any]], interval: int, first: int | None, agree_after: int,
                skip: int) -> dict[str, float]:
    """The median ms of raycomp's steps (rank 0's step log, from step ``skip`` on) by their
    place among the control boundaries: the step that reports the statistics, the one after
    it, the one whose end the ranks agree at (``agree_after`` steps after the report; the
    report's own with 0), and every other step."""
    def boundary(done: int) -> bool:
        return done > 0 and (done % interval == 0 or done == first)

    seconds: dict[str, list[float]] = {"boundary": [], "after it": [], "agreement": [], "others": []}
    for record in records:
        step = record["step"]
        if step < skip:
            continue
        done = step + 1  # steps done at this one's end, as the loop counts them
        place = "boundary" if boundary(done) else "agreement" if agree_after and boundary(done - agree_after) \
            else "after it" if boundary(step) else "others"
        seconds[place].append(record["seconds"])
    return {place: 1e3 * statistics.median(values) for place, values in seconds.items() if values}


def median_interval(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of the median of ``ratios``: the 2.5th and 97.5th percentiles of the
    medians of ``draws`` resamples of the pairs (a seeded bootstrap, the same every time).
    The quartiles say how the pairs spread; this says how well their median is known, so a
    reader can see whether the goal is resolved."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[min(draws - 1, int(0.975 * draws))]


def _ways_line(ways: dict[str, int]) -> str:
    """How raycomp.train's steps travelled (:mod:`raycomp._internal.ddp.ddp_sync`), in a sentence."""
    if not ways:
        return ""
    return f"Its steps: {ways.get('ddp', 0)} by DDP's own reduction, {ways.get('hook', 0)} by raycomp's hook."


def write_report(result: dict[str, Any], meta: dict[str, Any], out_dir: Path, name: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    s = result["summary"]
    plan = meta.get("plan", "dense")
    compressor, against = PLANS[plan]
    own = "left out" if meta.get("dense_control", "every_step") == "at_boundaries" else "in one of their own"
    link = f"DDP's own all-reduce for the gradients, the control values {own}" \
        if (result.get("ways") or {}).get("ddp") else "the control values ride in the gradients' collectives"
    verdict = "PASS" if s["ok"] else "MISS"
    table = markdown_table(
        [f"{against} step ms", "raycomp step ms", "ratio (median over pairs)", "its 95% interval", "quartiles"],
        [[f"{s['plain_step_ms']:.1f}", f"{s['raycomp_step_ms']:.1f}", f"{s['ratio_median']:.3f}",
          f"{s['ratio_median_low']:.3f} - {s['ratio_median_high']:.3f}" if "ratio_median_low" in s else "—",
          f"{s['ratio_q1']:.3f} - {s['ratio_q3']:.3f}"]], align="rrrll")
    places = result.get("step_places")
    by_place = [] if not places else [
        "",
        "raycomp's steps by their place among the control boundaries (rank 0's step log, median ms): "
        + ", ".join(f"{place} {ms:.1f}" for place, ms in places.items())
        + (". The boundary's step reports the statistics, the agreement's ends with the ranks' all-gather."
           if "agreement" in places else
           ". The boundary's step reports the statistics and ends with the ranks' agreement (an all-gather).")
        + ("" if result.get("boundary_ms_per_step") is None else
           " That work itself runs after its step's clock stops: "
           f"{result['boundary_ms_per_step']:.2f} ms a step on average, on top of the times above."),
    ]
    reference = [] if "hook_ratio_median" not in s else [
        "",
        f"For reference, raycomp's hook alone (no `raycomp.train` loop): {s['hook_step_ms']:.1f} ms a step, "
        f"{s['hook_ratio_median']:.3f}x {against}'s (median over pairs)"
        + ("; `raycomp.train` leaves a dense step to DDP's own reduction instead, so what its step costs "
           "beyond plain DDP's is the loop's control work: the guard, statistics, boundaries, the step log."
           if plan == "dense" else "; what `raycomp.train` adds to it is the loop's control work: the guard, "
           "statistics, boundaries, the step log."),
    ]
    write_atomic(json_path, json.dumps({**meta, **result}, indent=2) + "\n")
    write_atomic(md_path, "\n".join([
        f"# The raycomp.train step on a {plan} plan against {against}",
        "",
        f"Generated by `jobs/bench/overhead.py`; every number in `{name}.json`.",
        "",
        "## Command",
        "",
        f"```\n{meta['command']}\n```",
        "",
        f"Took {meta['seconds']:.0f} s.",
        "",
        "## Machine",
        "",
        machine_markdown(meta["machine"]),
        "",
        "## Set-up",
        "",
        f"- One Ray Train fit, {meta.get('workers', 2)} workers on this machine's local Ray (loopback), one "
        "thread each.",
        f"- {DESCRIPTIONS[meta.get('model', 'cnn')].format(batch=meta['batch'])}; copies of the same weights "
        "on each worker.",
        "- Plain DDP: `ray.train.torch.prepare_model`, then `backward`, `optimizer.step`, `zero_grad`"
        + ("." if plan == "dense" else ", with torch's `default_hooks.bf16_compress_hook` registered (the "
           "reference side)."),
        f"- raycomp: `raycomp.train.prepare_model` with `compression.policy=static`, compressor `{compressor}` "
        f"(the {plan} plan) and no warm-up, then `backward` and `raycomp.train.step` (guard, "
        "controller link, statistics, plan agreement after each boundary, step log). "
        + _ways_line(result.get("ways") or {}),
        f"- For reference, a third copy carries raycomp's hook alone: `raycomp.CompressionState` on a {plan} "
        "plan, raycomp's buckets, stepped as plain DDP.",
        f"- Blocks of {s['block_steps']} steps in turn (plain, hook, raycomp, then the reverse), the same batches "
        f"for all; {meta['warmup_pairs']} warm-up pairs left out, {s['pairs']} pairs counted.",
        f"- raycomp's compression.bucket_cap_mb: {meta['bucket_cap_mb']}; plain DDP: torch's default (25).",
        f"- raycomp's controller.dense_control: {meta.get('dense_control', 'every_step')} ("
        + ("a dense step's control values in a tiny all-reduce of their own, each step"
           if meta.get("dense_control", "every_step") == "every_step" else
           "no collective of raycomp's on a dense step while the guard is not in fallback; "
           "the ranks agree two steps after each boundary, the steps' losses riding along") + ").",
        f"- Final plan: {result['plan'].get('reason')!r}; wire bytes {result['wire_bytes_total']:,.0f} of "
        f"{result['dense_bytes_total']:,.0f} dense ({link}); "
        f"controller outages {result['controller_outages']}, statistics reports dropped {result['stats_dropped']}.",
        "",
        "## Result",
        "",
        table,
        *by_place,
        *reference,
        "",
        "## Goal",
        "",
        f"- {s['goal']}: **{s['ratio_median']:.3f}** — **{verdict}**" + _resolution(s),
        "",
    ]))
    return json_path, md_path


def _resolution(s: dict[str, Any]) -> str:
    """Whether the pairs resolve the verdict: the median's 95% interval clear of the goal."""
    if "ratio_median_low" not in s:
        return ""  # a report from before the interval
    interval = f"{s['ratio_median_low']:.3f}-{s['ratio_median_high']:.3f}"
    if s["resolved"]:
        return f" (resolved: the median's 95% interval, {interval}, lies on one side of {GOAL:g})"
    return f" (not resolved: the median's 95% interval, {interval}, holds {GOAL:g})"


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
