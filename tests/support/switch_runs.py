"""Several short ``raycomp.train`` runs in one Ray Train fit on the switched testbed, for
tests/test_switch_modes.py: every transport per step, local steps, and a worker killed and
resumed, at W > 2.

``python -m tests.support.switch_runs SPEC.json`` runs as the driver inside the head node's
namespace, against the Ray cluster in ``RAY_ADDRESS`` (as :mod:`tests.support.switch_train`).
The spec: ``output``, ``nodes``, ``workers``, ``name``, ``max_failures`` (the fit's
``FailureConfig``) and ``runs``, each a dict:

* ``name``: the run's directory under ``output`` and its run id;
* ``kind``: ``"steps"`` (per step, the ``schedule`` policy over ``stages``: ``[start_step,
  compressor name, params]``), ``"layers"`` (per step, one plan fixed for the run with a
  compressor per layer, :mod:`tests.support.layer_plan_policy`: ``layers`` maps a parameter
  name to ``[compressor name, params]``) or ``"local"`` (``compression.local`` fixed, ``sync_every``,
  pseudo-gradients in ``local_compressor``, ``delay`` 0 unless the run says: every sync
  lands in the step it starts, so every rank holds the synchronised weights right after it);
* ``epochs``, ``steps_per_epoch``, ``warmup``; optional ``strategy`` (``"ddp"``, the
  default, or ``"fsdp"``: digests over each sharded tensor's full value), ``levels``,
  ``every_steps`` (step checkpoints) and ``kill`` (``{"rank": r, "step": s}``: that rank exits at step ``s``, once:
  :class:`jobs.faults.FaultInjector`).

The runs train in turn in one worker group. After a restart (a killed worker) the training
function starts over: a run every rank finished (``done.rank<r>`` markers) is skipped, the
interrupted one resumes from ``ray.train.get_checkpoint()`` (its own latest step checkpoint:
the kill comes after its first one). Each rank's data at a step is drawn from a generator
seeded by (rank, step), so a replayed step sees the same batch.

Every rank writes ``<run>/digests/rank<r>.jsonl``: after every step, the SHA-256 of its
parameters and optimizer state, the loop's outer steps, the plan's default compressor and,
in a ``"layers"`` run, ``routes`` (each layer's compressor the reducer built, by name, and
the transport it sends by) (a replayed step appends again: the last line of a step is what
the run ended with), and
``<run>/rank<r>.json`` at the end: the final digests (parameters, optimizer state, the
compression state: residuals, server residuals, PowerSGD's Q) and where it ran. raycomp.train
writes each rank's step log (``<run>/steps/rank<r>.jsonl``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.support.switch_train import _optimizer_tensors, digest, join_cluster

#: the ``"layers"`` kind's policy, by import path (the controller actor imports it)
LAYER_PLAN_POLICY = "tests.support.layer_plan_policy:LayerPlanPolicy"


def _full(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's whole value (a sharded DTensor's gathered: a collective, in order)."""
    return [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]


def _tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a nested state dict, in sorted-key order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _tensors(item)]
    return []


def _options(run: dict[str, Any], controller: str, run_dir: Path) -> Any:
    import raycomp.train
    from raycomp.config import (
        CheckpointSection,
        CompressionSection,
        ControllerSection,
        GuardSection,
        LocalSection,
        ScheduleOptions,
        ScheduleStage,
        StaticOptions,
        compressor,
    )

    if run["kind"] == "local":
        compression = CompressionSection(
            policy="static", warmup_steps=run["warmup"], min_compress_numel=0,
            static=StaticOptions(compressor=compressor("int8")),
            local=LocalSection(mode="fixed", sync_every=run["sync_every"], compressor=run["local_compressor"],
                               delay=run.get("delay", 0)), levels=run.get("levels", "flat"))
    elif run["kind"] == "layers":
        layers = {layer: {"name": name, **params} for layer, (name, params) in run["layers"].items()}
        compression = CompressionSection(policy=LAYER_PLAN_POLICY, custom_options={"layers": layers},
                                         warmup_steps=run["warmup"], min_compress_numel=0,
                                         levels=run.get("levels", "flat"))
    else:
        stages = [ScheduleStage(start_step=start, compressor=compressor(name, **params))
                  for start, name, params in run["stages"]]
        # the guard stays on, at its default threshold unless the run sets one
        compression = CompressionSection(policy="schedule", warmup_steps=run["warmup"], min_compress_numel=0,
                                         schedule=ScheduleOptions(stages=stages), levels=run.get("levels", "flat"),
                                         guard=GuardSection(max_compression_error=run.get(
                                             "max_error", GuardSection().max_compression_error)))
    return raycomp.train.TrainOptions(
        compression=compression, strategy=run.get("strategy", "ddp"),
        controller=ControllerSection(name=controller, interval_steps=2, metrics_enabled=False),
        checkpoint=CheckpointSection(every_steps=run.get("every_steps")),
        output_dir=str(run_dir), run_id=f"{run['name']}-{controller}"[:80], progress_every=0)


