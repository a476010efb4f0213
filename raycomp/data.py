"""Real data sets that ship as packages (nothing is downloaded at run time).

* ``digits``: scikit-learn's 1,797 8x8 handwritten digits (fast tests).
* ``fashion_mnist``: Debian ``dataset-fashion-mnist`` (60k/10k 28x28, gzipped IDX).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


@dataclass
class Split:
    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)

    def shard(self, rank: int, world_size: int) -> Split:
        """This rank's disjoint share (every ``world_size``-th example)."""
        return Split(self.x[rank::world_size], self.y[rank::world_size])


def digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """sklearn digits as float features in [0, 1], shuffled once with ``seed``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = int(len(y) * test_fraction)
    return Split(x[n_test:], y[n_test:]), Split(x[:n_test], y[:n_test])


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (optionally gzipped): magic 0x0000, dtype byte, ndim byte, sizes, data."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(int)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {tuple(dims)} but holds {data.size} bytes")
    return data.reshape(dims)


def fashion_mnist(root: Path = FASHION_MNIST_DIR) -> tuple[Split, Split]:
    """Fashion-MNIST, normalised to zero mean / unit variance, shape (N, 1, 28, 28)."""
    root = Path(root)
    if not (root / "train-images-idx3-ubyte.gz").exists():
        raise FileNotFoundError(
            f"Fashion-MNIST not found in {root}: install the Debian package "
            "'dataset-fashion-mnist' (scripts/setup.sh does)"
        )

    def load(prefix: str) -> Split:
        images = read_idx(root / f"{prefix}-images-idx3-ubyte.gz")
        labels = read_idx(root / f"{prefix}-labels-idx1-ubyte.gz")
        x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 255.0
        return Split((x - 0.2860) / 0.3530, torch.tensor(labels, dtype=torch.int64))

    return load("train"), load("t10k")
