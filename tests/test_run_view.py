"""A run you can see into: rank 0's plan-switch line (rule and reason with the plan), the
default progress line, the run's files under the Ray Train storage path, and ``raycomp
inspect`` / ``raycomp plot`` on them.

One real 2-worker run (module fixture ``run``) serves the tests that need one: the schedule
policy switches dense -> int8 -> Top-K, so its timeline has two controller switches with
their rule (``schedule.stage``) and reasons, and its bytes differ by plan."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from raycomp import cli
from raycomp._internal.train.outputs import RunOutputs, run_outputs
from raycomp._internal.train.plan_log import PlanLog
from raycomp._internal.train.step_log import StepLog
from raycomp.plan import CompressorSpec, Plan
from raycomp.train import TrainOptions

EPOCHS, STEPS = 2, 15  # per epoch: 30 steps, boundaries every 5 (and at 3)
INT8_FROM = 12  # the schedule's second stage
LAYERS = ["0.weight", "2.weight"]  # what a plan compresses (the biases are below min_compress_numel)


def _train(config: dict) -> dict:
    import torch

    import raycomp.train
    from raycomp.config import CompressionSection, ControllerSection

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stages = [{"start_step": 0, "compressor": {"name": "int8"}},
              {"start_step": INT8_FROM, "compressor": {"name": "topk", "ratio": 0.1}}]
    options = TrainOptions(compression=CompressionSection(policy="schedule", warmup_steps=3,
                                                          schedule={"stages": stages}),
                           controller=ControllerSection(name=config["controller"], interval_steps=5))
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    loop = raycomp.train.current()
    for epoch in loop.epochs(EPOCHS, STEPS):
        for _ in range(loop.step_in_epoch, STEPS):
            loss = model(torch.randn(8, 64)).pow(2).mean()
            loss.backward()
            raycomp.train.step(loss, samples=8)
        raycomp.train.report({"accuracy": 0.5 + epoch / 10})
    return raycomp.train.finish()


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    """A finished run with no ``output_dir``: its storage path, run directory and the
    Ray session's worker logs written during it."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raycomp.train
    from raycomp.config import ControllerSection

    storage = tmp_path_factory.mktemp("storage")
    name = f"view-{storage.name}"[:60]
    callback = raycomp.train.ControllerCallback(ControllerSection(name=name, metrics_enabled=False))
    started = time.time()
    TorchTrainer(_train, train_loop_config={"controller": name}, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name=name, storage_path=str(storage), callbacks=[callback])).fit()
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    worker_logs = [p.read_text(errors="replace") for p in logs.glob("worker-*.err") if p.stat().st_mtime >= started]
    return SimpleNamespace(storage=storage, directory=storage / name, name=name, worker_logs=worker_logs)


@pytest.fixture
def configured(caplog):
    """The application configured the ``raycomp`` logger (a handler of its own), so rank 0
    adds none and its records reach ``caplog`` (show_progress' handler does not propagate)."""
    logger, handler = logging.getLogger("raycomp"), logging.NullHandler()
    logger.addHandler(handler)
    caplog.set_level(logging.INFO, logger="raycomp.train")
    yield caplog
    logger.removeHandler(handler)


# --- 1: the switch line ------------------------------------------------------------------------
def _decided(version: int, spec: CompressorSpec, start: int) -> Plan:
    from raycomp.controllers.policies.decision import Decision
    from raycomp.controllers.policies.schedule import ScheduleWhy

    return Decision.of(Plan(default=spec), ScheduleWhy(start)).plan.with_version(version)


def test_a_decision_s_rule_and_facts_travel_with_the_plan():
    plan = _decided(3, CompressorSpec.of("topk", ratio=0.01), 40)
    again = Plan.from_json(plan.to_json())  # what the broadcast hands every rank
    assert (again.rule, dict(again.why), again.reason) == \
        ("schedule.stage", {"rule": "schedule.stage", "start_step": 40}, "schedule stage from step 40")
    assert again.digest() == plan.digest()
    # a plan built by hand has none, and its JSON (hence its digest) is what it was before
    assert "why" not in Plan().to_dict() and Plan().rule == ""
    with pytest.raises(ValueError, match=r"^plan\.why: expected a mapping"):
        Plan.from_dict({"why": ["rule"]})


def test_plan_summaries_say_what_a_plan_does():
    layers = [f"l{i}" for i in range(14)]
    topk = CompressorSpec.of("topk", ratio=0.01)
    plan = Plan.per_layer({name: topk for name in layers[:12]})
    assert plan.summary(layers) == "topk(ratio=0.01) on 12/14 layers"
    assert Plan(dense=True, default=topk).summary(layers) == "dense"
    assert Plan().summary(layers) == "dense"
    from raycomp.plan import LocalMode

    local = Plan(default=CompressorSpec.of("int8"), local=LocalMode(8, 2))
    assert local.summary(layers[:2]) == "local steps H=8 (2 fragments), int8 on 2/2 layers"
    assert Plan.uniform("int8").summary() == "int8"


