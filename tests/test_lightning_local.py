"""Local steps under Lightning: ``compression.local.mode=fixed`` through
:class:`raycomp.integrations.lightning.RaycompStrategy` on a real Ray (2 workers, gloo):
Lightning's own optimizer step, replicas that drift apart between syncs and agree after
each, one outer step every H optimizer steps, and the replicas merged at the last step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pl = pytest.importorskip("lightning.pytorch")

from tests.gpu.support import same_on_every_rank  # noqa: E402
from tests.support.controller_fit import fit_with_controller  # noqa: E402
from tests.support.lightning_classifier import (  # noqa: E402
    Classifier,
    lightning_trainer,
    loaders,
    options,
    static,
)

H = 3  # 16 optimizer steps: the last one falls between two syncs


class Agreement(pl.Callback):
    """After every optimizer step: whether the two ranks hold the same weights."""

    def __init__(self) -> None:
        self.equal: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.equal.append(same_on_every_rank(list(pl_module.parameters())))


def _train_func(config: dict) -> None:
    import ray.train

    from raycomp.config import LocalSection
    from raycomp.integrations.lightning import RaycompStrategy

    rank = ray.train.get_context().get_world_rank()
    strategy = RaycompStrategy(options(config, "local", **static("int8"),
                                       # each sync waited for at once, so the replicas agree right after it
                                       local=LocalSection(mode="fixed", sync_every=H, compressor="int8", delay=0)))
    agreement = Agreement()
    train, val = loaders(seed=rank)
    trainer = lightning_trainer(strategy, epochs=1, callbacks=[agreement])
    trainer.fit(Classifier(), train, val)
    steps = strategy.loop.strategy.state.steps
    out = {"equal": agreement.equal, "outer_steps": steps.outer_steps, "per_step": strategy.loop.strategy.per_step,
           "totals": strategy.totals}
    Path(config["output_dir"]).mkdir(parents=True, exist_ok=True)
    Path(config["output_dir"], f"rank{rank}.json").write_text(json.dumps(out, default=str))


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_lightning_trains_with_local_steps_and_every_sync_leaves_the_ranks_equal(ray_cluster, tmp_path):
    fit_with_controller(_train_func, tmp_path, "lightning-local")
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    equal = ranks[0]["equal"]
    assert len(equal) == 16  # one epoch: 512 samples / (2 ranks x 16)
    assert not ranks[0]["per_step"]
    # one outer step every H steps, and one more at the last step (Lightning's step budget)
    assert ranks[0]["outer_steps"] == ranks[1]["outer_steps"] == 16 // H + 1
    # the replicas agree exactly after the H-th step of each interval and after the last
    # step, which merges them before Lightning's last validation and checkpoint; only then
    assert equal == [(step + 1) % H == 0 or step == 15 for step in range(16)]
    totals = ranks[0]["totals"]
    assert 0 < totals["wire_bytes_total"] < 0.3 * totals["dense_bytes_total"]  # int8 pseudo-gradients
