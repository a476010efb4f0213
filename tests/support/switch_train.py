"""A short ``raycomp.train`` run on the switched testbed, for tests/test_switch_train.py.

``python -m tests.support.switch_train SPEC.json`` runs as the driver inside the head node's
namespace, against the Ray cluster in ``RAY_ADDRESS``
(:func:`jobs.bench.cluster.ray_nodes` over a :class:`~jobs.bench.netns.switch.SwitchedNetwork`).
It waits for the spec's ``nodes`` Ray nodes, trains :func:`train_func` on ``workers`` ranks,
and writes ``<output>/driver.json`` (the run's status, rank 0's totals). Every rank writes
``<output>/rank<r>.json``: its node's address and network namespace, its ``GLOO_SOCKET_IFNAME``, and the digests of
its parameters (and optimizer state) before and after training; raycomp.train writes each
rank's step log (``<output>/steps/rank<r>.jsonl``: the plan version and digest of every step).

The model: a small MLP on synthetic, per-rank data (seeded by rank, so every rank's gradients
differ and only the collectives make the replicas agree), SGD with momentum, the schedule
policy: dense for ``WARMUP`` steps, Top-K 10 % (all-gather), then int8 (the scalable route)
from step ``INT8_FROM``: plan switches and both transports in one run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

EPOCHS, STEPS_PER_EPOCH, BATCH = 2, 10, 32
WARMUP, INT8_FROM = 2, 10


def digest(tensors: list[torch.Tensor]) -> str:
    """SHA-256 of the tensors' exact bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for group in optimizer.param_groups for p in group["params"]
            for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


def train_func(config: dict[str, Any]) -> dict[str, Any]:
    import ray
    import ray.train

    import raycomp.train
    from raycomp.config import (
        CompressionSection,
        ControllerSection,
        ScheduleOptions,
        ScheduleStage,
        compressor,
    )

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = digest(list(model.parameters()))
    options = raycomp.train.TrainOptions(
        compression=CompressionSection(
            policy="schedule", warmup_steps=WARMUP, min_compress_numel=0, levels="flat",
            schedule=ScheduleOptions(stages=[ScheduleStage(start_step=0, compressor=compressor("topk", ratio=0.1)),
                                             ScheduleStage(start_step=INT8_FROM, compressor=compressor("int8"))])),
        controller=ControllerSection(name=config["controller"], interval_steps=2, metrics_enabled=False),
        output_dir=config["output_dir"])
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    loop = raycomp.train.current()
    teacher = torch.Generator().manual_seed(1234)
    w_true = torch.randn(64, 10, generator=teacher)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for _ in loop.epochs(EPOCHS, STEPS_PER_EPOCH):
        for _ in range(loop.step_in_epoch, STEPS_PER_EPOCH):
            x = torch.randn(BATCH, 64, generator=gen)
            y = (x @ w_true).argmax(dim=1)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            raycomp.train.step(loss, samples=len(y))
        raycomp.train.report({})
    totals = raycomp.train.finish()
    params = list(model.parameters())
    mine = {"rank": rank, "node_ip": ray.util.get_node_ip_address(),
            "netns_inode": os.stat("/proc/self/ns/net").st_ino,  # which node's namespace it runs in
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "params_before": before, "params": digest(params), "optimizer": digest(_optimizer_tensors(optimizer)),
            "steps": totals["steps"], "world_size": ray.train.get_context().get_world_size()}
    Path(config["output_dir"], f"rank{rank}.json").write_text(json.dumps(mine))
    return totals


def join_cluster(spec: dict[str, Any]) -> Path:
    """Connect to the cluster in ``RAY_ADDRESS`` and wait (3 minutes at most) until the
    spec's ``nodes`` Ray nodes are alive; the spec's ``output`` directory, created."""
    import ray

    output = Path(spec["output"])
    output.mkdir(parents=True, exist_ok=True)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    deadline = time.time() + 180
    while sum(n["Alive"] for n in ray.nodes()) < spec["nodes"]:
        if time.time() > deadline:
            raise RuntimeError(f"only {sum(n['Alive'] for n in ray.nodes())} of {spec['nodes']} Ray nodes joined")
        time.sleep(0.5)
    return output


def main(spec_path: str) -> int:
    return drive(spec_path, train_func)


def drive(spec_path: str, train_func: Any) -> int:
    """One Ray Train fit of ``train_func`` on the spec's ``workers``, with raycomp's controller
    callback; its config: the controller's name and the output directory. Writes
    ``<output>/driver.json`` (status, what rank 0 returned, the fit's seconds); the exit status."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raycomp.train
    from raycomp.config import ControllerSection

    spec = json.loads(Path(spec_path).read_text())
    output = join_cluster(spec)
    name = spec["name"]
    callback = raycomp.train.ControllerCallback(ControllerSection(name=name, metrics_enabled=False))
    trainer = TorchTrainer(
        train_func, train_loop_config={"controller": name, "output_dir": str(output)},
        scaling_config=ScalingConfig(num_workers=spec["workers"]),
        run_config=RunConfig(name=name, storage_path=str(output / "ray-train"), callbacks=[callback]))
    started, report = time.time(), {}
    try:
        result = trainer.fit()
        report = {"status": "succeeded", "totals": result.return_value}
    except Exception as failure:  # noqa: BLE001 - the test reads it from driver.json
        report = {"status": "failed", "error": f"{type(failure).__name__}: {failure}"}
    report["fit_seconds"] = time.time() - started
    (output / "driver.json").write_text(json.dumps(report, default=str))
    return 0 if report["status"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