def test_rank0_logs_each_switch_in_one_line_with_its_rule_and_the_other_ranks_nothing(tmp_path, configured):
    caplog = configured
    before, after = Plan(), _decided(3, CompressorSpec.of("topk", ratio=0.01), 40)
    for rank in (1, 0):
        directory = tmp_path / f"rank{rank}"
        timeline = PlanLog(directory, rank, LAYERS + ["other"])
        timeline.open(before, None)
        timeline.switch(40, "plan", before, after)
        if rank == 1:
            assert not caplog.records and not (directory / "plans.jsonl").exists()
    [line] = [r.getMessage() for r in caplog.records]
    assert line == ("step 40: plan v3 dense -> topk(ratio=0.01) on 3/3 layers "
                    "[schedule.stage: schedule stage from step 40]")
    start, switch = [json.loads(x) for x in (tmp_path / "rank0" / "plans.jsonl").read_text().splitlines()]
    assert (start["kind"], start["step"], start["to"]) == ("start", 0, "dense")
    assert (switch["step"], switch["from"], switch["to"], switch["rule"], switch["why"]["start_step"]) == \
        (40, "dense", "topk(ratio=0.01) on 3/3 layers", "schedule.stage", 40)


def test_a_plan_the_guard_holds_dense_is_logged_as_waiting(tmp_path, configured):
    caplog = configured
    timeline = PlanLog(tmp_path, 0, LAYERS)
    timeline.open(Plan(), None)
    held = _decided(4, CompressorSpec.of("int8"), 10)
    timeline.switch(12, "plan", Plan(version=3, dense=True, reason="guard: nonfinite_gradient"),
                    Plan(version=4, dense=True, reason="guard: nonfinite_gradient"), held=held)
    assert caplog.records[-1].getMessage() == ("step 12: plan v4 dense -> dense (the guard holds; then int8 on "
                                               "2/2 layers) [schedule.stage: schedule stage from step 10]")


def test_the_switch_line_is_visible_in_a_worker_by_default(tmp_path, capsys):
    logger = logging.getLogger("raycomp")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers.clear()
    try:
        timeline = PlanLog(tmp_path, 0, LAYERS)  # rank 0 with an unconfigured logger: a handler
        timeline.switch(5, "plan", Plan(), _decided(1, CompressorSpec.of("int8"), 0))
        assert "INFO raycomp.train: step 5: plan v1 dense -> int8 on 2/2 layers [schedule.stage:" \
            in capsys.readouterr().err
    finally:
        logger.handlers[:] = saved[0]
        logger.setLevel(saved[1])
        logger.propagate = saved[2]


def test_the_real_run_logs_its_switches_on_rank0_only(run):
    switch_lines = [[line for line in text.splitlines() if "raycomp.train: step " in line and ": plan v" in line]
                    for text in run.worker_logs]
    [lines] = [found for found in switch_lines if found]  # one worker (rank 0) logged them
    assert any("dense -> int8 on 2/2 layers [schedule.stage: schedule stage from step 0]" in line for line in lines)
    assert any(f"int8 on 2/2 layers -> topk(ratio=0.1) on 2/2 layers [schedule.stage: schedule stage from step "
               f"{INT8_FROM}]" in line for line in lines)


# --- 2: the progress line -------------------------------------------------------------------------
def test_a_progress_line_every_100_steps_by_default_naming_the_plan(tmp_path, configured):
    caplog = configured
    assert TrainOptions().progress_every == 100
    with pytest.raises(ValueError, match=r"^progress_every: must be an integer >= 0"):
        TrainOptions(progress_every=-1)
    for rank in (1, 0):
        log = StepLog(tmp_path, rank, TrainOptions().progress_every)
        log.open(None)
        log.plan_summary = "topk(ratio=0.01) on 12/14 layers"
        for step in range(200):
            log.write({"step": step, "loss": 0.5, "plan_version": 3, "dense": False, "wire_bytes": 10.0 * (step + 1),
                       "dense_bytes": 80.0 * (step + 1)}, 8)
        log.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("step 100  loss 0.5  ratio 8.0x  plan v3 topk(ratio=0.01) "
                                                   "on 12/14 layers  ")
    quiet = StepLog(tmp_path, 0, 0)  # 0: never
    quiet.open(None)
    quiet.write({"step": 99, "loss": 0.5, "plan_version": 3, "dense": False, "wire_bytes": 1.0,
                 "dense_bytes": 1.0}, 8)
    assert len(caplog.records) == 2