def _reducer(state: Any) -> Any:
    """The reducer inside a gradient strategy (DDP: its CompressionState's; local steps:
    the one their syncs use)."""
    while state is not None and not hasattr(state, "send_group"):
        state = getattr(state, "reducer", None) or getattr(state, "steps", None) or getattr(state, "state", None) \
            or getattr(state, "cross", None)
    return state


def _routes(state: Any, shapes: dict[str, torch.Size]) -> dict[str, list[str]]:
    """Each layer's compressor as the flat reducer built it, by registry name, and the
    transport it sends by under the plan in force (dense: too small, or a shape the
    compressor does not take). Only for a flat per-step run on a plan fixed for the run
    (``"layers"``): read after a step, every layer was routed under that plan, so asking
    the transport builds nothing (a compressor built here would change the state the run
    checkpoints)."""
    reducer = _reducer(state)
    return {name: [spec.name, reducer.transport_for(name, shapes[name]).value]
            for name, (spec, _) in sorted(reducer.router.compressors.items())}


def train_one(run: dict[str, Any], controller: str, run_dir: Path) -> dict[str, Any]:
    import ray
    import ray.train

    import raycomp.train

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = digest(list(model.parameters()))
    shapes = {name: p.shape for name, p in model.named_parameters()}
    model = raycomp.train.prepare_model(model, optimizer, options=_options(run, controller, run_dir))
    loop = raycomp.train.current()
    restored_from = loop.global_step
    if run.get("kill"):
        from jobs.faults import FaultInjector, FaultsSection

        FaultInjector(FaultsSection(kill_rank_at_step=run["kill"]["step"], kill_rank=run["kill"]["rank"]),
                      rank, run_dir).install(loop)
    w_true = torch.randn(64, 10, generator=torch.Generator().manual_seed(1234))
    steps_per_epoch = run["steps_per_epoch"]
    (run_dir / "digests").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "digests" / f"rank{rank}.jsonl", "a") as out:
        for _ in loop.epochs(run["epochs"], steps_per_epoch):
            for _ in range(loop.step_in_epoch, steps_per_epoch):
                step = loop.global_step
                gen = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)  # this rank's batch of this step
                x = torch.randn(32, 64, generator=gen)
                y = (x @ w_true).argmax(dim=1)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                raycomp.train.step(loss, samples=len(y))
                out.write(json.dumps({
                    "step": step, "params": digest(_full(list(model.parameters()))),
                    "optimizer": digest(_full(_optimizer_tensors(optimizer))), "outer_steps": loop.outer_steps,
                    "plan": loop.state.plan.default.name,
                    **({"routes": _routes(loop.state, shapes)} if run["kind"] == "layers" else {})}) + "\n")
                out.flush()
            raycomp.train.report({})
    compression = digest(_tensors(loop.state.state_dict()))
    totals = raycomp.train.finish()
    mine = {"rank": rank, "node_ip": ray.util.get_node_ip_address(),
            "netns_inode": os.stat("/proc/self/ns/net").st_ino,
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "params_before": before, "params": digest(_full(list(model.parameters()))),
            "optimizer": digest(_full(_optimizer_tensors(optimizer))), "compression": compression,
            "restored_from": restored_from, "steps": totals["steps"], "outer_steps": loop.outer_steps,
            "world_size": ray.train.get_context().get_world_size(), "pid": os.getpid(),
            "reducer": type(_reducer(loop.state)).__name__}
    (run_dir / f"rank{rank}.json").write_text(json.dumps(mine))
    if rank == 0:
        (run_dir / "totals.json").write_text(json.dumps(totals, default=str))
    (run_dir / f"done.rank{rank}").write_text(str(os.getpid()))
    return totals


def train_func(config: dict[str, Any]) -> dict[str, Any]:
    import ray.train

    world = ray.train.get_context().get_world_size()
    seconds = {}
    for run in config["runs"]:
        run_dir = Path(config["output"]) / run["name"]
        if all((run_dir / f"done.rank{r}").exists() for r in range(world)):
            continue  # finished before a restart of the worker group
        started = time.time()
        train_one(run, config["controller"], run_dir)
        seconds[run["name"]] = round(time.time() - started, 1)
    return seconds


def main(spec_path: str) -> int:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raycomp.train
    from raycomp.config import ControllerSection

    spec = json.loads(Path(spec_path).read_text())
    output = join_cluster(spec)
    name = spec["name"]
    callback = raycomp.train.ControllerCallback(ControllerSection(name=name, metrics_enabled=False))
    trainer = TorchTrainer(
        train_func, train_loop_config={"controller": name, "output": str(output), "runs": spec["runs"]},
        scaling_config=ScalingConfig(num_workers=spec["workers"]),
        run_config=RunConfig(name=name, storage_path=str(output / "ray-train"), callbacks=[callback],
                             failure_config=FailureConfig(max_failures=spec.get("max_failures", 0))))
    started, report = time.time(), {}
    try:
        result = trainer.fit()
        report = {"status": "succeeded", "run_seconds": result.return_value}
    except Exception as failure:  # noqa: BLE001 - the test reads it from driver.json
        report = {"status": "failed", "error": f"{type(failure).__name__}: {failure}"}
    report["fit_seconds"] = time.time() - started
    (output / "driver.json").write_text(json.dumps(report, default=str))
    return 0 if report["status"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
