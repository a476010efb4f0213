"""The runs of the end-to-end benchmark: each method's config overrides, its own warm-up, the
references (compute-only, no-communication), the grids a method's best setting is picked
from, and the workloads with their step budgets.

Every config the benchmark hands ``jobs.train`` is built here (:func:`method_overrides`), so
the rules live in one place: every method runs the same config file, seed, data order, LR
schedule (over the same budget), evaluation cadence and validation set; each warms up as
its authors recommend (:data:`WARMUP_SHARE`; no shared dense warm-up, and the warm-up counts
in its time); every run stops once the target held at two consecutive evaluations.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from jobs.bench.e2e.traces import CONSECUTIVE

__all__ = [
    "COMMON", "COMPUTE", "DEFAULT_BUDGET", "DILOCO_SYNC_EVERY", "FSDP_BASELINES", "FSDP_METHODS",
    "FSDP_QUICK_METHODS", "GRIDS", "LOCALSGD_PERIODS", "METHODS", "NO_COMM", "QUICK_METHODS",
    "ADAPTIVE", "RAYCOMP_LOCAL_SYNC_EVERY", "REFERENCES", "TORCH_BASELINE_OVERRIDES", "TORCH_HOOKS", "WARMUP_SHARE", "WORKLOADS",
    "available", "default_methods", "family", "grid_setting", "method_overrides", "methods_of",
    "parse_methods", "policy_default", "warmup_of",
]

_STATIC_TOPK = "compression.static.compressor={name: topk, ratio: 0.01}"
#: torch's post-local SGD: the averaging periods H tried (each must divide the evaluation
#: cadence, so that every evaluation sees averaged weights); the report keeps the best
LOCALSGD_PERIODS = (4, 8, 16)
#: torchft's DiLoCo: the sync intervals H tried (the same rule)
DILOCO_SYNC_EVERY = (4, 8, 16)
#: raycomp's own local steps at a fixed H (``compression.local.mode=fixed``, int4
#: pseudo-gradients, plain averaging: the section's defaults): the H tried
RAYCOMP_LOCAL_SYNC_EVERY = (4, 8, 16)
#: ``raycomp_adaptive``: the shipped default with the one local-steps switch on and two levels
#: where the topology has them (several workers on each of several nodes), nothing tuned;
#: ``raycomp_adaptive_flat``: the same with every worker its own node (the ablation);
#: ``raycomp_adaptive_per_step``: the same with local steps off (the library's own default
#: ``compression.local.mode``), so that what local steps add or cost shows beside it
ADAPTIVE = ["compression.local.mode=auto", "compression.levels=auto"]
ADAPTIVE_FLAT = ["compression.local.mode=auto", "compression.levels=flat"]
ADAPTIVE_PER_STEP = ["compression.local.mode=off", "compression.levels=auto"]
#: method name -> config overrides (on top of the workload's config and the shared ones)
METHODS: dict[str, list[str]] = {
    "dense": ["benchmark.baseline=torch_allreduce"],
    "torch_fp16": ["benchmark.baseline=torch_fp16", "benchmark.warmup_steps=0"],
    "torch_bf16": ["benchmark.baseline=torch_bf16", "benchmark.warmup_steps=0"],
    **{f"torch_powersgd_r{r}": ["benchmark.baseline=torch_powersgd", f"benchmark.powersgd_rank={r}"]
       for r in (1, 2, 4)},
    **{f"torch_postlocalsgd_h{h}": ["benchmark.baseline=torch_postlocalsgd", f"benchmark.localsgd_period={h}"]
       for h in LOCALSGD_PERIODS},
    **{f"torchft_diloco_h{h}": ["benchmark.baseline=torchft_diloco", f"benchmark.diloco_sync_every={h}"]
       for h in DILOCO_SYNC_EVERY},
    "raycomp_topk": ["compression.policy=static", _STATIC_TOPK],
    "raycomp_dgc": ["compression.policy=static", "compression.static.compressor={name: dgc_topk, ratio: 0.001}"],
    **{f"raycomp_powersgd_r{r}": ["compression.policy=static", f"compression.static.compressor={{name: powersgd, rank: {r}}}"]
       for r in (1, 2, 4)},
    "raycomp_sign": ["compression.policy=static", "compression.static.compressor={name: sign}"],
    "raycomp_int8": ["compression.policy=static", "compression.static.compressor={name: int8}"],
    "raycomp_int4": ["compression.policy=static", "compression.static.compressor={name: int4}",
                     "compression.levels=flat"],
    # the same in two levels where the topology has them: what crosses nodes, same compressor
    "raycomp_int4_levels": ["compression.policy=static", "compression.static.compressor={name: int4}",
                            "compression.levels=auto"],
    # the dense plan through raycomp's hook, controller and statistics, beside ``dense``
    # (torch's allreduce_hook in the same loop)
    "raycomp_dense": ["compression.policy=static", "compression.static.compressor={name: none}"],
    **{f"raycomp_local_h{h}": ["compression.local.mode=fixed", f"compression.local.sync_every={h}"]
       for h in RAYCOMP_LOCAL_SYNC_EVERY},
    # the same with every worker its own replica (where the topology has two levels, each
    # node is one replica above, data-parallel inside)
    **{f"raycomp_local_flat_h{h}": ["compression.local.mode=fixed", f"compression.local.sync_every={h}",
                                    "compression.levels=flat"] for h in RAYCOMP_LOCAL_SYNC_EVERY},
    "raycomp_adaptive": ADAPTIVE,
    "raycomp_adaptive_flat": ADAPTIVE_FLAT,
    "raycomp_adaptive_per_step": ADAPTIVE_PER_STEP,
}
#: a method run at several settings -> its variants; the report shows the family under its
#: own name with the best variant's numbers (and every variant's in ``grid``)
GRIDS: dict[str, list[str]] = {
    "torch_postlocalsgd": [f"torch_postlocalsgd_h{h}" for h in LOCALSGD_PERIODS],
    "torchft_diloco": [f"torchft_diloco_h{h}" for h in DILOCO_SYNC_EVERY],
    "raycomp_local": [f"raycomp_local_h{h}" for h in RAYCOMP_LOCAL_SYNC_EVERY],
    "raycomp_local_flat": [f"raycomp_local_flat_h{h}" for h in RAYCOMP_LOCAL_SYNC_EVERY],
}
#: torch baselines: which communication (for the byte model); raycomp's own plan stays dense
#: and unused
TORCH_HOOKS = {"dense": "allreduce", "torch_fp16": "fp16", "torch_bf16": "bf16",
               **{f"torch_powersgd_r{r}": "powersgd" for r in (1, 2, 4)},
               **{f"torch_postlocalsgd_h{h}": "localsgd" for h in LOCALSGD_PERIODS},
               **{f"torchft_diloco_h{h}": "diloco" for h in DILOCO_SYNC_EVERY}}
TORCH_BASELINE_OVERRIDES = ["compression.policy=static", "compression.static.compressor={name: none}"]
#: each method's own warm-up, as a share of the step budget, where its authors recommend one:
#: torch's PowerSGD docs: "start with 10% of total training steps" (``start_powerSGD_iter``).
#: Post-local SGD (Lin et al., ICLR 2020) switches to local steps at the first LR decay,
#: which a cosine schedule does not have, and torch leaves ``start_localSGD_iter`` to the
#: user: about the same 10% of DDP steps first (:func:`warmup_of` aligns it). torch's fp16/bf16 hooks and torchft's DiLoCo have
#: none; raycomp's methods use their own config (``compression.warmup_steps``, the local
#: section's defaults); ``--localsgd-start`` overrides post-local SGD's
WARMUP_SHARE = {"torch_powersgd": 0.10, "torch_postlocalsgd": 0.10}
#: ``--strategy fsdp`` (issue 14): FSDP2 runs, the same names for the same roles. dense and
#: torch_bf16 are FSDP's own reduce-scatter (fp32; ``MixedPrecisionPolicy(reduce_dtype=bf16)``,
#: which FSDP cannot switch on mid-run: bf16 from step 0); raycomp_* replace it with the
#: compressed all-to-all, adaptive choosing int8/bf16/dense per unit
FSDP_METHODS: dict[str, list[str]] = {
    "dense": ["benchmark.baseline=torch_fsdp"],
    "torch_bf16": ["benchmark.baseline=torch_fsdp_bf16"],
    "raycomp_bf16": ["compression.policy=static", "compression.static.compressor={name: bf16}"],
    "raycomp_int8": ["compression.policy=static", "compression.static.compressor={name: int8}"],
    "raycomp_adaptive": [],
    # several nodes of several workers: raycomp_adaptive shards per node (two levels); the
    # ablation shards over every rank; torch's HSDP is the same layout, dense
    "raycomp_adaptive_flat": ["compression.levels=flat"],
    "torch_hsdp": ["benchmark.baseline=torch_hsdp"],
}
#: FSDP's own reduce-scatter: the byte model's dtype (bytes per element)
FSDP_BASELINES = {"dense": 4, "torch_bf16": 2, "torch_hsdp": 4}
QUICK_METHODS = ["dense", "torch_postlocalsgd_h8", "torchft_diloco_h8", "raycomp_adaptive"]
FSDP_QUICK_METHODS = ["dense", "raycomp_int8", "raycomp_adaptive"]
COMPUTE = "compute_only"
#: the step without the network: both workers, DDP and the same buckets, torch's noop_hook in
#: place of any collective (each rank keeps its own gradient). One at the start of each seed's
#: group, so that a step is divided by a no-communication step of the same hour: one worker
#: alone (COMPUTE) has the machine's two cores, caches and memory to itself
NO_COMM = "no_comm"
REFERENCES = {COMPUTE: ["scaling.num_workers=1"], NO_COMM: ["benchmark.baseline=torch_noop"]}

DEFAULT_BUDGET = 320
#: per workload: config file, evaluation cadence (full and quick; every grid's H divides the
#: full one), quick budget, the torch PowerSGD rank of the default run (the rank that came
#: closest to the target in the all-methods reports: 4 on each workload) and, like that rank,
#: the H at which the default run runs each local-step grid: the best of the grid where all
#: its H have run on this workload at the default budget (the shortest median time to
#: target, else the best final metric). A grid without one runs every H; naming a grid in
#: ``--methods`` runs every H as well. With one H per grid the transformer's full run (8
#: methods x 3 seeds) took 81 minutes here; with every H, about 2 hours.
WORKLOADS: dict[str, dict[str, Any]] = {
    "gpt": {"config": "jobs/configs/gpt_kjv.yaml", "eval_every": 16, "quick": {"steps": 64, "eval_every": 16},
            "powersgd_rank": 4, "best_h": {"torch_postlocalsgd": 4, "torchft_diloco": 16, "raycomp_local": 4}},
    "lm": {"config": "jobs/configs/lm_kjv.yaml", "steps": 2000, "eval_every": 80,
           "quick": {"steps": 160, "eval_every": 16}, "powersgd_rank": 4},
    "cnn": {"config": "jobs/configs/cnn_fashion.yaml", "eval_every": 16, "quick": {"steps": 64, "eval_every": 16},
            "powersgd_rank": 4, "best_h": {"torch_postlocalsgd": 16, "torchft_diloco": 16, "raycomp_local": 8}},
    "lstm": {"config": "jobs/configs/lstm_kjv.yaml", "eval_every": 16, "quick": {"steps": 64, "eval_every": 16},
             "powersgd_rank": 4, "best_h": {"torch_postlocalsgd": 8, "torchft_diloco": 16, "raycomp_local": 4}},
    "mlp": {"config": "jobs/configs/digits.yaml",
            "overrides": ["workload.model_width=448", "workload.batch_size=32", "workload.lr=0.05",
                          "workload.momentum=0.9", "workload.lr_schedule=cosine"],
            "eval_every": 16, "quick": {"steps": 64, "eval_every": 16}, "powersgd_rank": 4},
}
COMMON = ["scaling.cpus_per_worker=1", "checkpoint.every_epochs=10000",
          "checkpoint.max_failures=0", "scaling.placement_strategy=SPREAD",
          "scaling.collective_timeout_s=120", "controller.metrics_enabled=false"]


def methods_of(strategy: str) -> dict[str, list[str]]:
    """The methods of ``--strategy`` (ddp or fsdp), name -> overrides."""
    return FSDP_METHODS if strategy == "fsdp" else METHODS


def family(name: str) -> str:
    """The name a method is reported under: its grid's, or its own."""
    return next((f for f, variants in GRIDS.items() if name in variants), name)


