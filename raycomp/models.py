"""Small models for the shipped workloads."""

from __future__ import annotations

import torch
from torch import nn


def mlp(inputs: int = 64, hidden: int = 512, classes: int = 10) -> nn.Module:
    """Two hidden layers; for digits (64 inputs) about 300k parameters."""
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def fashion_cnn(classes: int = 10) -> nn.Module:
    """A small CNN for 28x28 grey images (about 420k parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
        nn.Linear(128, classes),
    )


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024) -> float:
    model.eval()
    correct = sum(
        int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum())
        for i in range(0, len(y), batch)
    )
    model.train()
    return correct / len(y)
