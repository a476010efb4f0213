"""How big DDP's gradient buckets are when raycomp's hook compresses them.

DDP hands its comm hook one bucket of gradients at a time, as backward fills them; the
hook compresses and sends each bucket on a background thread (``raycomp._internal.ddp.hook``) while
backward computes the next. Only the last bucket's communication is left after backward.
DDP's default (a 1 MB first bucket, 25 MB for the rest) suits dense gradients on fast links.
For a model under about 25 MB of fp32 gradients it means two buckets, so nearly all of the
wire starts after backward has finished, and none of it overlaps.

:func:`bucket_cap_mb` cuts the model into about :data:`BUCKETS` buckets instead. Then all
but the last one's communication can run during backward. Each bucket is one more
collective round and one more pass through the reducer, so it does not go below DDP's own
first-bucket size. At DDP's default cap or above (a model of 200 MB or more) it leaves DDP's
default alone, 1 MB first bucket included.

Buckets change when a layer travels, not what it carries: smaller ones shorten a step on a
slow link and leave the loss as it was (``docs/benchmarks/history.md``, "The DDP bucket
cap").
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BUCKETS", "MAX_CAP_MB", "MIN_CAP_MB", "bucket_cap_mb", "ddp_kwargs", "gradient_mb"]

#: buckets a model is cut into; 4 to 13 gave the same step time (docs/benchmarks/history.md)
BUCKETS = 8
#: the bounds, MB: DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``) and its default cap
MIN_CAP_MB, MAX_CAP_MB = 1.0, 25.0


def gradient_mb(model: torch.nn.Module) -> float:
    """MB (2**20 bytes) of ``model``'s trainable gradients: what DDP's buckets hold."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20


def bucket_cap_mb(model: torch.nn.Module, buckets: int = BUCKETS) -> float:
    """A DDP ``bucket_cap_mb`` that cuts ``model``'s trainable gradients into about ``buckets``
    buckets, within [1, 25] MB. Use it when you wrap the model yourself::

        ddp = DistributedDataParallel(model, bucket_cap_mb=raycomp.bucket_cap_mb(model))

    A parameter is never split, so a model dominated by one large layer gets fewer buckets.
    """
    if buckets < 1:
        raise ValueError(f"buckets: must be >= 1, got {buckets!r}")
    return round(min(MAX_CAP_MB, max(MIN_CAP_MB, gradient_mb(model) / buckets)), 2)


def ddp_kwargs(compression: Any, model: torch.nn.Module) -> dict[str, Any]:
    """DDP options for ``ray.train.torch.prepare_model(model, parallel_strategy_kwargs=...)``.

    The bucket cap is ``compression.bucket_cap_mb``, where ``"auto"`` means
    :func:`bucket_cap_mb`, or no option at all (DDP's default) where that reaches 25 MB.
    """
    cap = compression.bucket_cap_mb
    if cap == "auto":
        cap = bucket_cap_mb(model)
        if cap >= MAX_CAP_MB:  # DDP's own default: its 1 MB first bucket stays
            return {}
    return {"bucket_cap_mb": float(cap)}
