"""The end-to-end benchmark's goals, as data: which report a goal applies to, the number it
reads, how it compares and against what.

A report is judged by the goals of the first scope in :data:`SCOPES` whose conditions it
meets (FSDP before the fast link before the transformer before any other workload), and only
when ``raycomp_adaptive`` ran. :mod:`jobs.bench.e2e.judge` holds the measures (each a number
read off the results) and applies the table; a goal's text is what the report prints, with
``{threshold}``, ``{margin}`` (threshold - 1), ``{best}`` (the fastest other method's name),
``{metric}`` (the validation metric) and ``{reference}`` (the step goal's reference step)
filled in. A number that is missing is a MISS.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GOALS", "SCOPES", "Goal"]


@dataclass(frozen=True)
class Goal:
    """One goal: in ``scope``, ``measure`` ``comparison`` ``threshold`` passes.

    ``comparison`` is ``>=``, ``<=``, ``>`` or ``present`` (the number exists). ``ceiling``
    names the best value the benchmark's shared dense warm-up allows
    (:func:`~jobs.bench.e2e.judge.warmup_ceilings`), printed beside the verdict; a goal with
    ``needs`` is judged only when that method ran.
    """

    scope: str
    text: str
    measure: str
    comparison: str
    threshold: float | None = None
    ceiling: str | None = None
    needs: str | None = None


#: scope -> the report fields it requires (strategy, link rate, workload name); first match wins
SCOPES: tuple[tuple[str, dict[str, str]], ...] = (
    ("fsdp", {"strategy": "fsdp"}),
    ("fast link", {"link": "fast"}),
    ("transformer", {"workload": "gpt"}),
    ("other workloads", {}),
)

_FINAL = "adaptive final validation {metric} within {threshold:.0%} of dense (relative, > 0 = worse)"

GOALS: tuple[Goal, ...] = (
    # FSDP (issue 14): dense FSDP's target, fewer bytes on the NIC
    Goal("fsdp", "FSDP: adaptive reaches the target dense FSDP reaches (speed-up vs dense)",
         "speedup_vs_dense", "present"),
    Goal("fsdp", "FSDP: adaptive NIC bytes per step fewer than dense FSDP's (ratio)",
         "nic_reduction_vs_dense", ">", 1.0),
    Goal("fsdp", "FSDP: adaptive time to target not slower than the best other method{best} (ratio)",
         "time_vs_best_other", "<=", 1.0),
    # an unshaped link: compression must not cost time
    Goal("fast link", "fast link: adaptive time to target within {margin:.0%} of the fastest other "
         "method{best} (ratio)", "time_vs_best_other", "<=", 1.05),
    # the transformer over a slow link (issue 12), on the medians over seeds
    Goal("transformer", "adaptive time to target >= {threshold:g}x faster than dense",
         "speedup_vs_dense", ">=", 5.0, ceiling="vs_dense"),
    Goal("transformer", "adaptive time to target >= {threshold:g}x faster than the best torch powerSGD rank",
         "speedup_vs_torch_powersgd", ">=", 1.5),
    Goal("transformer", "adaptive time to target <= {threshold:g}x the best static method of any kind{best}",
         "time_vs_best_other", "<=", 1.05),
    Goal("transformer", _FINAL, "final_metric_vs_dense", "<=", 0.01),
    Goal("transformer", "whole-run NIC bytes (per step) >= {threshold:g}x fewer than dense",
         "nic_reduction_vs_dense", ">=", 50.0, ceiling="nic"),
    Goal("transformer", "adaptive steady step time <= {threshold:g}x {reference}",
         "step_vs_reference", "<=", 1.2),
    Goal("transformer", "adaptive control share <= {threshold:.0%}", "control_share", "<=", 0.01),
    # any other workload over a slow link
    Goal("other workloads", "adaptive time to target not slower than the best non-adaptive method{best} (ratio)",
         "time_vs_best_other", "<=", 1.0),
    Goal("other workloads", _FINAL, "final_metric_vs_dense", "<=", 0.01, needs="dense"),
)
