"""``compression.adaptive.lossy: auto``: ``raycomp.train`` offers the adaptive policy its
lossy rungs (PowerSGD, Top-K) only for an optimizer whose update is linear in the gradient."""

from __future__ import annotations

import pytest
import torch

from raycomp.config import CompressionSection
from raycomp.controllers.policies import AdaptiveOptions
from raycomp.train import TrainOptions
from raycomp.train.options import resolve_options


def _options(**adaptive) -> TrainOptions:
    return TrainOptions(compression=CompressionSection(adaptive=AdaptiveOptions(**adaptive)))


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(("optimizer", "lossy"), [
    (lambda p: torch.optim.SGD(p, lr=0.1), "always"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4), "always"),
    (lambda p: torch.optim.ASGD(p, lr=0.1), "always"),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), "never"),
    (lambda p: torch.optim.Adam(p, lr=1e-3), "never"),
    (lambda p: torch.optim.Adagrad(p, lr=1e-2), "never"),
    (lambda p: torch.optim.RMSprop(p, lr=1e-2), "never"),
    (lambda p: torch.optim.Rprop(p, lr=1e-2), "never"),  # sign-based: not linear either
])
def test_auto_offers_the_lossy_rungs_only_to_optimizers_linear_in_the_gradient(optimizer, lossy):
    resolved = resolve_options(_options(), optimizer(_params()))
    assert resolved.compression.adaptive.lossy == lossy
    # nothing else changes (a DDP run: not sharded)
    assert resolved.compression.adaptive.model_dump(exclude={"lossy"}) == AdaptiveOptions().model_dump(exclude={"lossy"})


def test_a_sharded_run_is_resolved_in_the_same_copy():
    options = TrainOptions(strategy="fsdp", compression=CompressionSection(adaptive=AdaptiveOptions()))
    resolved = resolve_options(options, torch.optim.AdamW(_params()))
    assert (resolved.compression.adaptive.sharded, resolved.compression.adaptive.lossy) == (True, "never")
    assert (options.compression.adaptive.sharded, options.compression.adaptive.lossy) == (False, "auto")
    # the rest as given, but local steps' min_gain, resolved from the optimizer
    assert resolved.compression.local.min_gain == 1.0 and options.compression.local.min_gain == "auto"
    assert resolved.compression.model_dump(exclude={"adaptive", "local"}) == \
        options.compression.model_dump(exclude={"adaptive", "local"})


def test_an_explicit_choice_is_kept_and_auto_without_near_lossless_rungs_stays_lossy():
    adamw, sgd = torch.optim.AdamW(_params()), torch.optim.SGD(_params(), lr=0.1)
    assert resolve_options(_options(lossy="always"), adamw).compression.adaptive.lossy == "always"
    assert resolve_options(_options(lossy="never"), sgd).compression.adaptive.lossy == "never"
    # near_lossless: [] is the user's "lossy or dense": auto does not turn it into dense only
    assert resolve_options(_options(near_lossless=[]), adamw).compression.adaptive.lossy == "always"
