"""Real data sets that ship as packages (nothing is downloaded at run time).

* ``digits``: scikit-learn's 1,797 8x8 handwritten digits (fast tests).
* ``fashion_mnist``: Debian ``dataset-fashion-mnist`` (60k/10k 28x28, gzipped IDX).
* ``kjv_corpus``: the King James Bible from Debian ``bible-kjv`` + ``bible-kjv-text``
  (31,102 verses, 4,139,037 characters, 63 symbols) for a char-level language model.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
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


FASHION_MNIST_FILES = tuple(
    f"{split}-{kind}-idx{dims}-ubyte.gz"
    for split in ("train", "t10k")
    for kind, dims in (("images", 3), ("labels", 1))
)


def idx_header(path: Path) -> tuple[int, ...]:
    """The dimensions an IDX file declares (reads only its header): a cheap validity check."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or head[:3] != b"\x00\x00\x08":
            raise ValueError(f"{path}: not an unsigned-byte IDX file")
        dims = f.read(4 * head[3])
    if len(dims) != 4 * head[3]:
        raise ValueError(f"{path}: header cut short")
    return tuple(int(d) for d in np.frombuffer(dims, dtype=">u4"))


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


KJV_PACKAGES = "bible-kjv bible-kjv-text"
KJV_VERSES = 31_102
_VERSE = re.compile(r"^ +\d+ (.*)$")


def _dump_kjv() -> str:
    """Every verse from the ``bible`` program, as clean running text.

    Pretty-printed output is a ``Book N`` heading per chapter and ``  V text`` per verse;
    ``-l 10000`` keeps each verse on one line (the longest is 528 characters). We keep only
    the verse text, one verse per line and a blank line between chapters: the headings and
    verse numbers are the tool's typesetting, and counting them would waste model capacity.
    """
    exe = shutil.which("bible")
    if exe is None:
        raise FileNotFoundError(
            f"the 'bible' program is not on PATH: install the Debian packages {KJV_PACKAGES}"
        )
    run = subprocess.run(  # stdin closed: with no terminal it never waits for commands
        [exe, "-l", "10000", "Gen1:1-Rev22:21"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
    )
    if run.returncode != 0:  # e.g. "Cannot open data file bible.data" without bible-kjv-text
        raise FileNotFoundError(
            f"'{exe}' failed ({run.stderr.strip()}): install the Debian packages {KJV_PACKAGES}"
        )
    chapters: list[list[str]] = []
    for line in run.stdout.splitlines():
        if verse := _VERSE.match(line):
            chapters[-1].append(verse[1].rstrip())
        elif line.strip():  # a "Book N" heading starts a chapter
            chapters.append([])
    if (n := sum(map(len, chapters))) != KJV_VERSES:  # a format change must not go unnoticed
        raise RuntimeError(f"'{exe}' gave {n} verses, expected {KJV_VERSES}")
    return "\n\n".join("\n".join(c) for c in chapters) + "\n"


def kjv_text(cache_dir: Path | None = None) -> str:
    """The KJV text, dumped once and cached as ``kjv.txt``.

    The cache lives in ``cache_dir``, else ``$RAYCOMP_CACHE_DIR``, else ``~/.cache/raycomp``.
    It is written to a temp file and renamed, so ranks that race to fill it never read a
    partial file.
    """
    path = kjv_cache_file(cache_dir)
    root = path.parent
    if path.exists():
        return path.read_text(encoding="utf-8")
    text = _dump_kjv()
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".kjv.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return text


def kjv_cache_file(cache_dir: Path | None = None) -> Path:
    root = Path(cache_dir or os.environ.get("RAYCOMP_CACHE_DIR") or Path.home() / ".cache/raycomp")
    return root / "kjv.txt"


def windows(tokens: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-char pairs: ``x = tokens[o : o + block]``, ``y`` the same shifted by one."""
    w = tokens[offsets.unsqueeze(1) + torch.arange(block + 1)]
    return w[:, :-1], w[:, 1:]


@dataclass
class CharCorpus:
    """A character vocabulary (sorted unique chars) and a contiguous train/test split.

    The test split is the tail of the text rather than random windows, so no test
    window overlaps a training one.
    """

    vocab: str
    train: torch.Tensor  # 1-D int64 tokens
    test: torch.Tensor
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._index = {c: i for i, c in enumerate(self.vocab)}

    @classmethod
    def from_text(cls, text: str, test_fraction: float = 0.05) -> CharCorpus:
        vocab = "".join(sorted(set(text)))
        tokens = cls(vocab, torch.empty(0), torch.empty(0)).encode(text)
        n_train = len(tokens) - int(len(tokens) * test_fraction)
        return cls(vocab, tokens[:n_train], tokens[n_train:])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        """Tokens for ``text``; a character outside the vocabulary raises KeyError."""
        ids = np.fromiter(map(self._index.__getitem__, text), dtype=np.int64, count=len(text))
        return torch.from_numpy(ids)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.vocab[i] for i in tokens.tolist())

    def sample(
        self, split: str, batch_size: int, block: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows at uniform random offsets drawn from ``generator`` only."""
        tokens = self._split(split)
        offsets = torch.randint(len(tokens) - block, (batch_size,), generator=generator)
        return windows(tokens, offsets, block)

    def batch_at(
        self, split: str, epoch: int, step: int, rank: int, world_size: int,
        batch_size: int, block: int, seed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s share of global batch ``step`` of ``epoch``, computed directly.

        The global batch of ``world_size * batch_size`` windows depends only on
        ``(seed, epoch, step)`` and each rank takes its slice, so a job resumes exactly
        at any step, and ranks together see what one process with the whole batch would.
        """
        key = np.random.SeedSequence([seed, epoch, step]).generate_state(2, np.uint32)
        generator = torch.Generator().manual_seed(int(key[0]) << 32 | int(key[1]))
        x, y = self.sample(split, world_size * batch_size, block, generator)
        mine = slice(rank * batch_size, (rank + 1) * batch_size)
        return x[mine], y[mine]

    def epoch_batches(
        self, split: str, epoch: int, rank: int, world_size: int, batch_size: int,
        block: int, steps: int, seed: int = 0, start: int = 0,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches ``start .. steps - 1`` of ``epoch`` for ``rank`` (see ``batch_at``)."""
        for step in range(start, steps):
            yield self.batch_at(split, epoch, step, rank, world_size, batch_size, block, seed)

    def _split(self, name: str) -> torch.Tensor:
        if name not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', not {name!r}")
        return self.train if name == "train" else self.test


def kjv_corpus(cache_dir: Path | None = None, max_chars: int | None = None) -> CharCorpus:
    """The KJV as a ``CharCorpus``; ``max_chars`` keeps only the first characters (fast tests)."""
    return CharCorpus.from_text(kjv_text(cache_dir)[:max_chars])
