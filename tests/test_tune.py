"""Tune over Ray Train: a tiny search on 2 CPUs (no resource deadlock, ASHA stops a trial and
the next one still starts), its outputs, the best config accepted as a job, and resuming."""

from __future__ import annotations

import csv
import json
import math
import threading
import time
from types import SimpleNamespace

import pytest

from jobs import tune
from jobs.train import prepare
from raycomp.config import load_config
from tests.conftest import REPO

TUNE_DIGITS = str(REPO / "jobs" / "configs" / "tune_digits.yaml")
# 3 trials of 2 short epochs: the adaptive default first, then dense, which spends ~10x the
# bytes and so scores far below it at epoch 1 (a 2 MB budget): ASHA stops it there.
TINY = [
    "num_samples=1",
    "baselines=[default, dense]",
    "base.overrides=[workload.epochs=2, workload.steps_per_epoch=8, compression.warmup_steps=0,"
    " controller.interval_steps=4, compression.critical.window_steps=4]",
    "search={compression: {policy: {choice: [static]},"
    " static: {compressor: {choice: [{name: topk, ratio: 0.05}]}},"
    " guard: {stable_steps: {randint: [5, 20]}}}}",
    "objective.byte_budget=2e6",
    "asha.grace_period=1",
]


def test_bad_tune_config_exits_2_with_one_line(capsys):
    cases = {
        "search.compression.policy={choice: [static, magic]}": "search.compression.policy: 'magic' is not a valid value",
        "search.compression.nope={randint: [0, 3]}": "search.compression.nope",
        "search.compression.warmup_steps={uniform: [5, 1]}": "low must be < high",
        "objective.kind=accuracy": "objective.kind: must be one of",
        "asha.grace_period=99": "asha.grace_period",
    }
    for override, message in cases.items():
        assert tune.main(["--config", TUNE_DIGITS, "--output", "/nonexistent/never-created", override]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err, (override, err)
        assert len(err.splitlines()) == 1, err


def test_objectives():
    budget = tune.Objective("accuracy_at_budget", byte_budget=100)
    assert budget.update(0.5, 50, 1)["objective"] == 0.5
    assert budget.update(0.8, 200, 2)["objective"] == 0.5  # 0.8 x 100/200 = 0.4 < the best so far
    assert math.isclose(budget.update(0.9, 110, 3)["objective"], 0.9 * 100 / 110)
    target = tune.Objective("bytes_to_target", target_accuracy=0.9)
    first = target.update(0.45, 1000, 1)
    assert first == {"objective": 2000.0, "reached_target": False}  # projected
    assert target.update(0.95, 3000, 2) == {"objective": 3000, "reached_target": True}
    assert target.update(0.99, 5000, 3)["objective"] == 3000  # the first time it got there


def test_a_stopped_trial_has_its_train_run_aborted_but_a_finishing_one_does_not(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class FakeTrainController:
        def __init__(self):
            self.aborted = False

        def abort(self):
            self.aborted = True

        def was_aborted(self):
            return self.aborted

    registry_id = ("raycomp-tune-unit", "raycomp-tune")
    registry = ray.remote(tune.RunRegistry).options(name=registry_id[0], namespace=registry_id[1],
                                                    num_cpus=0).remote()
    callback = tune._stop_train_runs_callback("unit", registry_id, epochs=2)
    try:
        stopped, finishing = FakeTrainController.remote(), FakeTrainController.remote()
        ray.get([registry.add.remote("unit-a", stopped), registry.add.remote("unit-b", finishing)])
        # ASHA stops trial a after epoch 1: its Train run is aborted, and the callback waits
        # for the trial to record that (as run_trial does) before Tune may end the trial
        def trial_a_records_its_end():
            while not ray.get(stopped.was_aborted.remote()):
                time.sleep(0.1)
            ray.get(registry.finish.remote("unit-a"))

        threading.Thread(target=trial_a_records_its_end, daemon=True).start()
        callback.on_trial_complete(0, [], SimpleNamespace(trial_id="a", last_result={"epochs_done": 1}))
        assert ray.get(stopped.was_aborted.remote()) and ray.get(registry.was_stopped.remote("unit-a"))
        assert ray.get(registry.is_finished.remote("unit-a"))
        # trial b has reported its last epoch (ASHA may still say STOP): wait for it to finish
        threading.Timer(1.0, lambda: ray.get(registry.finish.remote("unit-b"))).start()
        started = time.time()
        callback.on_trial_complete(0, [], SimpleNamespace(trial_id="b", last_result={"epochs_done": 2}))
        assert time.time() - started >= 0.9
        assert not ray.get(finishing.was_aborted.remote()) and not ray.get(registry.was_stopped.remote("unit-b"))
    finally:
        ray.kill(registry)


@pytest.mark.timeout(600)
def test_tiny_search_writes_table_best_config_and_plot_and_resumes(ray_cluster, tmp_path, capsys):
    argv = ["--config", TUNE_DIGITS, "--output", str(tmp_path), "--name", "tiny", *TINY]
    started = time.time()
    assert tune.main(argv) == 0
    searched = time.time() - started
    out = capsys.readouterr().out
    exp = tmp_path / "tiny"

    with (exp / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3
    by_variant = {row["variant"]: row for row in rows}
    assert set(by_variant) == {"default", "dense", "search"}
    # ASHA stopped the dense baseline after epoch 1, and the trial after it still trained:
    # its placement group was released (no deadlock on 2 CPUs)
    assert by_variant["dense"]["status"] == "stopped" and by_variant["dense"]["epochs"] == "1", rows
    assert by_variant["search"]["status"] == "completed" and by_variant["search"]["epochs"] == "2", rows
    assert float(by_variant["search"]["wire_bytes"]) < float(by_variant["search"]["dense_bytes"])
    assert "stopped early by ASHA" in out
    stopped = json.loads((exp / "runs" / by_variant["dense"]["run_id"] / "summary.json").read_text())
    assert stopped["status"] == "stopped" and stopped["error"] is None
    # every trial had its own run id in the controller service
    controller = ray_cluster.get_actor("raycomp-controller", namespace="raycomp")
    for row in rows:
        assert row["run_id"] == f"tiny-{row['trial_id']}"
        assert ray_cluster.get(controller.summary.remote(row["run_id"]))["policy"]
    assert f"| tiny-{rows[0]['trial_id']} |" in (exp / "results.md").read_text()

    png = (exp / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    best = load_config(exp / "best_config.yaml")  # a full job config
    assert rows[0]["variant"] != "dense" and rows[0]["status"] == "completed"
    assert best.run.name == "tiny-best"
    # and it is what `python -m jobs.train --config best_config.yaml` accepts: every preflight
    # check a job makes before Ray starts passes (running it would be one more 20 s Train fit
    # of the code path every other Train test runs)
    config, _, output = prepare(["--config", str(exp / "best_config.yaml"), "--output", str(tmp_path / "best-run")])
    assert config == best and output == tmp_path / "best-run"

    # the same command again resumes the (finished) experiment instead of starting over
    assert tune.main(argv) == 0
    assert "resuming the search" in capsys.readouterr().out
    with (exp / "results.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 3
    # and a changed config is refused rather than mixed into it
    assert tune.main([*argv, "num_samples=2"]) == 2
    assert "holds a search with a different config (changed: num_samples)" in capsys.readouterr().err
    print(f"tiny search: {searched:.0f} s")
