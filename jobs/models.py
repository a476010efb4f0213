"""Small models for the shipped workloads."""

from __future__ import annotations

import torch
from torch import nn

from jobs.data import windows


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


def bn_cnn(classes: int = 10, channels: int = 32, hidden: int = 384) -> nn.Module:
    """A BatchNorm CNN for 28x28 grey images whose parameters sit mostly in one wide layer.

    Three 3x3 conv + BatchNorm + ReLU blocks (``channels``, 2x, 4x; the last two halve the
    resolution to 7x7), then ``4*channels*49 -> hidden`` (+ BatchNorm) ``-> classes``. With the
    defaults: 2,506,346 parameters, 93% of them in the first linear layer. The convolutions
    cost the compute, the linear layer the communication, which is what makes it
    communication-bound at 100 Mbit/s with a per-worker batch of a few dozen images.
    """
    c = channels
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 4 * c, 3, padding=1, bias=False), nn.BatchNorm2d(4 * c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * c * 7 * 7, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024) -> float:
    was_training = model.training
    model.eval()  # BatchNorm: running statistics, so the result depends on the weights only
    correct = sum(
        int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum())
        for i in range(0, len(y), batch)
    )
    model.train(was_training)
    return correct / len(y)


class CharTransformer(nn.Module):
    """A pre-norm causal decoder: token + learned position embeddings, then self-attention."""

    def __init__(self, vocab_size: int, block: int, d_model: int, heads: int, layers: int,
                 dropout: float) -> None:
        super().__init__()
        self.block = block
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(block, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout, activation="gelu", batch_first=True,
            norm_first=True,  # pre-norm trains stably at a high learning rate without warm-up
        )
        # nested tensors only help with padding masks, and they warn with norm_first
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.block:
            raise ValueError(f"sequence of {t} tokens is longer than block={self.block}")
        h = self.tokens(x) + self.positions(torch.arange(t, device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def char_transformer(vocab_size: int, block: int = 64, d_model: int = 128, heads: int = 4,
                     layers: int = 2, dropout: float = 0.0) -> nn.Module:
    """Char-level LM returning logits (B, T, vocab); defaults are about 420k parameters."""
    return CharTransformer(vocab_size, block, d_model, heads, layers, dropout)


class CharLSTM(nn.Module):
    """Token embedding, a stacked LSTM, a linear head: the recurrent counterpart of
    :class:`CharTransformer` (its weight matrices are what PowerSGD compresses)."""

    def __init__(self, vocab_size: int, d_model: int, layers: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.lstm = nn.LSTM(d_model, d_model, layers, batch_first=True)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.tokens(x))[0])


def char_lstm(vocab_size: int, d_model: int = 256, layers: int = 2) -> nn.Module:
    """Char-level LM returning logits (B, T, vocab); the defaults are about 1.1M parameters."""
    return CharLSTM(vocab_size, d_model, layers)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats over every position."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate_lm(model: nn.Module, tokens: torch.Tensor, block: int, batches: int = 8,
                batch_size: int = 32) -> float:
    """Mean cross-entropy on ``batches * batch_size`` windows evenly spaced over ``tokens``.

    Fixed offsets (no RNG) make evaluations comparable across runs and ranks.
    """
    offsets = torch.linspace(0, len(tokens) - block - 1, batches * batch_size).long()
    was_training = model.training
    model.eval()
    total = 0.0
    for chunk in offsets.split(batch_size):
        x, y = windows(tokens, chunk, block)
        total += float(lm_loss(model(x), y)) * len(chunk)
    model.train(was_training)
    return total / len(offsets)
