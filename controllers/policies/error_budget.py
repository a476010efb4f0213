"""Per-layer Top-K ratios: fewest bytes under a total error budget (L-GreCo).

Markov et al., "L-GreCo: Layerwise-Adaptive Gradient Compression for Efficient and
Accurate Deep Learning", MLSys 2024 (Sec. 3, dynamic program over layers)::

    every every_steps boundary steps:
        for each compressible layer l with a measured Top-K profile e_l(r), and ratio r:
            err[l][r]  = (e_l(r) * ||g_l||)^2          absolute squared error
            cost[l][r] = 8 * sparse_k(numel_l, r)       fp32 values + int32 indices
        B = (1 + slack) * sum_l err[l][reference_ratio]
        unit = B / bins;  b[l][r] = ceil(err[l][r] / unit)   (rounded up: never over B)
        D[0][0] = 0;  D[l][j] = min_r D[l-1][j - b[l][r]] + cost[l][r]
        pick argmin_{j <= bins} D[L][j] and walk back the choices; if rounding up left
        nothing cheaper than all-r_ref (which meets B exactly), keep r_ref everywhere

``reference_ratio`` is always a candidate; a layer chooses among the candidate ratios
measured for it, and keeps ``reference_ratio`` until that one is measured; layers below
``min_compress_numel`` are not listed and stay dense.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raycomp.compressors.sparse import sparse_k
from raycomp.config.policy_options import ErrorBudgetOptions
from raycomp.plan import CompressorSpec, Plan

from ..state import RunState
from .base import Policy, compressible_layers
from .decision import Decision

BINS = 400


@dataclass(frozen=True)
class BudgetWhy:
    solved: int  # layers with a measured error profile at the latest solve
    layers: int
    rule: str = "error_budget.solve"

    def text(self) -> str:
        return f"error_budget: {self.solved}/{self.layers} layers solved"


@dataclass
class BudgetState:
    last_step: int | None = None  # step of the latest solve
    measured: int = 0  # layers with a profile at the latest solve
    chosen: dict[str, float] = field(default_factory=dict)  # layer -> Top-K ratio
    summary: dict[str, float] = field(default_factory=dict)  # the latest solve's budget, error, bytes
    solves: int = 0


def error_bins(errors: Sequence[Sequence[float]], budget: float, bins: int) -> list[list[int]]:
    """Errors in units of ``budget / bins``, rounded up (``bins + 1``: never fits)."""
    if budget <= 0:
        return [[0 if e <= 0 else bins + 1 for e in row] for row in errors]
    unit = budget / bins
    return [[min(bins + 1, max(0, math.ceil(e / unit))) for e in row] for row in errors]


def choose_ratios(costs: Sequence[Sequence[float]], errors: Sequence[Sequence[float]],
                  budget: float, bins: int = BINS) -> list[int] | None:
    """Option index per layer minimising total cost with total error <= ``budget``.

    Exact on the discretised problem (errors rounded up to ``budget / bins``), so the
    real total error never exceeds the budget. ``None`` when no assignment fits.
    """
    b = error_bins(errors, budget, bins)
    dp = np.zeros(bins + 1)  # dp[j]: least cost of the layers so far using exactly j bins
    dp[1:] = np.inf
    back: list[np.ndarray] = []
    for cost_row, bin_row in zip(costs, b, strict=True):
        new = np.full(bins + 1, np.inf)
        arg = np.full(bins + 1, -1, dtype=np.int64)
        for option, (c, w) in enumerate(zip(cost_row, bin_row, strict=True)):
            if w > bins:
                continue
            cand = np.full(bins + 1, np.inf)
            cand[w:] = dp[: bins + 1 - w] + c
            better = cand < new
            new[better], arg[better] = cand[better], option
        dp = new
        back.append(arg)
    j = int(np.argmin(dp))
    if not np.isfinite(dp[j]):
        return None
    chosen: list[int] = []
    for layer in range(len(back) - 1, -1, -1):
        option = int(back[layer][j])
        chosen.append(option)
        j -= b[layer][option]
    return chosen[::-1]


def topk_bytes(numel: int, ratio: float) -> float:
    return 8.0 * sparse_k(numel, ratio)


def _profile(errors: dict[str, float], ratios: list[float], reference: float) -> dict[float, float] | None:
    """Measured error at each candidate ratio (keys are ``str(ratio)``); None without the reference."""
    parsed = {}
    for k, v in errors.items():
        try:
            ratio, error = float(k), float(v)
        except (TypeError, ValueError):
            continue  # reports are untrusted: skip what is not a number
        if math.isfinite(error) and error >= 0:
            parsed[ratio] = error
    out = {}
    for r in ratios:
        match = [v for k, v in parsed.items() if math.isclose(k, r, rel_tol=1e-9)]
        if match:
            out[r] = match[0]
    return out if reference in out else None


class ErrorBudgetPolicy(Policy):
    name = "error_budget"
    options_model = ErrorBudgetOptions

    def __init__(self, options: ErrorBudgetOptions, min_compress_numel: int = 1024, bins: int = BINS) -> None:
        super().__init__(options, min_compress_numel)
        self.reference = float(options.reference_ratio)
        self.ratios = sorted({float(r) for r in options.ratios} | {self.reference})
        self.slack = float(options.slack)
        self.every = int(options.every_steps)
        self.bins = int(bins)
        self.state: BudgetState = BudgetState()

    def decide(self, run: RunState) -> Decision:
        due = self.state.last_step is None or run.step - self.state.last_step >= self.every
        if due or self.state.measured == 0:
            self._solve(run)
        layers = compressible_layers(run, self.min_numel)
        chosen = {n: CompressorSpec.of("topk", ratio=self.state.chosen.get(n, self.reference)) for n in layers}
        return Decision.of(Plan.per_layer(chosen), BudgetWhy(self.state.measured, len(layers)))

    def _solve(self, run: RunState) -> None:
        layers = compressible_layers(run, self.min_numel)
        names, options, costs, errors, ref = [], [], [], [], []
        for name in layers:
            h = run.layers[name]
            profile = _profile(h.topk_errors, self.ratios, self.reference)
            if profile is None or not h.grad_norm:
                continue
            g = h.grad_norm[-1][1]
            names.append(name)
            options.append(list(profile))
            ref.append(options[-1].index(self.reference))
            costs.append([topk_bytes(h.numel, r) for r in profile])
            errors.append([(e * g) ** 2 for e in profile.values()])
        budget = (1 + self.slack) * sum(row[i] for row, i in zip(errors, ref, strict=True))
        picked = choose_ratios(costs, errors, budget, self.bins) if names else []
        ref_cost = sum(row[i] for row, i in zip(costs, ref, strict=True))
        if picked is None or sum(c[i] for c, i in zip(costs, picked, strict=True)) > ref_cost:
            picked = ref  # the reference always fits the budget
        self.state.chosen = {n: opts[i] for n, opts, i in zip(names, options, picked, strict=True)}
        fixed = sum(topk_bytes(run.layers[n].numel, self.reference) for n in layers if n not in self.state.chosen)
        self.state.summary = {
            "budget": budget,
            "achieved_error": sum(e[i] for e, i in zip(errors, picked, strict=True)),
            "predicted_bytes": sum(c[i] for c, i in zip(costs, picked, strict=True)) + fixed,
            "reference_bytes": ref_cost + fixed,
        }
        self.state.measured = len(names)
        self.state.last_step = run.step
        self.state.solves += 1

    def details(self) -> dict[str, Any]:
        return {"solves": self.state.solves, "last_solve_step": self.state.last_step,
                "reference_ratio": self.reference, "slack": self.slack,
                "measured_layers": self.state.measured, "ratios": dict(self.state.chosen), **self.state.summary}



__all__ = ["BudgetWhy", "ErrorBudgetPolicy", "choose_ratios", "error_bins"]
