"""The runs of the end-to-end benchmark: each method's config overrides, the references
(compute-only, no-communication) and the workloads with their step budgets.

Every config the benchmark hands ``jobs.train`` is built here (:func:`method_overrides`), so
the fairness rules (same seed, budget, cadence and dense warm-up for every method) live in
one place.
"""

from __future__ import annotations

from typing import Any

from jobs.bench.e2e.traces import CONSECUTIVE

__all__ = [
    "COMMON", "COMPUTE", "FSDP_BASELINES", "FSDP_METHODS", "FSDP_QUICK_METHODS", "METHODS", "NO_COMM",
    "QUICK_METHODS", "REFERENCES", "TORCH_BASELINE_OVERRIDES", "TORCH_HOOKS", "WORKLOADS",
    "method_overrides", "methods_of", "parse_methods", "policy_default",
]

_STATIC_TOPK = "compression.static.compressor={name: topk, ratio: 0.01}"
#: method name -> config overrides (on top of the workload's config and the shared ones)
METHODS: dict[str, list[str]] = {
    "dense": ["benchmark.baseline=torch_allreduce"],
    "torch_fp16": ["benchmark.baseline=torch_fp16"],
    "torch_bf16": ["benchmark.baseline=torch_bf16"],
    **{f"torch_powersgd_r{r}": ["benchmark.baseline=torch_powersgd", f"benchmark.powersgd_rank={r}"]
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
    "dense": ["benchmark.baseline=torch_fsdp"],
    "torch_bf16": ["benchmark.baseline=torch_fsdp_bf16"],
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
REFERENCES = {COMPUTE: ["scaling.num_workers=1"], NO_COMM: ["benchmark.baseline=torch_noop"]}

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


def methods_of(strategy: str) -> dict[str, list[str]]:
    """The methods of ``--strategy`` (ddp or fsdp), name -> overrides."""
    return FSDP_METHODS if strategy == "fsdp" else METHODS


def parse_methods(text: str | None, quick: bool, strategy: str = "ddp") -> list[str]:
    """``--methods``: a comma-separated subset, 'all', or the default set (quick or full)."""
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


def method_overrides(name: str, settings: dict[str, Any], seed: int, interval: int,
                     bucket_cap_mb: float) -> list[str]:
    """Config overrides of one run (on top of the workload's config file)."""
    steps, every, warmup = settings["steps"], settings["eval_every"], settings["warmup"]
    # the epoch is the evaluation cadence, so a loop that evaluates once per epoch evaluates at
    # the same steps as one that honours workload.eval_every_steps
    overrides = [*settings["extra"], *COMMON, f"run.seed={seed}", f"workload.steps_per_epoch={every}",
                 f"workload.epochs={steps // every}", f"workload.eval_every_steps={every}",
                 f"compression.warmup_steps={max(0, warmup - interval)}",
                 f"benchmark.warmup_steps={warmup}",
                 f"benchmark.powersgd_start_iter={warmup}"]
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
        overrides.append(f"benchmark.bucket_cap_mb={bucket_cap_mb}")
    return overrides


def policy_default() -> str:
    """The shipped default of ``compression.policy`` (what ``raycomp_adaptive`` runs)."""
    from raycomp.config import CompressionSection

    return CompressionSection.model_fields["policy"].default
