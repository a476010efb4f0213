"""Closed-loop policy runs, recorded and replayed: does a refactor keep every decision?

Each run is drawn from a seed: a policy (every built-in one, the adaptive policy under many
option sets, with local steps fixed or auto), a simulated 2-rank run over a link whose
bandwidth, round overhead and noise change mid-run, layer norms with critical bursts,
compression errors, guard fallbacks, a loss and a learning-rate schedule, and a controller
restart (the policy's state through JSON into a fresh policy) somewhere in the middle. The
simulation runs the plan the controller publishes (the loop is closed), so one changed
decision changes everything after it.

A run's record is the SHA-256 of every published plan's JSON (reason included) in order::

    python -m tests.support.policy_replay record tests/data/policy_replay.json  # on trusted code
    python -m tests.support.policy_replay check tests/data/policy_replay.json   # after a change

``check`` exits 1 naming the first run whose plans differ. ``tests/test_policy_replay.py``
replays a share of the runs in the default suite.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

from raycomp.config import LOCAL_MIN_GAIN, LocalSection
from raycomp.controllers.policies import make_policy
from tests.support.policy_sim import SHAPES, WARMUP, K, Link, LocalSim, W

RUNS = 300
INTERVALS = 48  # control boundaries per run


def _adaptive_options(rng: random.Random) -> dict[str, Any]:
    options: dict[str, Any] = {
        "window_steps": rng.choice([10, 20, 50]),
        "near_lossless": rng.choice([["int8", "bf16"], ["int4", "int8", "bf16"], ["int8"], []]),
        "critical_boost": rng.choice([0, 2, 4]),
        "lossy_margin": rng.choice([0.0, 0.3]),
        "warmup": rng.choice(["dense", "near_lossless"]),
        "lossy": rng.choice(["auto", "always", "never"]),
        "slack": rng.choice([0.0, 0.1, 0.3]),
        "max_error": rng.choice([0.3, 0.9]),
        "ranks": rng.choice([[1, 2, 4, 8], [2, 4]]),
    }
    if not options["near_lossless"] and options["lossy"] == "never":
        options["lossy"] = "auto"
    if rng.random() < 0.15:
        options["bandwidth"] = rng.choice([1e6, 1e8])
    if rng.random() < 0.1:
        options = {**options, "sharded": True, "lossy": "never",
                   "near_lossless": [n for n in options["near_lossless"] if n in ("int4", "int8", "bf16")] or ["int8"]}
    return options


def _scenario(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    kind = rng.choice(["adaptive", "adaptive", "adaptive", "local_auto", "local_auto", "local_fixed",
                       "critical", "error_budget", "bandwidth", "schedule", "static"])
    local = None
    if kind.startswith("local"):
        local = {"mode": "auto" if kind == "local_auto" else "fixed",
                 "max_sync_every": rng.choice([8, 32, 64]), "delay": rng.choice([0, 1, "auto"]),
                 "fragments": rng.choice([1, 2]), "sync_every": rng.choice([4, 8]),
                 "min_gain": rng.choice([LOCAL_MIN_GAIN["linear"], "auto", 1.0]),
                 "sync_every_at_peak_lr": rng.choice([4, 8]), "loss_tolerance": rng.choice([0.02, 0.1])}
    policy = "adaptive" if kind.startswith("local") or kind == "adaptive" else kind
    options = _adaptive_options(rng) if policy == "adaptive" else {}
    if kind == "critical":
        options = {"window_steps": rng.choice([10, 20]), "threshold": rng.choice([0.2, 0.5])}
    elif kind == "error_budget":
        options = {"every_steps": rng.choice([10, 25]), "slack": rng.choice([0.0, 0.5])}
    elif kind == "bandwidth":
        options = {"target_overlap": rng.choice([0.5, 1.0, 2.0])}
    elif kind == "schedule":
        options = {"stages": [{"start_step": 0, "compressor": {"name": "none"}},
                              {"start_step": rng.choice([30, 60]), "compressor": {"name": "int8"}},
                              {"start_step": 150, "compressor": {"name": "topk", "ratio": 0.01}}]}
    elif kind == "static":
        options = {"compressor": rng.choice([{"name": "int8"}, {"name": "powersgd", "rank": 2}])}
    links = [Link(bandwidth=rng.choice([1.2e6, 4e6, 2e7, 1e9]),
                  overhead=rng.choice([0.002, 0.01] if local else [0.002, {"powersgd": 0.004, "topk": 0.003,
                                                                            "quantized": 0.006, "bf16": 0.001}]),
                  compute=rng.choice([0.03, 0.05, 0.2]), noise=rng.choice([0.0, 0.05, 0.2]))
             for _ in range(rng.choice([1, 2, 3]))]
    return {"seed": seed, "kind": kind, "policy": policy, "options": options, "local": local,
            "links": links, "switch_at": sorted(rng.sample(range(4, INTERVALS - 4), len(links) - 1)),
            "restart_at": rng.randrange(6, INTERVALS - 6),
            "fallbacks": sorted(rng.sample(range(INTERVALS), rng.choice([0, 0, 1, 3]))),
            "bursts": sorted(rng.sample(range(INTERVALS), rng.choice([0, 2, 6]))),
            "errors": {"powersgd r=1": rng.choice([0.2, 0.95]), "powersgd r=2": rng.choice([0.2, 0.95]),
                       "topk": rng.choice([0.5, 0.95]), "int4": rng.choice([0.1, 0.95]), "int8": 0.05,
                       "bf16": 0.01},
            "loss_drift": rng.choice([-0.01, 0.0, 0.02]), "lr_decay": rng.choice([None, 0.0, 0.05]),
            "sync_factor": rng.choice([1.0, 1.5]), "slowdown": rng.choice([0.0, 0.01])}


class _ReplaySim(LocalSim):
    """LocalSim registered with any policy (and without ``compression.local`` when none)."""

    def __init__(self, scenario: dict[str, Any]) -> None:
        local = scenario["local"] or {"mode": "off"}
        super().__init__(local, sync_factor=scenario["sync_factor"], slowdown=scenario["slowdown"],
                         errors=scenario["errors"], **(scenario["options"] if scenario["policy"] == "adaptive" else {}))
        policy = scenario["policy"]
        options = self.options if policy == "adaptive" else scenario["options"]
        if scenario["local"] is not None:
            options = {**options, "local": LocalSection(**{"min_gain": LOCAL_MIN_GAIN["linear"], "delay": 0,
                                                           **scenario["local"]}).model_dump(mode="json")}
            self.delay = options["local"]["delay"]
        self.registered = (policy, options)
        ingest = self.controller.ingest  # LocalSim's worker view, kept across the new registration
        self.controller.runs.clear()
        self.controller.policies.clear()
        self.controller.register_run("run", W, SHAPES, policy, options, WARMUP, K, 1024)
        self.controller.ingest = ingest
        self.rng = random.Random(scenario["seed"])
        self.steps_locally = scenario["local"] is not None

    def _timing(self, report: dict, mode) -> dict:
        return super()._timing(report, mode) if self.steps_locally else {}

    def restart(self) -> None:
        """A controller restart: the policy's state through JSON into a fresh policy."""
        policy, options = self.registered
        state = json.loads(json.dumps(self.controller.policies["run"].state_dict()))
        fresh = make_policy(policy, {**options, "min_compress_numel": 1024})
        fresh.load_state_dict(state)
        self.controller.policies["run"] = fresh