def grid_setting(name: str) -> int | None:
    """A grid variant's setting (H of ``torch_postlocalsgd_h8``: 8); None for other methods."""
    return int(name.rsplit("_h", 1)[1]) if family(name) != name else None


def available(name: str) -> str | None:
    """Why ``name`` cannot run in this checkout (None: it can)."""
    if name.startswith("torchft_") and importlib.util.find_spec("torchft") is None:
        return "needs the torchft package (pip install 'raycomp[bench]')"
    return None


def default_methods(workload: str) -> list[str]:
    """The full run's methods: dense, torch's bf16 and its best PowerSGD rank, raycomp int4,
    the local-step family (torch post-local SGD, torchft DiLoCo and raycomp's local steps,
    each at the workload's best H, else over its grid), adaptive; those this checkout cannot
    run are left out."""
    spec = WORKLOADS[workload]
    best, local = spec.get("best_h", {}), []
    for grid, variants in GRIDS.items():
        if grid == "raycomp_local_flat":  # an ablation, run where asked
            continue
        local += [f"{grid}_h{best[grid]}"] if grid in best else variants
    names = ["dense", "torch_bf16", f"torch_powersgd_r{spec['powersgd_rank']}", "raycomp_int4", *local,
             "raycomp_adaptive"]
    return [n for n in names if available(n) is None]


