"""The small MLP of the FSDP tests (tests/test_sharded.py, tests/test_sharded_levels.py),
each rank's batch, and what a sharded reduction must give, computed without any collective."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BATCH", "IN", "OUT", "local_norm", "mlp", "mlp_batch", "reference_mean_grads"]

IN, OUT, BATCH = 24, 8, 16


def mlp() -> nn.Module:
    """Three linear layers (units "0", "2", "4"), the same weights every time."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 96), nn.ReLU(), nn.Linear(96, 80), nn.ReLU(), nn.Linear(80, OUT))


def mlp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s regression batch at ``step``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def reference_mean_grads(world: int, step: int) -> dict[str, torch.Tensor]:
    """The mean over ranks of each rank's gradient, computed here without any collective."""
    total: dict[str, torch.Tensor] = {}
    for r in range(world):
        model = mlp()
        x, y = mlp_batch(r, step)
        nn.functional.mse_loss(model(x), y).backward()
        for name, p in model.named_parameters():
            total[name] = total.get(name, 0) + p.grad / world
    return total


def local_norm(rank: int, step: int) -> float:
    """This rank's own (unreduced) gradient norm, computed without any collective."""
    model = mlp()
    x, y = mlp_batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
