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
from jobs.bench import tune as bench_tune
from jobs.bench.report import machine_info
from jobs.config import ConfigError, load_config
from jobs.train import prepare
from jobs.tune import trials as tune_trials
from tests.support.repo import REPO

TUNE_DIGITS = str(REPO / "jobs" / "configs" / "tune_digits.yaml")
TUNE_GPT = str(REPO / "jobs" / "configs" / "tune_gpt.yaml")
# 3 trials of 2 short epochs: the default baseline (digits.yaml: critical) first, then dense, which spends ~10x the
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
        "search.compression.local.sync_every={choice: [4, 0]}": "search.compression.local.sync_every: 0 is not a valid value",
    }
    for override, message in cases.items():
        assert tune.main(["--config", TUNE_DIGITS, "--output", "/nonexistent/never-created", override]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err, (override, err)
        assert len(err.splitlines()) == 1, err


def test_help_shows_how_to_use_the_search_not_the_module_map(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "python -m jobs.tune --config" in out and "Tuner.restore" in out, out
    assert ":mod:" not in out and "The parts" not in out, out


def test_the_transformer_search_covers_local_steps_and_a_trial_gets_them():
    tuning = tune.load_tune_config(REPO / "jobs" / "configs" / "tune_gpt.yaml", output="/nonexistent/never-created")
    assert {"compression.local.mode", "compression.local.sync_every"} <= tuning.search.keys()
    config = tune.trial_config(tuning.base, "sampled", {"compression.local.mode": "fixed",
                                                      "compression.local.sync_every": 16})
    assert (config.compression.local.mode, config.compression.local.sync_every) == ("fixed", 16)


def test_objectives():
    budget = tune.Objective("accuracy_at_budget", byte_budget=100)
    assert budget.update(0.5, 50, 1)["objective"] == 0.5
    assert budget.update(0.8, 200, 2)["objective"] == 0.5  # 0.8 x 100/200 = 0.4 < the best so far
    assert math.isclose(budget.update(0.9, 110, 3)["objective"], 0.9 * 100 / 110)
    target = tune.Objective("bytes_to_target", target=0.9)
    first = target.update(0.45, 1000, 1)
    assert first == {"objective": 2000.0, "reached_target": False}  # projected
    assert target.update(0.95, 3000, 2) == {"objective": 3000, "reached_target": True}
    assert target.update(0.99, 5000, 3)["objective"] == 3000  # the first time it got there


def test_objectives_on_a_loss_lower_is_better():
    budget = tune.Objective("loss_at_budget", metric="loss", byte_budget=100)
    assert budget.update(3.0, 50, 1) == {"objective": 3.0, "within_budget": True}
    assert budget.update(2.5, 200, 2)["objective"] == 3.0  # 2.5 x 200/100 = 5.0: worse than 3.0
    assert budget.update(2.5, 110, 3)["objective"] == 2.5 * 110 / 100
    timed = tune.Objective("time_to_target", metric="loss", target=2.0)
    assert timed.update(3.0, 10, 40.0) == {"objective": 60.0, "reached_target": False}  # 40 x 3/2
    assert timed.update(2.1, 20, 50.0)["reached_target"] is False  # above the target: not there
    assert timed.update(1.99, 30, 70.0) == {"objective": 70.0, "reached_target": True}
    assert timed.update(1.5, 40, 90.0)["objective"] == 70.0


def test_pareto_front_of_a_loss_keeps_the_lowest_loss_per_byte():
    rows = [{"status": "completed", "wire_bytes": b, "eval_loss": loss, "name": n}
            for n, b, loss in (("cheap", 10, 2.5), ("mid", 20, 2.3), ("dominated", 30, 2.4), ("dear", 40, 2.2))]
    rows.append({"status": "stopped", "wire_bytes": 5, "eval_loss": 2.0, "name": "stopped"})
    assert [r["name"] for r in tune.pareto_front(rows, "eval_loss")] == ["cheap", "mid", "dear"]
    flipped = [{**r, "eval_accuracy": r["eval_loss"]} for r in rows]  # higher is better now
    assert [r["name"] for r in tune.pareto_front(flipped, "eval_accuracy")] == ["cheap"]  # best and fewest


def test_bench_tune_reads_the_search_table_with_ids_as_text(tmp_path):
    (tmp_path / "results.csv").write_text(
        "trial_id,variant,status,epochs,objective,eval_loss,reached_target,compression.static.compressor\n"
        '10248_00001,default,completed,8,170.5,2.3007,True,\n'
        '10248_00006,search,completed,8,149.9,2.3194,False,"{""name"":""powersgd""}"\n'
        '10248_00003,search,stopped,3,1.5e2,nan,False,\n')
    rows = bench_tune.read_rows(tmp_path)
    assert [r["trial_id"] for r in rows] == ["10248_00001", "10248_00006", "10248_00003"]  # not 1024800001
    assert rows[0]["epochs"] == 8 and rows[0]["objective"] == 170.5 and rows[2]["objective"] == 150.0
    assert rows[0]["reached_target"] is True and rows[1]["reached_target"] is False
    assert math.isnan(rows[2]["eval_loss"]) and rows[0]["compression.static.compressor"] is None
    compared = bench_tune.compare(rows)  # best first: the default is the only one at the target
    assert compared["default"]["trial_id"] == "10248_00001" and compared["best_searched"]["trial_id"] == "10248_00006"
    assert compared["dense"] is None and compared["default_over_best"] is None  # 00006 never got there
    assert compared["best_variant"] == "default"


def test_the_objective_must_read_the_metric_the_workload_reports(tmp_path):
    gpt = tune.load_tune_config(TUNE_GPT, output=str(tmp_path))
    assert gpt.spec.objective.metric == "loss" and gpt.metric_key == "eval_loss"
    assert gpt.spec.objective.scorer() == {"kind": "time_to_target", "metric": "loss",
                                           "byte_budget": None, "target": gpt.spec.objective.target_loss}
    assert gpt.spec.objective.mode == "min"
    cases = {  # (tune config, overrides) -> the one-line error
        (TUNE_GPT, ("objective.kind=accuracy_at_budget", "objective.byte_budget=1e9")):
            "objective: the base workload (kjv) reports loss, not accuracy: use kind loss_at_budget",
        (TUNE_DIGITS, ("objective.kind=loss_at_budget",)):
            "objective: the base workload (digits) reports accuracy, not loss",
        (TUNE_DIGITS, ("objective.kind=bytes_to_target", "objective.target_accuracy=0.9",
                       "objective.target_loss=0.5")): "needs one of target_accuracy",
        (TUNE_GPT, ("objective.target_loss=null",)): "needs one of target_accuracy",
    }
    for (config, overrides), message in cases.items():
        with pytest.raises(ConfigError) as caught:
            tune.load_tune_config(config, list(overrides), output=str(tmp_path))
        assert message in str(caught.value) and "\n" not in str(caught.value), (overrides, caught.value)


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
    callback = tune_trials.stop_train_runs_callback("unit", registry_id, epochs=2)
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


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
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

    # the benchmark's report of a search (jobs.bench tune): default against the best searched
    meta = {"command": "python -m jobs.bench tune", "machine": machine_info(1), "link": "fast",
            "check": {"a_to_b": {"bits_per_s": 2e10}, "b_to_a": {"bits_per_s": 3e10}}, "shaping": {},
            "seconds": searched, "exit_code": 0}
    json_path, md_path, png_path = bench_tune.write_report(exp, meta, tmp_path / "report", "tune-tiny-fast")
    report = json.loads(json_path.read_text())
    assert report["comparison"]["default"]["trial_id"] == by_variant["default"]["trial_id"]
    assert report["comparison"]["best_searched"]["trial_id"] == by_variant["search"]["trial_id"]
    assert report["comparison"]["dense"] is None  # stopped by ASHA: no completed dense trial
    assert [r["trial_id"] for r in report["rows"]] == [r["trial_id"] for r in rows]
    text = md_path.read_text()
    assert f"| default: adaptive, untuned (`{by_variant['default']['trial_id']}`) |" in text
    assert "Objective `accuracy_at_budget` (byte budget 2e+06)" in text and "20000.0 Mbit/s" in text
    assert png_path.read_bytes() == png

    # the same command again resumes the (finished) experiment instead of starting over
    assert tune.main(argv) == 0
    assert "resuming the search" in capsys.readouterr().out
    with (exp / "results.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 3
    # and a changed config is refused rather than mixed into it
    assert tune.main([*argv, "num_samples=2"]) == 2
    assert "holds a search with a different config (changed: num_samples)" in capsys.readouterr().err
    print(f"tiny search: {searched:.0f} s")