def parse_methods(text: str | None, quick: bool, strategy: str = "ddp", workload: str = "gpt",
                  all_methods: bool = False) -> list[str]:
    """``--methods``: a comma-separated subset (a grid's name stands for all its variants),
    'all' (or ``--all-methods``: every method this checkout can run, the per-step lossy ones
    that never reach an AdamW target included), or the default set (quick or full)."""
    methods = methods_of(strategy)
    if all_methods or (text is not None and text.strip() == "all"):
        return [n for n in methods if available(n) is None]
    if text is None:
        if strategy == "fsdp":
            return list(FSDP_QUICK_METHODS if quick else methods)
        return [n for n in QUICK_METHODS if available(n) is None] if quick else default_methods(workload)
    names = [n.strip() for n in text.split(",") if n.strip()]
    names = [v for n in names for v in (GRIDS[n] if n in GRIDS and strategy == "ddp" else [n])]
    unknown = [n for n in names if n not in methods]
    if unknown or not names:
        allowed = ", ".join([*methods, *(GRIDS if strategy == "ddp" else [])])
        raise SystemExit(f"error: --methods: unknown {unknown or text!r}; allowed with --strategy {strategy}: {allowed}")
    missing = [f"{n} {available(n)}" for n in names if available(n) is not None]
    if missing:
        raise SystemExit(f"error: --methods: {'; '.join(missing)}")
    return [n for n in methods if n in names]


