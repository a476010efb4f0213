"""Fixtures of the GPU tests; without a CUDA device every test here is skipped.

``ranks`` runs a check twice: on NCCL in this process (one GPU, so world size 1) and on
two gloo ranks with CUDA tensors (see ``tests/gpu/ranks.py``). ``note`` keeps what a test
measured (host syncs, losses, times); the notes are printed at the end of the run and,
with ``RAYCOMP_GPU_NOTES=FILE``, written to FILE as JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.gpu.ranks import Nccl, TwoRanks, two_rank_results
from tests.gpu.support import CUDA, free_port

HERE = Path(__file__).resolve().parent
NO_CUDA = ("no CUDA device (torch.cuda.is_available() is False); "
           "the GPU tests run on a machine with one: scripts/run-gpu-tests.sh")
NOTES = pytest.StashKey[list[tuple[str, str]]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str | None:
    if not torch.cuda.is_available():
        return None
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"


@pytest.fixture(scope="session")
def nccl_group() -> Iterator[None]:
    """The default process group: NCCL, this process alone (world size 1)."""
    torch.cuda.set_device(CUDA)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TwoRanks:
    """The test module's ``TWO_RANKS`` checks, run on two gloo ranks (one pair per module)."""
    return two_rank_results(request.module, tmp_path_factory.mktemp("gloo"))


@pytest.fixture(scope="module", params=["nccl-w1", "gloo-w2"])
def ranks(request: pytest.FixtureRequest) -> Nccl | TwoRanks:
    """Where a check runs: NCCL here at world size 1, or on two gloo ranks."""
    if request.param == "nccl-w1":
        request.getfixturevalue("nccl_group")
        return Nccl()
    return request.getfixturevalue("two_ranks")


@pytest.fixture
def note(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Keeps a measurement of this test for the run's summary."""
    notes = request.config.stash.setdefault(NOTES, [])

    def add(text: str) -> None:
        if text:
            notes.append((request.node.nodeid, text))

    return add


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    notes = config.stash.get(NOTES, [])
    if not notes:
        return
    terminalreporter.section("what the GPU tests measured")
    for nodeid, text in notes:
        terminalreporter.write_line(f"{nodeid.removeprefix('tests/gpu/')}: {text}")
    path = os.environ.get("RAYCOMP_GPU_NOTES")
    if path:
        Path(path).write_text(json.dumps([{"test": n, "note": t} for n, t in notes], indent=1))
