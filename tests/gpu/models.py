"""The models and data of the GPU tests, built from their sizes with torch alone.

``jobs.workloads.model_of`` needs pydantic, PyYAML and the KJV text, which a GPU machine
may lack; these builders import only torch and raycomp's worker code.
``tests/test_device.py`` checks that :func:`kjv_transformer` is the shipped config's model.
"""

from __future__ import annotations

import torch
from torch import nn

from jobs.models import char_transformer
from raycomp.compressors import COMPRESSORS
from raycomp.plan import DENSE, CompressorSpec, Plan
from tests.gpu.support import PARAMS

__all__ = ["kjv_transformer", "mixed_model", "rule_tokens", "sharded_batch", "sharded_model"]


def kjv_transformer(device: torch.device) -> nn.Module:
    """The model ``jobs/configs/gpt_kjv.yaml`` trains (3,224,639 parameters), seed 0."""
    torch.manual_seed(0)
    return char_transformer(vocab_size=63, block=128, d_model=256, heads=4, layers=4).to(device)


def mixed_model(device: torch.device, width: int = 64) -> tuple[nn.Module, Plan]:
    """One ``width``-wide linear layer per registered compressor, and the plan that gives
    each layer its compressor (biases and the head dense)."""
    torch.manual_seed(0)
    names = list(COMPRESSORS)
    layers: list[nn.Module] = []
    for _ in names:
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 10))
    model = nn.Sequential(*layers).to(device)
    per_layer = {f"{2 * i}.weight": CompressorSpec.of(n, **PARAMS[n]) for i, n in enumerate(names)}
    return model, Plan.per_layer(per_layer, default=DENSE)


def sharded_model(device: torch.device) -> nn.Module:
    """Three linear layers (24 -> 96 -> 80 -> 8), seed 0: the FSDP tests' model."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 96), nn.ReLU(), nn.Linear(96, 80), nn.ReLU(), nn.Linear(80, 8)).to(device)


def sharded_batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 16 for ``sharded_model``: a fixed linear target plus a little noise."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 24, generator=g)
    w = torch.randn(24, 8, generator=torch.Generator().manual_seed(5)) / 5  # a learnable target
    return x.to(device), (x @ w + 0.05 * torch.randn(16, 8, generator=g)).to(device)


def rule_tokens(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``n`` tokens following a learnable rule (``t[i] = 5 t[i-1] + 3 mod vocab``), 10% noise."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.empty(n, dtype=torch.long)
    tokens[0] = 0
    noise = torch.rand(n, generator=g) < 0.1
    rand = torch.randint(0, vocab, (n,), generator=g)
    for i in range(1, n):
        tokens[i] = rand[i] if noise[i] else (tokens[i - 1] * 5 + 3) % vocab
    return tokens.to(device)
