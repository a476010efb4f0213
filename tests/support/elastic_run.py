"""An elastic ``raycomp.train`` run on a Ray cluster of several nodes on this machine, for
tests/test_elastic.py: a node is lost mid-run, the run goes on on fewer workers, the node
comes back and the run grows back to its full size.

``python -m tests.support.elastic_run SPEC.json`` is the driver. It starts the cluster
itself (``ray.cluster_utils.Cluster``: a head and ``nodes - 1`` more nodes, each its own
raylet on loopback with ``cpus`` CPUs), builds raycomp's controller on the head before the
other nodes join (so that it is not on a node that is killed), and fits a ``TorchTrainer``
with ``ScalingConfig(num_workers=(min_workers, max_workers))`` and
``FailureConfig(max_failures=...)``. The spec: ``output``, ``name``, ``nodes``, ``cpus``,
``min_workers``, ``max_workers``, ``max_failures``, ``steps`` (total), ``every_steps``
(step checkpoints), ``compressor`` (``[name, params]``, the static plan after a two-step
warm-up), ``monitor_s`` (``elastic_resize_monitor_interval_s``) and optionally ``drill``:

* ``kill_after_step``: when the group at full size has done that step, every rank waits
  (a file marker) and the driver kills the last node: its raylet with SIGKILL
  (``Cluster.remove_node(allow_graceful=False)``), then any worker process of that node
  still alive. Ray Train fails the group, and restarts it from the latest checkpoint on
  the workers the remaining nodes hold.
* ``grow_after_step``: when the smaller group has done that step, every rank waits again
  and the driver adds a node back; the elastic policy sees the resources within
  ``monitor_s`` and restarts the group at full size from the latest checkpoint.
* ``drain_after_step``: when rank 0 of the group at full size has done that step, the
  driver drains the last node with the preemption reason (``ray drain-node --reason
  DRAIN_NODE_REASON_PREEMPTION``, a deadline of ``drain_deadline_s``), as a cloud's
  autoscaler does before it takes a spot node; the ranks train on. Each rank appends the
  steps at which raycomp checkpointed for a notice to ``notices.jsonl``. With
  ``kill_after_step`` too, the node is then killed at that gate.

At a gate the ranks wait (at most ``gate_timeout_s``) rather than train on, so that the
restart comes from the checkpoint just before the gate. The workload: sklearn's digits, an MLP 64-128-10, SGD with momentum, a
global batch of ``batch`` samples per step drawn from a permutation per epoch and split
evenly over however many ranks there are, so that every group size trains on the same
samples at the same step. Each rank appends to ``progress.jsonl`` after every step (step,
world size, loss, pid, node) and ``starts.jsonl`` once per start (world size, the step it
restored, the sum of its error-feedback residuals); rank 0 writes ``result.json`` at the
end: test accuracy and loss, steps, world sizes seen.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from jobs.data import digits

    train, test = digits(seed=0)
    return train.x.float(), train.y.long(), test.x.float(), test.y.long()


def _options(config: dict[str, Any]) -> Any:
    import raycomp.train
    from raycomp.config import (
        CheckpointSection,
        CompressionSection,
        ControllerSection,
        StaticOptions,
        compressor,
    )

    name, params = config["compressor"]
    return raycomp.train.TrainOptions(
        compression=CompressionSection(policy="static", warmup_steps=2, min_compress_numel=256, levels="flat",
                                       static=StaticOptions(compressor=compressor(name, **params))),
        controller=ControllerSection(name=config["controller"], interval_steps=5, metrics_enabled=False),
        checkpoint=CheckpointSection(every_steps=config["every_steps"]),
        output_dir=str(Path(config["output"]) / "raycomp"), run_id=config["name"], progress_every=0)


def _residual_sum(state: dict[str, Any]) -> float:
    """The sum of every error-feedback residual element this rank holds (float64)."""
    memory = state.get("memory", {})
    return float(sum(t.double().sum() for t in memory.get("residuals", {}).values()))


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _gate(output: Path, name: str, rank: int, world: int, timeout_s: float) -> None:
    """Tell the driver this rank reached the gate ``name`` and wait there: the driver kills
    a node or adds one, and Ray Train then stops this worker group, so normally this never
    returns. The ranks wait rather than train on, so that the restart comes from the
    checkpoint just before the gate whatever the machine's load; after ``timeout_s`` they go
    on (the test then sees that the group never changed)."""
    (output / f"{name}.rank{rank}").write_text(json.dumps({"pid": os.getpid(), "world": world}))
    time.sleep(timeout_s)


def train_func(config: dict[str, Any]) -> dict[str, Any]:
    import ray
    import ray.train

    import raycomp.train

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    output = Path(config["output"])
    x_train, y_train, x_test, y_test = _digits()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model = raycomp.train.prepare_model(model, optimizer, options=_options(config))
    loop = raycomp.train.current()
    node = ray.get_runtime_context().get_node_id()
    _append(output / "starts.jsonl", {"rank": rank, "world": world, "restored_from": loop.restored_from,
                                      "residual_sum": _residual_sum(loop.state.state_dict()), "pid": os.getpid(),
                                      "node": node, "time": time.time()})
    batch, steps = config["batch"], config["steps"]
    per_epoch = len(y_train) // batch
    drill = config.get("drill") or {}
    epochs = -(-steps // per_epoch)
    noticed = loop.preemption.answered
    for epoch in loop.epochs(epochs, per_epoch):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        for i in range(loop.step_in_epoch, per_epoch):
            if loop.global_step >= steps:
                break
            chosen = order[i * batch:(i + 1) * batch]
            mine = chosen.tensor_split(world)[rank]  # this rank's share of the global batch
            loss = torch.nn.functional.cross_entropy(model(x_train[mine]), y_train[mine])
            loss.backward()
            raycomp.train.step(loss, samples=len(mine))
            step = loop.global_step  # steps done
            _append(output / "progress.jsonl", {"rank": rank, "step": step, "world": world,
                                                "loss": float(loss), "pid": os.getpid(), "node": node})
            time.sleep(config.get("step_sleep_s", 0.0))
            if loop.preemption.answered > noticed:  # raycomp checkpointed for a notice at this step
                noticed = loop.preemption.answered
                _append(output / "notices.jsonl", {"rank": rank, "step": step, "world": world,
                                                   "asked": loop.preemption.asked, "time": time.time()})
            if world == config["max_workers"] and step == drill.get("drain_after_step") and rank == 0:
                (output / "drain.rank0").write_text(str(time.time()))
            if world == config["max_workers"] and step == drill.get("kill_after_step"):
                if not (output / "kill.done").exists():
                    _gate(output, "kill", rank, world, config["gate_timeout_s"])
            if world < config["max_workers"] and step == drill.get("grow_after_step"):
                if not (output / "grow.done").exists():
                    _gate(output, "grow", rank, world, config["gate_timeout_s"])
        raycomp.train.report({"epoch": epoch})
    totals = raycomp.train.finish()
    if rank == 0:
        module = getattr(model, "module", model)
        with torch.no_grad():
            logits = module(x_test)
            result = {"accuracy": float((logits.argmax(1) == y_test).float().mean()),
                      "loss": float(torch.nn.functional.cross_entropy(logits, y_test)),
                      "steps": loop.global_step, "world": world, "wire_bytes": totals["wire_bytes_total"],
                      "dense_bytes": totals["dense_bytes_total"]}
        (output / "result.json").write_text(json.dumps(result))
    return {"rank": rank}


def _all_ranks_at(output: Path, name: str, world: int) -> bool:
    return all((output / f"{name}.rank{r}").exists() for r in range(world))


def _gated_world(path: Path) -> int | None:
    """The world size rank 0 wrote at a gate (None: not there, or not whole yet)."""
    try:
        return int(json.loads(path.read_text())["world"])
    except (OSError, ValueError, KeyError):
        return None


def _guarded(target: Any, events: list[dict[str, Any]]) -> Any:
    """``target`` with any exception recorded in ``events`` (a thread's would only be printed)."""
    def run(*args: Any) -> None:
        try:
            target(*args)
        except Exception as error:  # noqa: BLE001 - the test reads it from driver.json
            events.append({"event": "director failed", "error": f"{type(error).__name__}: {error}"})
    return run


def _kill_node(cluster: Any, node: Any, output: Path) -> dict[str, Any]:
    """SIGKILL the node's raylet (and its other processes), then its workers still alive."""
    node_id = node.node_id
    cluster.remove_node(node, allow_graceful=False)
    killed = []
    for line in (output / "progress.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["node"] == node_id and record["pid"] not in killed:
            killed.append(record["pid"])
    alive = []
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return {"node": node_id, "worker_pids": killed, "still_alive_after_raylet": alive, "time": time.time()}


def _drain_node(cluster: Any, node: Any, deadline_s: int) -> dict[str, Any]:
    """Announce the node's preemption to Ray (GCS), as an autoscaler does for a spot node."""
    import subprocess

    started = time.time()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address, "--node-id",
         node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "preemption drill",
         "--deadline-remaining-seconds", str(deadline_s)],
        capture_output=True, text=True, timeout=60, check=False)
    return {"node": node.node_id, "rc": done.returncode, "output": (done.stdout + done.stderr)[-500:],
            "time": started}