# --- 3: where the files go --------------------------------------------------------------------------
def test_the_run_s_files_land_under_its_storage_path(run):
    files = sorted(str(p.relative_to(run.directory)) for p in run.directory.rglob("*.json*")
                   if "checkpoint" not in str(p))
    assert {"evals.jsonl", "plans.jsonl", "summary.json", "steps/rank0.jsonl", "steps/rank1.jsonl"} <= set(files)
    summary = json.loads((run.directory / "summary.json").read_text())
    assert summary["output_dir"] == str(run.directory) and summary["steps"] == EPOCHS * STEPS
    assert len((run.directory / "steps" / "rank1.jsonl").read_text().splitlines()) == EPOCHS * STEPS
    assert not (run.directory / "steps" / "rank1.jsonl").with_name("plans.jsonl").exists()


def _storage(filesystem, path):
    return SimpleNamespace(get_storage=lambda: SimpleNamespace(storage_filesystem=filesystem,
                                                               experiment_fs_path=path))


def test_output_dir_wins_then_local_storage_then_a_copy_to_remote_storage(tmp_path):
    import pyarrow.fs

    local = pyarrow.fs.LocalFileSystem()
    assert run_outputs(str(tmp_path / "mine"), "r", _storage(local, "/x")) == RunOutputs(tmp_path / "mine")
    assert run_outputs(None, "r", _storage(local, str(tmp_path / "run"))) == RunOutputs(tmp_path / "run")

    def no_storage():
        raise NotImplementedError("local mode")

    assert run_outputs(None, "r", SimpleNamespace(get_storage=no_storage)).directory.parts[-2:] == ("raycomp", "r")
    # a filesystem that is not local (here a sub-tree of one, as s3:// would be): staged, copied at the end
    remote = pyarrow.fs.SubTreeFileSystem(str(tmp_path / "bucket"), local)
    (tmp_path / "bucket").mkdir()
    outputs = run_outputs(None, f"r-{tmp_path.name}", _storage(remote, "runs/r"))
    assert outputs.remote_dir == "runs/r" and outputs.location == "runs/r"
    (outputs.directory / "steps").mkdir(parents=True, exist_ok=True)
    for name in ("steps/rank0.jsonl", "steps/rank1.jsonl", "evals.jsonl", "plans.jsonl", "summary.json"):
        (outputs.directory / name).write_text(name)
    outputs.upload(1)
    assert [p.name for p in (tmp_path / "bucket" / "runs" / "r").rglob("*") if p.is_file()] == ["rank1.jsonl"]
    outputs.upload(0)
    copied = sorted(str(p.relative_to(tmp_path / "bucket" / "runs" / "r"))
                    for p in (tmp_path / "bucket" / "runs" / "r").rglob("*") if p.is_file())
    assert copied == ["evals.jsonl", "plans.jsonl", "steps/rank0.jsonl", "steps/rank1.jsonl", "summary.json"]
    assert (tmp_path / "bucket" / "runs" / "r" / "summary.json").read_text() == "summary.json"