def replay(seed: int, plans: list[dict[str, Any]] | None = None) -> str:
    """The digest of every plan one seeded run publishes (appended to ``plans`` if given)."""
    scenario = _scenario(seed)
    sim = _ReplaySim(scenario)
    digest = hashlib.sha256()
    link_index = 0
    base_lr = 0.1
    for i in range(INTERVALS):
        if link_index < len(scenario["switch_at"]) and i >= scenario["switch_at"][link_index]:
            link_index += 1
        link = scenario["links"][link_index]
        if i == scenario["restart_at"]:
            sim.restart()
        sim.fallback = i in scenario["fallbacks"]
        if sim.fallback:
            sim.events = [{"kind": "fallback", "step": sim.step + 1, "reason": "non-finite"}]
        else:
            sim.events = []
        sim.loss = max(0.05, 2.0 * (1 - 0.015 * i) + scenario["loss_drift"] * i + 0.02 * sim.rng.random())
        decay = scenario["lr_decay"]
        sim.lr = None if decay is None else base_lr * max(1e-6, 1 - decay * i)
        burst = i in scenario["bursts"]
        sim.run(1, link, norm=lambda s, n, b=burst: (3.0 if b and n.startswith("fc") else 1.0) + 0.01 * (s % 7))
        # the plan as published, less its why: the decision's facts, which the reason renders
        # (the recording predates the why riding with the plan)
        plan = {key: value for key, value in sim.plan.to_dict().items() if key != "why"}
        digest.update(json.dumps(plan, sort_keys=True).encode())
        if plans is not None:
            plans.append(plan)
    return digest.hexdigest()


def record(path: Path, runs: int = RUNS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    digests = {str(seed): replay(seed) for seed in range(runs)}
    path.write_text(json.dumps({"intervals": INTERVALS, "runs": digests}, indent=0, sort_keys=True) + "\n")


def check(path: Path, seeds: list[int] | None = None) -> list[int]:
    """The seeds whose plans differ from the recording (all recorded seeds unless given)."""
    recorded = json.loads(path.read_text())["runs"]
    wanted = [int(s) for s in recorded] if seeds is None else seeds
    return [seed for seed in wanted if replay(seed) != recorded[str(seed)]]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "check"):
        print("usage: python -m tests.support.policy_replay record|check FILE", file=sys.stderr)
        return 2
    path = Path(argv[1])
    if argv[0] == "record":
        record(path)
        return 0
    differ = check(path)
    if differ:
        print(f"plans differ from the recording in {len(differ)} runs, first seed {differ[0]}")
        return 1
    print(f"{len(json.loads(path.read_text())['runs'])} runs: the same plans")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


__all__ = ["RUNS", "check", "record", "replay"]