def _director(cluster: Any, nodes: list[Any], spec: dict[str, Any], output: Path, events: list[dict[str, Any]],
              fitting: threading.Thread) -> None:
    """While the fit runs, watch the ranks' gates: kill the last node added at the first,
    add a node at the second."""
    drill = spec.get("drill") or {}
    killed, grown = "kill_after_step" not in drill, "grow_after_step" not in drill
    drained = "drain_after_step" not in drill
    while fitting.is_alive() and not (killed and grown and drained):
        if not drained and (output / "drain.rank0").exists():
            events.append({"event": "drain", **_drain_node(cluster, nodes[-1], spec.get("drain_deadline_s", 120))})
            drained = True
        if not killed and _all_ranks_at(output, "kill", spec["max_workers"]):
            events.append({"event": "kill", **_kill_node(cluster, nodes.pop(), output)})
            (output / "kill.done").write_text("")
            killed = True
        if killed and not grown and _gated_world(output / "grow.rank0") is not None:
            if _all_ranks_at(output, "grow", _gated_world(output / "grow.rank0")):
                node = cluster.add_node(num_cpus=spec["cpus"])
                nodes.append(node)
                events.append({"event": "grow", "node": node.node_id, "time": time.time()})
                (output / "grow.done").write_text("")
                grown = True
        time.sleep(0.2)


