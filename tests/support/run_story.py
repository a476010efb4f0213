"""Runs whose story ``raycomp inspect`` and rank 0's log tell, for tests/test_run_story.py.

:func:`held_dense` trains a small model in a real Ray Train fit that stays dense all run:
one worker (nothing to reduce), or two workers under Adam with a step's compute padded by
a sleep, so that the link's communication is a small fraction of it (lossy rungs off, and
the near-lossless ones cannot pay). It returns the run's directory and the worker logs
written during it (where rank 0's ``raycomp.train`` lines land).

:func:`write_run` writes a run's files by hand: the step logs of ``ranks`` ranks, a plan
timeline and, if given, a summary.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

STEPS = 30
INTERVAL = 5


def _train(config: dict[str, Any]) -> dict[str, Any]:
    import torch

    import raycomp.train
    from raycomp.config import ControllerSection
    from raycomp.train import TrainOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    if config["optimizer"] == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    options = TrainOptions(output_dir=config["output_dir"],
                           controller=ControllerSection(name=config["controller"], interval_steps=INTERVAL))
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    for _ in range(STEPS):
        time.sleep(config["compute_pad_s"])  # a step's compute, as a larger model's would be
        loss = model(torch.randn(8, 64)).pow(2).mean()
        loss.backward()
        raycomp.train.step(loss, samples=8)
    return raycomp.train.finish()


def held_dense(storage: Path, name: str, workers: int, optimizer: str, compute_pad_s: float = 0.0) -> SimpleNamespace:
    """A finished run that stays dense (the ``ray_cluster`` fixture's Ray must be up)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raycomp.train
    from raycomp.config import ControllerSection

    name = name[:60]
    directory = storage / name / "out"
    callback = raycomp.train.ControllerCallback(ControllerSection(name=name, metrics_enabled=False))
    started = time.time()
    result = TorchTrainer(_train, train_loop_config={"controller": name, "output_dir": str(directory),
                                                     "optimizer": optimizer, "compute_pad_s": compute_pad_s},
                          scaling_config=ScalingConfig(num_workers=workers),
                          run_config=RunConfig(name=name, storage_path=str(storage), callbacks=[callback])).fit()
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    worker_logs = [p.read_text(errors="replace") for p in logs.glob("worker-*.err") if p.stat().st_mtime >= started]
    return SimpleNamespace(directory=directory, worker_logs=worker_logs, totals=result.return_value)


def write_run(directory: Path, ranks: int = 1, steps: int = 6, timeline: list[dict[str, Any]] | None = None,
              summary: dict[str, Any] | None = None, fallback: tuple[int, ...] = ()) -> None:
    """A run's files by hand: ``steps`` steps of each of ``ranks`` ranks, plan v0 at step 0
    and v1 (compressed: a quarter of dense's bytes) after, held dense by the guard over the
    steps in ``fallback``."""
    (directory / "steps").mkdir(parents=True)
    for rank in range(ranks):
        wire = dense = 0.0
        records = []
        for s in range(steps):
            held = s < 1 or s in fallback
            dense += 400.0
            wire += 400.0 if held else 100.0
            records.append({"step": s, "plan_version": 0 if s < 1 else 1, "fallback": s in fallback, "dense": held,
                            "loss": 1.0 / (s + 1), "wire_bytes": wire, "dense_bytes": dense})
        (directory / "steps" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if timeline is not None:
        (directory / "plans.jsonl").write_text("".join(json.dumps(e) + "\n" for e in timeline))
    if summary is not None:
        (directory / "summary.json").write_text(json.dumps(summary))


__all__ = ["INTERVAL", "STEPS", "held_dense", "write_run"]
