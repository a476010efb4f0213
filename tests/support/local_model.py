"""The small model and the per-rank data of the local-step tests (tests/test_local_steps.py,
tests/test_local_train.py): every rank starts from the same weights and sees its own
batches, so the replicas drift apart between syncs."""

from __future__ import annotations

import torch

__all__ = ["batch_of", "inner_step", "small_model"]


def small_model(seed: int = 0, batchnorm: bool = False) -> torch.nn.Module:
    """A tanh MLP, 8 -> 64 -> 64 -> 4 (``batchnorm``: a BatchNorm1d after the first layer)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                     torch.nn.Tanh(), torch.nn.Linear(64, 4)]
    if batchnorm:
        layers.insert(1, torch.nn.BatchNorm1d(64))
    return torch.nn.Sequential(*layers)


def batch_of(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step`` (the ranks see different data)."""
    gen = torch.Generator().manual_seed(7919 * rank + step)
    x = torch.randn(16, 8, generator=gen) + rank  # the ranks see different data
    return x, torch.randint(0, 4, (16,), generator=gen)


def inner_step(model, opt, rank, step) -> None:
    """One optimizer step of ``model`` on rank ``rank``'s batch at ``step``."""
    x, y = batch_of(rank, step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
