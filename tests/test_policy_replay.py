"""Every built-in policy keeps its decisions: 300 seeded closed-loop runs (each through a
controller restart) publish the same plans, byte for byte, as the recording
``tests/data/policy_replay.json`` (``tests.support.policy_replay``). A refactor that changes
one decision, one reason's wording or what survives a restart fails here, naming the seed."""

from __future__ import annotations

from pathlib import Path

from tests.support.policy_replay import RUNS, check

RECORDING = Path(__file__).parent / "data" / "policy_replay.json"


def test_every_recorded_run_publishes_the_same_plans():
    differ = check(RECORDING)
    assert not differ, f"plans differ from the recording in {len(differ)} of {RUNS} runs, seeds {differ[:10]}"


def test_the_recording_notices_one_changed_rule(monkeypatch):
    """Teeth: the adaptive chooser switching after one boundary outside its band instead of
    two changes some recorded runs."""
    from raycomp.controllers.policies import chooser

    monkeypatch.setattr(chooser, "PATIENCE", 1)
    assert check(RECORDING, seeds=list(range(40)))
