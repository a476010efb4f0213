"""How fast the link inside a node is: timed once, when a two-level run starts.

The controller learns the link a flat dense step crosses from the steps themselves: with
several nodes that is the slow one between them. A two-level run also talks inside each
node (:mod:`raycomp._internal.reduce.two_level`): a compressed step reduce-scatters and all-gathers there,
and every inner step of local steps between nodes all-reduces the whole gradient there.
No flat dense step times that link, and a plan priced without it looks faster than it
steps. So every node times its own link once, before the run registers: a few all-reduces
of the model's gradient size over the node's group, as an inner step sends them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from raycomp._internal.topology import Levels

__all__ = ["PROBE_CAP_BYTES", "PROBE_ROUNDS", "node_seconds_per_byte"]

#: the largest buffer timed: past a few MB a ring's time grows with its bytes, so a larger
#: model is priced by the same seconds per byte without holding its size twice in memory
PROBE_CAP_BYTES = 32 << 20
PROBE_ROUNDS = 3  # timed all-reduces after one untimed (connections, buffers)


def node_seconds_per_byte(levels: Levels, nbytes: int, device: torch.device,
                          dtype: torch.dtype = torch.float32) -> float:
    """Seconds per byte a rank sends in an all-reduce over its node's group: the mean of
    :data:`PROBE_ROUNDS` all-reduces of ``nbytes`` (at most :data:`PROBE_CAP_BYTES`) of
    ``dtype`` on ``device``, over a ring's ``2 (L - 1) / L`` of the buffer.

    Collective over each node's group: every rank of the run calls it at the same point
    (each node times its own link at once). It waits for the node's slowest rank, as a
    step does."""
    intra = levels.intra
    element = torch.tensor([], dtype=dtype).element_size()
    buffer = torch.zeros(max(1, min(nbytes, PROBE_CAP_BYTES) // element), dtype=dtype, device=device)
    dist.all_reduce(buffer, group=intra.handle)
    _settle(device)
    started = time.perf_counter()
    for _ in range(PROBE_ROUNDS):
        dist.all_reduce(buffer, group=intra.handle)
    _settle(device)
    seconds = (time.perf_counter() - started) / PROBE_ROUNDS
    return seconds / intra.allreduce_bytes(buffer.numel() * element)


def _settle(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
