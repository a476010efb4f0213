"""The DDP communication hook, and the same reduction for a plain list of gradients.

Usage, like torch's ``powerSGD_hook``::

    ddp_model = DistributedDataParallel(model, bucket_cap_mb=raycomp.bucket_cap_mb(model))
    state = raycomp.CompressionState(ddp_model, plan=raycomp.Plan.uniform("topk", ratio=0.01))
    ddp_model.register_comm_hook(state, raycomp.compression_hook)
    ...
    state.set_plan(new_plan)        # takes effect at the next step, on this rank

Without DDP (e.g. a custom data-parallel loop)::

    state = raycomp.CompressionState(model, plan=...)
    loss.backward()
    state.allreduce_gradients()     # replaces each .grad by the compressed mean

The hook reduces each bucket in the background and returns a future, so backward keeps
computing the next buckets while this one communicates. Two threads share the work
(:mod:`raycomp._internal.ddp.overlap`): one compresses each bucket and issues its
collectives (in bucket order, which is the same on every rank), the other waits for them and
decodes. So the next bucket is compressed while this one is on the wire, and the link is not
idle while a thread encodes. A dense step (a plan that sends every layer dense) has nothing
to encode: its all-reduces are issued from DDP's own thread, as torch's all-reduce hook
does, and only the waiting is handed over; when nothing is held in error feedback or
profiled (Top-K errors) either, it is a plain step and no thread is involved: each bucket is
all-reduced in place and a callback of the collective ends the step
(:mod:`raycomp._internal.ddp.plain_step`). The overlap needs several buckets: DDP's default
gives a model under 25 MB two, :func:`raycomp.bucket_cap_mb` about eight
(raycomp._internal.ddp.buckets). Gradient accumulation with ``no_sync()`` needs nothing
special: DDP calls the hook only on the step outside it, with the accumulated gradients.

The hook's state, its own process group and DDP's unused parameters:
:mod:`raycomp._internal.ddp.state`.
"""

# no "from __future__ import annotations": DDP checks the hook's annotations at run time

import time

import torch
import torch.distributed as dist

from raycomp._internal.ddp.state import CompressionState
from raycomp._internal.transports import Pending, buffer_view

__all__ = ["CompressionState", "compression_hook"]


def compression_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's compressed mean, per parameter as the plan says."""
    buffer = bucket.buffer()
    if state.inside_node:
        return state.reduce_inside_node(buffer)
    if state.plain_in_hook():
        return state.plain.reduce_bucket(bucket, buffer)
    names = [state.name_of(p) for p in bucket.parameters()]
    grads = bucket.gradients()
    last = bucket.is_last()
    handed_over = time.perf_counter()
    if last and state.defer_unused:
        state.settle_after_backward()

    def send() -> Pending[list[torch.Tensor]]:
        return state.start(names, grads, closes_step=last, overwrite=True)  # the result replaces them

    def receive(means: list[torch.Tensor]) -> torch.Tensor:
        out = buffer_view(means) if means else buffer  # dense: already one buffer, often the bucket's
        if out is None:
            out = torch.cat([m.reshape(-1) for m in means])
        if out.numel() != buffer.numel():
            raise RuntimeError(f"bucket buffer has {buffer.numel()} elements, gradients {out.numel()}")
        if last:
            state.end_step()
        if last or not state.overlaps:  # what backward, or the step after it, waited for
            state.comm_seconds += time.perf_counter() - handed_over
        return out.to(buffer.dtype).view(buffer.shape)

    return state.submit(send, receive, buffer.device)
