"""``raycomp.train.report``: the evaluation it records (``TrainOptions.eval_metric``) and
when it checkpoints (``CheckpointSection.at_report``)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from raycomp._internal.train.step_log import StepLog
from raycomp.config import CheckpointSection
from raycomp.train import TrainOptions
from tests.support.controller_fit import fit_with_controller

EPOCHS, STEPS = 4, 5  # per epoch; 20 steps in all


@pytest.mark.parametrize(("section", "checkpointed"), [
    # (epoch, step) of one report per epoch, at its end: 4 epochs of 5 steps
    ({}, [(3, 20)]),  # the default: the last epoch only
    ({"every_epochs": 2}, [(1, 10), (3, 20)]),
    ({"every_epochs": 3}, [(2, 15), (3, 20)]),
    # a multiple of every_steps that ends an epoch is the report's to take (step() leaves it)
    ({"every_steps": 10}, [(1, 10), (3, 20)]),
    ({"every_steps": 3}, [(2, 15), (3, 20)]),
])
def test_the_report_checkpoints_the_last_epoch_and_what_the_section_adds(section, checkpointed):
    rule = CheckpointSection(**section)
    reports = [(epoch, (epoch + 1) * STEPS) for epoch in range(EPOCHS)]
    assert [r for r in reports if rule.at_report(*r, EPOCHS, STEPS)] == checkpointed
    # mid-epoch reports: checkpointed in the last epoch, never for every_steps (step() took those)
    assert rule.at_report(3, 17, EPOCHS, STEPS)
    assert not CheckpointSection(every_steps=2).at_report(0, 4, EPOCHS, STEPS)


def test_without_loop_epochs_only_every_epochs_checkpoints():
    # loop.epochs(...) was never called: no last epoch known, every report is epoch 0
    assert not CheckpointSection().at_report(0, 40)
    assert not CheckpointSection(every_steps=10).at_report(0, 40)
    assert CheckpointSection(every_epochs=1).at_report(0, 40)


def test_bad_eval_options_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^eval_metric: must be a metric name \(a non-empty string\) or None, "
                                         r"got ''$"):
        TrainOptions(eval_metric="")
    with pytest.raises(ValueError, match=r"^eval_kind: must be 'accuracy' or 'loss', got 'auc'$"):
        TrainOptions(eval_kind="auc")
    with pytest.raises(ValueError, match=r"every_epochs"):
        CheckpointSection(every_epochs=0)


def test_an_evaluation_line_holds_values_json_has_no_type_for(tmp_path):
    log = StepLog(tmp_path, 0)
    log.write_eval({"accuracy": np.float32(0.5), "top5": torch.tensor(0.75), "note": object()}, 10, 1)
    line = json.loads((tmp_path / "evals.jsonl").read_text())
    assert (line["accuracy"], line["top5"], line["step"], line["epoch"]) == (0.5, 0.75, 10, 1)
    assert line["note"].startswith("<object object")


def _reports(config: dict) -> dict:
    import raycomp.train
    from raycomp.config import ControllerSection

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    options = TrainOptions(controller=ControllerSection(name=config["controller"], interval_steps=config["interval"]),
                           checkpoint=CheckpointSection(every_steps=10), output_dir=config["output_dir"],
                           run_id=config["run_id"])
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    loop = raycomp.train.current()
    for epoch in loop.epochs(EPOCHS, STEPS):
        for group in optimizer.param_groups:  # a decaying rate: the controller keeps its peak
            group["lr"] = 0.01 / (epoch + 1)
        for _ in range(loop.step_in_epoch, STEPS):
            loss = model(torch.randn(8, 32)).pow(2).mean()
            loss.backward()
            raycomp.train.step(loss, samples=8)
        accuracy = 0.1 * (epoch + 1)
        if epoch == 1:  # an evaluation recorded by hand at this step: the report adds none
            raycomp.train.record_eval({"accuracy": accuracy, "by": "record_eval"}, accuracy)
        if epoch == 0:  # refused before anything is recorded or reported
            with pytest.raises(ValueError, match=r"^report: metrics\['accuracy'\] \(TrainOptions\.eval_metric\) "
                                                 r"must be a number, got 'high'$"):
                raycomp.train.report({"accuracy": "high"})
        raycomp.train.report({"accuracy": accuracy, "loss": float(loss)}, checkpoint=True if epoch == 2 else None)
    return raycomp.train.finish()


INTERVALS = (3, 5)  # the controller's K: step 20 is a boundary of the second only


def _reports_in_turn(config: dict) -> list[dict]:
    """:func:`_reports` at each of :data:`INTERVALS`, one run after the other in one worker
    group (a fit's start-up costs more than both runs), each its own run id and directory."""
    return [_reports({**config, "interval": k, "output_dir": f"{config['output_dir']}-k{k}",
                      "run_id": f"{config['controller']}-k{k}"}) for k in INTERVALS]


@pytest.fixture(scope="module")
def report_runs(ray_cluster, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("report")
    fit_with_controller(_reports_in_turn, tmp_path, "report")
    return tmp_path


@pytest.mark.parametrize("interval", INTERVALS)
def test_report_records_the_evaluation_for_the_controller_and_checkpoints_as_documented(report_runs, interval):
    tmp_path = report_runs
    output = tmp_path / f"out-k{interval}"
    evals = [json.loads(line) for line in (output / "evals.jsonl").read_text().splitlines()]
    assert [(e["step"], e["epoch"], e["accuracy"]) for e in evals] == [
        (5, 0, 0.1), (10, 1, 0.2), (15, 2, pytest.approx(0.3)), (20, 3, 0.4)]
    assert evals[1]["by"] == "record_eval" and "loss" not in evals[1]  # one line at step 10
    assert all("loss" in e for e in evals if e["step"] != 10)
    # the controller got the latest evaluation: with K=3 step 20 is no boundary, so it rode
    # with the final statistics; with K=5 it is the last boundary, and the evaluation after
    # it went with that interval sent again
    summary = json.loads((output / "summary.json").read_text())
    assert (summary["policy"]["eval_metric"], summary["policy"]["eval_kind"]) == (pytest.approx(0.4), "accuracy")
    # and the optimizer's learning rate, the latest and the largest (local steps' H follows it)
    assert (summary["policy"]["lr"], summary["policy"]["peak_lr"]) == (pytest.approx(0.0025), pytest.approx(0.01))
    # checkpoints: step 10 (every_steps, at an epoch end), 15 (checkpoint=True), 20 (the last
    # epoch), each run's in turn in the fit's directory (their names sort by the time taken)
    run_dir = tmp_path / f"report-{tmp_path.name}"[:60]  # RunConfig(name=...) of fit_with_controller
    steps = [json.loads((p / "meta.json").read_text())["global_step"]
             for p in sorted(run_dir.glob("checkpoint_*")) if p.is_dir()]
    assert steps == [10, 15, 20] * len(INTERVALS)


def _inbox(fail: bool):
    import ray

    @ray.remote(num_cpus=0, max_concurrency=2)  # threaded: `taken` may run while an ingest is busy
    class Inbox:
        def __init__(self) -> None:
            self.reports: list[dict] = []

        def ingest(self, report: dict) -> bool:
            time.sleep(0.5)
            if fail:
                raise RuntimeError("controller down")
            self.reports.append(report)
            return True

        def taken(self) -> list[dict]:
            return list(self.reports)

    return Inbox.remote()


def _state():
    # the reporter reads a CompressionState's plan version, byte ledger, bytes inside the
    # node (two levels) and layer statistics
    return SimpleNamespace(plan=SimpleNamespace(version=3), ledger=SimpleNamespace(wire_total=10.0, dense_total=40.0),
                           intra_bytes=30.0, stats=[])


def test_the_final_report_is_taken_before_send_returns_and_only_once(ray_cluster):
    import ray

    from raycomp._internal.train.reporter import Outages, StatsReporter

    inbox = _inbox(fail=False)
    reporter = StatsReporter(inbox, "r", 1, Outages())
    reporter.eval_metric = 0.4
    reporter.record(1.0, 0.1, 0.02, 8)
    reporter.send(_state(), 19, 3, False, final=True)
    # finish() relies on it: rank 0 summarises the run only after every rank's last report is in
    [taken] = ray.get(inbox.taken.remote())
    assert (taken["step"], taken["eval_metric"], taken["wire_bytes"], taken["intra_bytes"]) == (19, 0.4, 10.0, 30.0)
    reporter.send(_state(), 19, 3, False, final=True)  # close() after finish(): nothing new
    assert len(ray.get(inbox.taken.remote())) == 1 and reporter.outages.count == 0
    ray.kill(inbox)


def test_an_evaluation_after_a_final_boundary_goes_with_that_interval_sent_again(ray_cluster):
    import ray

    from raycomp._internal.train.reporter import Outages, StatsReporter

    inbox = _inbox(fail=False)
    reporter = StatsReporter(inbox, "r", 0, Outages())
    reporter.record(2.0, 5.0, 1.0, 8)  # the fit's first step: its loss counts, its time does not
    reporter.record(1.0, 0.1, 0.02, 8)
    reporter.record(3.0, 0.3, 0.04, 8)
    reporter.send(_state(), 19, 3, False)  # the last step was a boundary
    reporter.eval_metric = 0.4  # then the run evaluated
    reporter.send(_state(), 18, 3, False, final=True)  # not the step last sent: nothing to repeat
    reporter.eval_metric = 0.4
    reporter.send(_state(), 19, 3, False, final=True)
    boundary, again = ray.get(inbox.taken.remote())
    interval = ("step", "loss", "step_seconds", "comm_seconds", "samples_per_second")
    assert [boundary[k] for k in interval] == [19, 2.0, pytest.approx(0.2), pytest.approx(0.03), pytest.approx(40.0)]
    assert [again[k] for k in interval] == [boundary[k] for k in interval]
    assert (boundary["eval_metric"], again["eval_metric"]) == (None, 0.4)
    reporter.send(_state(), 19, 3, False, final=True)  # close() after finish(): nothing new
    assert len(ray.get(inbox.taken.remote())) == 2 and reporter.outages.count == 0
    ray.kill(inbox)


def test_a_final_report_the_controller_refuses_is_one_outage(ray_cluster):
    import ray

    from raycomp._internal.train.reporter import Outages, StatsReporter

    inbox = _inbox(fail=True)
    reporter = StatsReporter(inbox, "r", 0, Outages())
    reporter.record(1.0, 0.1, 0.02, 8)
    reporter.send(_state(), 19, 3, False, final=True)
    assert reporter.outages.count == 1
    reporter.send(_state(), 19, 3, False, final=True)  # the second call must not count it again
    assert reporter.outages.count == 1
    ray.kill(inbox)


def test_only_the_first_interval_leaves_out_its_first_step_and_only_beside_others(ray_cluster):
    """The fit's first step (DDP building its buckets) would inflate the compute the cost
    model prices every plan with; an interval of that one step still reports it."""
    import ray

    from raycomp._internal.train.reporter import Outages, StatsReporter

    inbox = _inbox(fail=False)
    lone = StatsReporter(inbox, "r", 0, Outages())
    lone.record(1.0, 0.5, 0.1, 8)
    lone.send(_state(), 0, 0, False)  # a one-step interval: its step is all there is
    lone.record(1.0, 0.2, 0.1, 8)
    lone.record(1.0, 0.4, 0.1, 8)
    lone.send(_state(), 2, 0, False)  # the first interval is past: every step counts
    reporter = StatsReporter(inbox, "r", 1, Outages())
    reporter.record(1.0, 0.9, 0.1, 8)
    reporter.record(1.0, 0.3, 0.1, 8)
    reporter.send(_state(), 1, 0, False)
    reporter.record(1.0, 0.7, 0.1, 8)
    reporter.record(1.0, 0.3, 0.1, 8)
    reporter.send(_state(), 3, 0, False)
    lone.reap(wait_s=10)
    reporter.reap(wait_s=10)
    seconds = {(r["rank"], r["step"]): r["step_seconds"] for r in ray.get(inbox.taken.remote())}
    assert seconds == {(0, 0): pytest.approx(0.5), (0, 2): pytest.approx(0.3),
                       (1, 1): pytest.approx(0.3), (1, 3): pytest.approx(0.5)}
    ray.kill(inbox)