def warmup_of(name: str, settings: dict[str, Any]) -> int:
    """The step at which ``name``'s own warm-up ends (0: none, or raycomp's, which the step
    logs show).

    Post-local SGD's W is the value nearest its share of the budget whose W + 1 is a multiple
    of every period H of the grid: torch's averager first averages right after optimizer step
    W + 1, then every H steps, so evaluations (every multiple of H) see averaged weights.
    """
    steps = settings["steps"]
    if name.startswith("torch_powersgd"):
        return max(2, round(WARMUP_SHARE["torch_powersgd"] * steps))  # torch: >= 2 with error feedback
    if name.startswith("torch_postlocalsgd"):
        start = settings.get("localsgd_start")
        if start is not None:
            return int(start)
        align = math.lcm(*LOCALSGD_PERIODS)
        cycles = max(1, round((WARMUP_SHARE["torch_postlocalsgd"] * steps + 1) / align))
        return cycles * align - 1
    return 0


def method_overrides(name: str, settings: dict[str, Any], seed: int, interval: int,
                     bucket_cap_mb: float) -> list[str]:
    """Config overrides of one run (on top of the workload's config file). ``settings["target"]``
    set: the run stops once the target held at two consecutive evaluations."""
    steps, every = settings["steps"], settings["eval_every"]
    # the epoch is the evaluation cadence, so a loop that evaluates once per epoch evaluates at
    # the same steps as one that honours workload.eval_every_steps
    overrides = [*settings["extra"], *COMMON, f"scaling.num_workers={settings.get('workers', 2)}", f"run.seed={seed}", f"workload.steps_per_epoch={every}",
                 f"workload.epochs={steps // every}", f"workload.eval_every_steps={every}"]
    if settings.get("target") is not None and name not in REFERENCES:
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
        overrides += [f"benchmark.bucket_cap_mb={bucket_cap_mb}",
                      f"benchmark.powersgd_start_iter={warmup_of(name, settings)}"]
    if name.startswith("torch_postlocalsgd"):
        overrides.append(f"benchmark.localsgd_start_iter={warmup_of(name, settings)}")
    return overrides


def policy_default() -> str:
    """The shipped default of ``compression.policy`` (what ``raycomp_adaptive`` runs)."""
    from raycomp.config import CompressionSection

    return CompressionSection.model_fields["policy"].default