# --- 4: raycomp inspect / plot ------------------------------------------------------------------------
def test_inspect_prints_the_timeline_with_reasons_and_bytes_that_match_the_summary(run, capsys):
    assert cli.main(["inspect", str(run.storage)]) == 0  # the storage path: its one run is found
    out = capsys.readouterr().out
    summary = json.loads((run.directory / "summary.json").read_text())
    timeline = [json.loads(x) for x in (run.directory / "plans.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["version"]) for e in timeline] == [("start", 0), ("plan", 1), ("plan", 2)]
    assert f"run {run.name}: succeeded, 30 steps, 2 ranks, policy schedule" in out
    assert "plan timeline (3 rows: 1 start, 2 controller switches; from plans.jsonl):" in out
    assert "start      v0   dense  [warm-up: dense]" in out
    assert (f"step {timeline[1]['step']:>6}  plan       v1   dense -> int8 on 2/2 layers  "
            "[schedule.stage: schedule stage from step 0]") in out
    assert (f"step {timeline[2]['step']:>6}  plan       v2   int8 on 2/2 layers -> topk(ratio=0.1) on 2/2 layers  "
            f"[schedule.stage: schedule stage from step {INT8_FROM}]") in out
    assert "switches by rule (controller): schedule.stage 2" in out
    wire, dense = summary["wire_bytes_total"], summary["dense_bytes_total"]
    assert f"total: wire {wire:,.0f} B" in out and f"dense {dense:,.0f} B" in out
    assert f"ratio {dense / wire:.2f}x" in out and "(equal to summary.json's totals)" in out
    rows = {line.split()[0]: line for line in out.splitlines()[out.splitlines().index(
        next(x for x in out.splitlines() if x.strip().startswith("plan ") and "ratio" in x)) + 1:][:3]}
    assert rows["v0"].split()[-1] == "dense" and rows["v0"].split()[-2] == "1.00x"
    ratios = [float(rows[v].split("x ")[0].split()[-1]) for v in ("v1", "v2")]
    assert 3.5 < ratios[0] < 4.5 and ratios[1] > ratios[0]  # int8 about 4x, Top-K 10% more
    assert "fallbacks to dense: 0" in out and "local-step syncs: none (no plan in local steps)" in out


def test_plot_writes_a_png(run, tmp_path, capsys):
    out = tmp_path / "run.png"
    assert cli.main(["plot", str(run.directory), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert capsys.readouterr().out.strip() == f"wrote {out}"


def test_plot_without_matplotlib_is_one_line_naming_the_package(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["plot", str(run.directory), "--out", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err == 'raycomp plot: needs matplotlib, not installed: pip install "raycomp[plot]"\n'


def test_a_run_argument_that_is_not_a_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such directory" in err and "Traceback" not in err
    assert cli.main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"raycomp plot: {tmp_path} is not a raycomp run directory: expected summary.json and "
                   "steps/rank<r>.jsonl there (a run's output directory) or in one of its subdirectories (a Ray "
                   "Train storage path, <storage_path>/<name>)\n")
    for name in ("a", "b"):
        (tmp_path / name / "steps").mkdir(parents=True)
    assert cli.main(["inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"raycomp inspect: {tmp_path} holds 2 runs (a, b): name one of them\n"


def _write_run(directory: Path, timeline: list[dict] | None, summary: dict | None) -> None:
    """A run's files by hand: 6 steps of one rank, the guard dense over steps 2-3."""
    (directory / "steps").mkdir(parents=True)
    records = [{"step": s, "plan_version": 0 if s < 1 else 1, "fallback": s in (2, 3), "dense": s < 1 or s in (2, 3),
                "loss": 1.0 / (s + 1), "wire_bytes": 100.0 * (s + 1), "dense_bytes": 400.0 * (s + 1)}
               for s in range(6)]
    (directory / "steps" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6,')
    if timeline is not None:
        (directory / "plans.jsonl").write_text("".join(json.dumps(e) + "\n" for e in timeline))
    if summary is not None:
        (directory / "summary.json").write_text(json.dumps(summary))


def test_inspect_shows_fallbacks_and_a_running_run(tmp_path, capsys):
    timeline = [{"step": 0, "kind": "start", "version": 0, "from": None, "to": "dense", "rule": None,
                 "reason": "warm-up: dense"},
                {"step": 1, "kind": "plan", "version": 1, "from": "dense", "to": "int8 on 2/2 layers",
                 "rule": "schedule.stage", "reason": "schedule stage from step 0"},
                {"step": 2, "kind": "fallback", "version": 1, "from": "int8 on 2/2 layers", "to": "dense",
                 "rule": None, "reason": "guard: nonfinite_gradient"},
                {"step": 4, "kind": "recovered", "version": 1, "from": "dense", "to": "int8 on 2/2 layers",
                 "rule": "schedule.stage", "reason": "schedule stage from step 0"}]
    _write_run(tmp_path / "run", timeline, None)
    assert cli.main(["inspect", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert ("run run: no summary.json: still running, or ended without raycomp.train.finish(); last step "
            "written ") in out and " ago, 6 steps, 1 ranks, policy ?" in out
    assert "fallbacks to dense: 1" in out
    assert "step      2  fallback   guard: nonfinite_gradient" in out
    assert "step      4  recovered  schedule stage from step 0" in out
    # bytes by plan and by the guard's hold: v1 compressed (steps 1, 4, 5), v1 held dense (2-3)
    assert "dense (guard)" in out and "total: wire 600 B" in out and "dense 2,400 B" in out


def test_inspect_derives_the_timeline_of_a_run_without_plans_jsonl(tmp_path, capsys):
    events = [{"step": 0, "kind": "plan", "reason": "schedule stage from step 0", "detail": "version 1",
               "why": {"rule": "schedule.stage", "start_step": 0}}]
    _write_run(tmp_path / "run", None, {"run_id": "old", "status": "succeeded", "steps": 6, "world_size": 1,
                                        "wire_bytes_total": 600.0, "dense_bytes_total": 2400.0,
                                        "fallback_events": [{"step": 1, "kind": "fallback",
                                                             "reason": "nonfinite_gradient"}],
                                        "policy": {"name": "schedule", "events": events}})
    assert cli.main(["inspect", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "from rank 0's step log and the controller's events" in out
    assert "step      1  plan       v1   dense -> compressed  [schedule.stage: schedule stage from step 0]" in out
    assert "step      2  fallback" in out and "step      4  recovered" in out
    assert "(equal to summary.json's totals)" in out
