"""raycomp's own gradient strategy factory, the default of :func:`raycomp.train.prepare_model`:

* ``strategy="ddp"``: DDP with raycomp's comm hook (compressed all-reduce per bucket,
  :class:`raycomp._internal.train.ddp_strategy.DdpStrategy`);
* ``compression.local.mode`` ``fixed`` or ``auto``: the same, or local steps while the plan
  says so (:class:`raycomp._internal.train.local_strategy.LocalStepsStrategy`);
* ``strategy="fsdp"``: FSDP2 with a compressed reduce-scatter per ``fully_shard`` unit
  (:class:`raycomp._internal.train.sharding.FsdpStrategy`).

Each is imported when chosen (FSDP2's and local steps' modules stay unloaded in a DDP run).
"""

from __future__ import annotations

import torch

from raycomp._internal.train.gradient_strategy import GradientStrategy, StrategySetup

__all__ = ["raycomp_strategy"]


def raycomp_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> GradientStrategy:
    """raycomp's compressed communication for ``setup.options.strategy`` (the default factory)."""
    if setup.options.strategy == "fsdp":
        from raycomp._internal.train.sharding import fsdp_strategy

        return fsdp_strategy(model, optimizer, setup)
    if setup.options.compression.local.mode != "off":
        from raycomp._internal.train.local_strategy import local_strategy

        return local_strategy(model, optimizer, setup)
    from raycomp._internal.train.ddp_strategy import ddp_strategy

    return ddp_strategy(model, optimizer, setup)
