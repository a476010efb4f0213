"""The end-to-end benchmark's goals, as data: which report a goal applies to, the number it
reads, how it compares and against what.

A report is judged by the goals of the first scope in :data:`SCOPES` whose conditions it
meets (FSDP before the fast link before more than two workers before the transformer before
any other workload), and only
when ``raycomp_adaptive`` ran. :mod:`jobs.bench.e2e.judge` holds the measures (each a number
read off the results, with the physical limit of a time ratio beside it) and applies the
table; a goal's text is what the report prints, with ``{threshold}``, ``{margin}``
(threshold - 1), ``{best}`` (the fastest other method's name), ``{best_local}`` (the fastest
local-step method's name) and ``{metric}`` (the validation metric) filled in. A number that
is missing is a MISS.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GOALS", "LOCAL_METHODS", "SCOPES", "Goal"]


@dataclass(frozen=True)
class Goal:
    """One goal: in ``scope``, ``measure`` ``comparison`` ``threshold`` passes.

    ``comparison`` is ``>=``, ``<=``, ``>`` or ``present`` (the number exists). A goal with
    ``needs`` is judged only when one of those methods ran.
    """

    scope: str
    text: str
    measure: str
    comparison: str
    threshold: float | None = None
    needs: tuple[str, ...] = ()


#: scope -> the report fields it requires (strategy, link rate, workload name); first match wins
SCOPES: tuple[tuple[str, dict[str, str]], ...] = (
    ("fsdp", {"strategy": "fsdp"}),
    ("fast link", {"link": "fast"}),
    ("many workers", {"ranks": "many"}),
    ("transformer", {"workload": "gpt"}),
    ("other workloads", {}),
)

#: the local-step methods (a grid reported under its name: its best setting)
LOCAL_METHODS = ("torch_postlocalsgd", "torchft_diloco", "raycomp_local")

_FINAL = ("adaptive validation {metric} within {threshold:.0%} of dense's at the same step (each seed's last "
          "evaluation both runs made; median, relative, > 0 = worse)")

GOALS: tuple[Goal, ...] = (
    # FSDP (issue 14): dense FSDP's target, fewer bytes on the NIC
    Goal("fsdp", "FSDP: adaptive reaches the target dense FSDP reaches (speed-up vs dense)",
         "speedup_vs_dense", "present"),
    Goal("fsdp", "FSDP: adaptive NIC bytes per step fewer than dense FSDP's (ratio)",
         "nic_per_step_reduction_vs_dense", ">", 1.0),
    Goal("fsdp", "FSDP: adaptive time to target not slower than the best other method{best} (ratio)",
         "time_vs_best_other", "<=", 1.0),
    # an unshaped link: compression must not cost time
    Goal("fast link", "fast link: adaptive time to target within {margin:.0%} of the fastest other "
         "method{best} (ratio)", "time_vs_best_other", "<=", 1.05),
    # more than two workers (a K x L topology) over a slow link, every workload
    Goal("many workers", "adaptive time to target not slower than the best other method of any "
         "kind{best} (ratio)", "time_vs_best_other", "<=", 1.0),
    Goal("many workers", _FINAL, "final_metric_vs_dense", "<=", 0.01, needs=("dense",)),
    Goal("many workers", "adaptive's predicted step within {threshold:.0%} of the step measured, for every plan it "
         "ran (the largest |predicted / measured - 1| over the plans and seeds)", "prediction_error", "<=", 0.15),
    # several workers per node (issue 67): two levels against the same run flat
    Goal("many workers", "two levels: adaptive time to target not slower than raycomp_adaptive_flat (ratio)",
         "time_vs_flat", "<=", 1.0, needs=("raycomp_adaptive_flat",)),
    Goal("many workers", "two levels: NIC bytes per step once int4 is in force, flat / two levels >= "
         "{threshold:g} (ranks per node)", "nic_per_step_flat_vs_levels", ">=", 2.0, needs=("raycomp_int4_levels",)),
    # the transformer over a slow link (issue 41), on the medians over seeds
    Goal("transformer", "adaptive time to target >= {threshold:g}x faster than dense",
         "speedup_vs_dense", ">=", 5.0),
    Goal("transformer", "adaptive time to target >= {threshold:g}x faster than raycomp_int4",
         "speedup_vs_int4", ">=", 1.5, needs=("raycomp_int4",)),
    Goal("transformer", "adaptive time to target >= {threshold:g}x faster than the best local-step method "
         "(torch post-local SGD, torchft DiLoCo, raycomp local){best_local}",
         "speedup_vs_best_local", ">=", 1.2, needs=LOCAL_METHODS),
    Goal("transformer", "adaptive time to target <= {threshold:g}x the compute-bound time to target "
         "(dense's steps to target x the step without communication)",
         "time_vs_compute_bound", "<=", 1.25),
    Goal("transformer", "whole-run NIC bytes (each run stopped once the target held twice) >= {threshold:g}x "
         "fewer than dense", "nic_reduction_vs_dense", ">=", 50.0),
    Goal("transformer", _FINAL, "final_metric_vs_dense", "<=", 0.01),
    # the CNN and the LSTM (and any other workload) over a slow link
    Goal("other workloads", "adaptive time to target not slower than the best other method of any "
         "kind{best} (ratio)", "time_vs_best_other", "<=", 1.0),
    Goal("other workloads", _FINAL, "final_metric_vs_dense", "<=", 0.01, needs=("dense",)),
)