def main(spec_path: str) -> int:
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raycomp.train
    from raycomp.config import ControllerSection

    spec = json.loads(Path(spec_path).read_text())
    output = Path(spec["output"])
    output.mkdir(parents=True, exist_ok=True)
    started = time.time()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": spec["cpus"], "include_dashboard": False})
    events: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        name = spec["name"]
        # on the head, before any other node exists: the node killed later never holds it
        callback = raycomp.train.ControllerCallback(ControllerSection(name=name, metrics_enabled=False))
        nodes = [cluster.add_node(num_cpus=spec["cpus"]) for _ in range(spec["nodes"] - 1)]
        cluster.wait_for_nodes()
        report["cluster_seconds"] = round(time.time() - started, 1)
        config = {key: spec[key] for key in ("output", "name", "steps", "every_steps", "compressor", "batch",
                                              "max_workers", "gate_timeout_s")}
        config.update(controller=name, drill=spec.get("drill"), step_sleep_s=spec.get("step_sleep_s", 0.0))
        trainer = TorchTrainer(
            train_func, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=(spec["min_workers"], spec["max_workers"]),
                                         elastic_resize_monitor_interval_s=spec["monitor_s"]),
            run_config=RunConfig(name=name, storage_path=str(output / "ray-train"), callbacks=[callback],
                                 failure_config=FailureConfig(max_failures=spec["max_failures"])))

        def fit() -> None:
            try:
                trainer.fit()
                report["status"] = "succeeded"
            except Exception as failure:  # noqa: BLE001 - the test reads it from driver.json
                report.update(status="failed", error=f"{type(failure).__name__}: {failure}"[:4000])

        # the fit in a thread, the drill in the main thread: starting a node installs signal
        # handlers, which only the main thread may
        fit_started = time.time()
        fitting = threading.Thread(target=fit, daemon=True)
        fitting.start()
        _guarded(_director, events)(cluster, nodes, spec, output, events, fitting)
        fitting.join()
        report["fit_seconds"] = round(time.time() - fit_started, 1)
    finally:
        report["events"] = events
        (output / "driver.json").write_text(json.dumps(report, default=str))
        ray.shutdown()
        cluster.shutdown()
    return 0 if report.get("status") == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
