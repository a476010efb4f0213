"""What the optimizer's kind decides: whether the adaptive policy may offer lossy rungs, and
how much faster local steps must be predicted before ``compression.local.mode: auto`` takes them.

Error feedback (Seide et al. 2014; Karimireddy et al., "Error Feedback Fixes SignSGD",
ICML 2019) sends what a compressor held back in later steps. For an optimizer whose update
is linear in the gradient (SGD, with or without momentum, Nesterov or weight decay; ASGD)
that only delays part of the update, and low-rank or sparse compression keeps dense's
accuracy (the PowerSGD and DGC papers train with momentum SGD). For an optimizer that
divides by a per-coordinate second moment (Adam and its kin) it does not: Tang et al.,
"1-bit Adam", ICML 2021, found error-compensated compression fails with Adam's non-linear
variance term. The benchmarks agree: the AdamW transformer lost validation loss on every
plan that held PowerSGD or Top-K for long, while the SGD CNN reached its target fastest on
torch's PowerSGD. The near-lossless rungs (int4, int8, bf16) stay on the menu either way.

On that transformer the variance term is not all of it: with 1-bit Adam's remedy (the
second moment frozen, so that the update is linear in the gradient) static PowerSGD ended
no better than without it. What costs the loss is the factors' rank: only a rank that
sends more bytes than int4 kept dense's steps to target. So the rule stands for such a
model for a second reason: a lossy rung that sends fewer bytes than int4 costs steps.

Local steps (``compression.local``): ranks that step apart between averages move the loss
less per step than synchronous ones. For momentum SGD, Lin et al. ("Don't Use Large
Mini-Batches, Use Local SGD", ICLR 2020) keep accuracy with small H after a warm-up. Under
AdamW they fall much further behind (on the transformer, about 1.5x dense's steps to the
same loss), so local steps predicted only somewhat faster than per-step int4 lose time to
target. So ``min_gain: auto`` asks SGD for 10% and the others for 100% (local steps twice
as fast as the per-step plan).

The figures: ``docs/benchmarks/history.md``, "Measurements behind the code's choices".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from raycomp.config import LOCAL_MIN_GAIN, LocalSection

if TYPE_CHECKING:
    from raycomp.config.policy_options import AdaptiveOptions

__all__ = ["LINEAR_IN_GRADIENT", "local_min_gain", "lossy_setting", "lossy_suits"]

#: optimizers whose update is a linear function of the gradient
LINEAR_IN_GRADIENT: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.SGD, torch.optim.ASGD)


def lossy_suits(optimizer: torch.optim.Optimizer) -> bool:
    """True for an optimizer whose update is linear in the gradient (see the module)."""
    return isinstance(optimizer, LINEAR_IN_GRADIENT)


def local_min_gain(local: LocalSection, optimizer: torch.optim.Optimizer) -> float:
    """``local.min_gain`` for ``optimizer``: "auto" becomes :data:`LOCAL_MIN_GAIN`'s value
    for its kind (the measurement behind it: this module's docstring)."""
    if local.min_gain != "auto":
        return float(local.min_gain)
    return LOCAL_MIN_GAIN["linear" if lossy_suits(optimizer) else "other"]


def lossy_setting(adaptive: AdaptiveOptions, optimizer: torch.optim.Optimizer) -> str:
    """``adaptive.lossy`` for ``optimizer``: "auto" becomes "always" or "never"; "auto"
    with no near-lossless rung stays lossy (the user chose lossy-or-dense)."""
    if adaptive.lossy != "auto":
        return adaptive.lossy
    return "always" if lossy_suits(optimizer) or not adaptive.near_lossless else "never"
