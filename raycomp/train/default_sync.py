"""raycomp's own gradient sync factory, the default of :func:`raycomp.train.prepare_model`:

* ``strategy="ddp"``: DDP with raycomp's comm hook (compressed all-reduce per bucket,
  :class:`raycomp.train.ddp_sync.DdpSync`);
* ``compression.local.mode`` ``fixed`` or ``auto``: the same, or local steps while the plan
  says so (:class:`raycomp.train.local_sync.LocalSync`);
* ``strategy="fsdp"``: FSDP2 with a compressed reduce-scatter per ``fully_shard`` unit
  (:class:`raycomp.train.sharding.FsdpSync`).

Each is imported when chosen (FSDP2's and local steps' modules stay unloaded in a DDP run).
"""

from __future__ import annotations

import torch

from raycomp.train.gradient_sync import GradientSync, SyncSetup

__all__ = ["raycomp_sync"]


def raycomp_sync(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: SyncSetup) -> GradientSync:
    """raycomp's compressed communication for ``setup.options.strategy`` (the default factory)."""
    if setup.options.strategy == "fsdp":
        from raycomp.train.sharding import fsdp_sync

        return fsdp_sync(model, optimizer, setup)
    if setup.options.compression.local.mode != "off":
        from raycomp.train.local_sync import local_sync

        return local_sync(model, optimizer, setup)
    from raycomp.train.ddp_sync import ddp_sync

    return ddp_sync(model, optimizer, setup)
