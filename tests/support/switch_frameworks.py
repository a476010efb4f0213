"""Lightning and the Hugging Face Trainer in two levels on the switched testbed, for
tests/test_switch_frameworks.py.

``python -m tests.support.switch_frameworks SPEC.json`` runs as the driver inside the head
node's namespace, against the Ray cluster in ``RAY_ADDRESS`` (as
:mod:`tests.support.switch_runs`). One Ray Train fit on ``workers`` ranks trains, in turn,
Lightning with ``RaycompStrategy`` (tests/support/lightning_classifier.py) and the Hugging
Face Trainer under raycomp's ``prepare_trainer`` (tests/support/gpt2_trainer.py's two-layer
GPT-2), each with int8 from the first step and ``compression.levels`` at its default
(auto: the topology from Ray Train's context). Every rank writes ``<output>/<framework>/
rank<r>.json``: the reducer its hook used, where it ran, the digest of its parameters at
the end and the run's totals; raycomp writes each rank's step log.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.support.switch_train import digest, drive


def _mine(loop: Any, params: list, output: Path, rank: int, totals: dict[str, Any]) -> None:
    import ray
    import ray.train

    mine = {"rank": rank, "node_ip": ray.util.get_node_ip_address(), "params": digest(params),
            "reducer": type(loop.state.reducer).__name__, "world_size": ray.train.get_context().get_world_size(),
            "wire_bytes_total": totals["wire_bytes_total"], "intra_node_bytes_total": totals["intra_node_bytes_total"],
            "output_dir": loop.output_dir.as_posix()}
    output.mkdir(parents=True, exist_ok=True)
    (output / f"rank{rank}.json").write_text(json.dumps(mine))


def train_func(config: dict[str, Any]) -> None:
    import ray.train

    from raycomp.integrations.lightning import RaycompStrategy
    from raycomp.integrations.transformers import prepare_trainer
    from tests.support import gpt2_trainer as hf
    from tests.support import lightning_classifier as lightning

    rank = ray.train.get_context().get_world_rank()
    output = Path(config["output_dir"])

    strategy = RaycompStrategy(lightning.options(config, "lightning", **lightning.static("int8")))
    trainer = lightning.lightning_trainer(strategy, epochs=1)
    train, val = lightning.loaders()
    model = lightning.Classifier()
    trainer.fit(model, train, val)
    _mine(strategy.loop, list(model.parameters()), output / "lightning", rank, strategy.totals)

    trainer = prepare_trainer(hf.hf_trainer(f"{config['output_dir']}/hf-work", epochs=1),
                              hf.options(config, "hf", **hf.static("int8")))
    trainer.train()
    _mine(trainer.raycomp.loop, list(trainer.model.parameters()), output / "hf", rank, trainer.raycomp.totals)


def main(spec_path: str) -> int:
    return drive(spec_path, train_func)


if __name__ == "__main__":
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    sys.exit(main(sys.argv[1]))
