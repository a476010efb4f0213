"""The Hugging Face Accelerate snippet of docs/usage.md, as written there, on two real gloo
processes: accelerate's prepared DDP model takes raycomp's hook, and every gradient goes
through it (fewer bytes than dense on the wire, the same weights on both ranks)."""

from __future__ import annotations

import os
import re

import pytest

from tests.distributed import run_distributed
from tests.support.repo import REPO

pytest.importorskip("accelerate")

HEADING = "### Hugging Face Accelerate (a loop of your own)"


def snippet() -> str:
    """The first Python block under the Accelerate heading of docs/usage.md."""
    text = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    assert HEADING in text, f"docs/usage.md has no section {HEADING!r}"
    block = re.search(r"```python\n(.*?)```", text.split(HEADING, 1)[1], re.S)
    assert block, "no Python snippet in the Accelerate section"
    return block.group(1)


def _accelerate_loop(rank: int, world_size: int, code: str) -> dict:
    import torch
    from torch import nn

    # what `accelerate launch --cpu` sets; the process group is already up (FileStore)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), ACCELERATE_USE_CPU="true",
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    torch.manual_seed(0)  # the same initial weights on both ranks
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(320, 64, generator=torch.Generator().manual_seed(1))
    y = (x @ torch.randn(64, 10, generator=torch.Generator().manual_seed(2))).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scope = {"model": model, "optimizer": optimizer, "loader": loader, "loss_fn": nn.functional.cross_entropy}
    exec(compile(code, "docs/usage.md (Accelerate)", "exec"), scope)  # noqa: S102 - the documented snippet
    state, prepared = scope["state"], scope["model"]
    return {"ddp": isinstance(prepared, nn.parallel.DistributedDataParallel),
            "distributed": str(scope["accelerator"].distributed_type),
            "steps": len(scope["loader"]),
            "wire": state.ledger.wire_total, "dense": state.ledger.dense_total,
            "weights": [p.detach().clone() for p in prepared.parameters()]}


def test_the_accelerate_snippet_sends_every_gradient_through_raycomps_hook():
    ranks = run_distributed(_accelerate_loop, 2, snippet(), timeout=300)
    for r in ranks:
        assert r["ddp"] and r["distributed"] == "DistributedType.MULTI_CPU"
        assert r["steps"] == 5  # accelerate's loader: 320 samples, 32 a batch, split over 2 ranks
        assert r["dense"] > 0, "the hook saw no gradient"
        # PowerSGD rank 2 on the two matrices, the biases dense: far fewer bytes than dense
        assert r["wire"] < r["dense"] / 5, (r["wire"], r["dense"])
    first, second = ranks
    assert first["dense"] == second["dense"] and first["wire"] == second["wire"]
    for a, b in zip(first["weights"], second["weights"], strict=True):
        assert (a == b).all()  # both ranks applied the same compressed mean
