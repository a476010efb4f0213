"""A run tells its own story: why it stays dense (once, on rank 0, and in ``raycomp
inspect``), in words that agree with its figures; ``raycomp plot``'s bytes on a scale that
shows their ratio and its plan bands readable; the command line's ``--version``, a closed
pipe, a missing matplotlib; ``inspect``'s counts and step ranges that agree with its rows;
a run without ``summary.json`` named for what it may be.

Two real runs (module fixture ``dense_runs``) stay dense all run: one worker (nothing to
reduce), and two workers under Adam whose step's compute dwarfs its communication."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from raycomp import cli
from raycomp._internal.observe import run_files, run_plot, run_report
from raycomp.controllers.policies.adaptive_why import AdaptiveWhy
from tests.support.run_story import held_dense, write_run

REPO = Path(__file__).resolve().parent.parent
STAYED = "the plan stayed dense all run: "


# --- why dense: the reasons' words follow the ratio --------------------------------------------
def _why(bandwidth: float, compute: float, predicted: tuple[float, ...], shift: int, **more) -> AdaptiveWhy:
    fields = {"rule": "adaptive.first", "bandwidth": bandwidth, "compute": compute, "predicted": predicted,
              "shift": shift, "top": len(predicted) - 1, "groups": (), "critical": 0, "raised": 0,
              "dense_layers": 2, "lossy_off": False, "prior_band": None, "passed_over_margin": None,
              "best_compressed": None, "slack": 0.1, **more}
    return AdaptiveWhy(**fields)


def test_a_reason_gives_the_link_in_figures_and_lets_the_ratio_say_fast_or_slow():
    # 1.11 MB/s, yet communication only 0.24x compute: no compressed plan is faster
    slow_link_cheap = _why(1.11e6, 0.1, (0.13, 0.124), shift=1)
    assert slow_link_cheap.text() == ("link 1.11 MB/s, communication 0.24x compute: compressing cannot pay → "
                                      "dense: compressed 130 ms vs dense 124 ms")
    # 12.5 MB/s, communication 1.1x compute: compressed
    fast_link_dear = _why(12.5e6, 0.1, (0.15, 0.21), shift=0, groups=(("int8", 2),), dense_layers=0)
    assert fast_link_dear.text() == "link 12.5 MB/s, communication 1.1x compute → int8 on 2; 150 ms vs dense 210 ms"
    # faster compressed, not by the band: it says so
    within = _why(1e8, 0.1, (0.118, 0.12), shift=1)
    assert within.text().startswith("link 100 MB/s, communication 0.2x compute: compressing saves too little → "
                                    "dense: compressed 118 ms vs dense 120 ms (within 10%)")
    two_level = _why(1e7, 0.1, (0.13, 0.124), shift=1, levels=(2, 2), node_link=1e9)
    assert two_level.text().startswith("2 nodes x 2, inside each node dense at 1e+03 MB/s; across nodes: node link "
                                       "10 MB/s, communication 0.24x compute: compressing cannot pay")
    for why in (slow_link_cheap, fast_link_dear, within, two_level):
        assert not re.search(r"\b(fast|slow)\b", why.text()), why.text()


def test_dense_why_names_one_worker_and_is_silent_for_a_run_that_compressed():
    assert run_report.dense_why({"world_size": 1}).startswith("one worker: there is no all-reduce to shrink")
    compressed = {"world_size": 2, "wire_bytes_total": 100.0, "dense_bytes_total": 400.0,
                  "policy": {"name": "adaptive", "policy_details": {"history": [[9, "dense", "x"]], "lossy": False}}}
    assert run_report.dense_why(compressed) is None
    held = {**compressed, "wire_bytes_total": 400.0}
    assert run_report.dense_why(held) == ("adaptive: x; lossy rungs off (adaptive.lossy: never, as for Adam and "
                                          "other optimizers whose update is not linear in the gradient)")
    static = {"world_size": 2, "wire_bytes_total": 400.0, "dense_bytes_total": 400.0,
              "policy": {"name": "static", "events": []}, "final_plan": {"reason": "static: none"}}
    assert run_report.dense_why(static) == "policy static: static: none"


@pytest.fixture(scope="module")
def dense_runs(ray_cluster, tmp_path_factory):
    storage = tmp_path_factory.mktemp("story")
    return {"one": held_dense(storage, f"one-{storage.name}", 1, "sgd"),
            "adam": held_dense(storage, f"adam-{storage.name}", 2, "adam", compute_pad_s=0.1)}


def _said(run) -> list[str]:
    return [line for log in run.worker_logs for line in log.splitlines() if STAYED in line]


@pytest.mark.parametrize("which", ["one", "adam"])
def test_a_run_held_dense_says_why_once_on_rank_0_and_in_inspect(dense_runs, which, capsys):
    run = dense_runs[which]
    said = _said(run)
    assert len(said) == 1, said  # one line, by rank 0 only (the Adam run has two workers)
    why = said[0].split(STAYED, 1)[1]
    summary = json.loads((run.directory / "summary.json").read_text())
    assert summary["wire_bytes_total"] >= summary["dense_bytes_total"] and summary["plan_switches"] == 0
    if which == "one":
        assert why == "one worker: there is no all-reduce to shrink, so compression has nothing to save"
    else:
        # the figures and the words agree: communication a small fraction of compute
        ratio = float(re.search(r"communication ([0-9.e+-]+)x compute: compressing (cannot pay|saves too "
                                r"little) → dense", why).group(1))
        assert ratio < 0.5, why
        assert why.startswith("adaptive: link ") and "lossy rungs off" in why and "Adam" in why
        assert not re.search(r"\b(fast|slow)\b", why), why
    assert cli.main(["inspect", str(run.directory)]) == 0
    out = capsys.readouterr().out
    assert out.count(f"dense all run: {why}\n") == 1, out


# --- raycomp plot --------------------------------------------------------------------------------
def _guarded_run(directory: Path, **more) -> None:
    timeline = [{"step": 0, "kind": "start", "version": 0, "from": None, "to": "dense", "rule": None,
                 "reason": "warm-up: dense"},
                {"step": 1, "kind": "plan", "version": 1, "from": "dense", "to": "int8 on 2/2 layers",
                 "rule": "schedule.stage", "reason": "schedule stage from step 0"},
                {"step": 2, "kind": "fallback", "version": 1, "from": "int8 on 2/2 layers", "to": "dense",
                 "rule": None, "reason": "guard: nonfinite_gradient"},
                {"step": 4, "kind": "recovered", "version": 1, "from": "dense", "to": "int8 on 2/2 layers",
                 "rule": "schedule.stage", "reason": "schedule stage from step 0"},
                {"step": 6, "kind": "fallback", "version": 1, "from": "int8 on 2/2 layers", "to": "dense",
                 "rule": None, "reason": "guard: nonfinite_gradient"},
                {"step": 7, "kind": "recovered", "version": 1, "from": "dense", "to": "int8 on 2/2 layers",
                 "rule": "schedule.stage", "reason": "schedule stage from step 0"}]
    write_run(directory, ranks=2, steps=40, timeline=timeline, fallback=(2, 3, 6), **more)


def test_plot_draws_bytes_from_zero_and_plan_labels_that_do_not_overlap(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    _guarded_run(tmp_path / "run")
    fig = run_plot.figure(run_files.load(tmp_path / "run"))
    try:
        _, bytes_ax, plan_ax = fig.axes[:3]
        assert bytes_ax.get_yscale() == "linear" and bytes_ax.get_ylim()[0] == 0
        top = bytes_ax.get_ylim()[1]
        assert 800 <= top <= 2 * 800  # dense 800 B a step (2 ranks): wire's 200 B is a quarter of it, seen as such
        legend = plan_ax.get_legend()
        assert {t.get_text() for t in legend.get_texts()} == {"dense", "int8 on 2/2 layers",
                                                              "dense (guard fallback)"}
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for t in plan_ax.texts]
        assert boxes, "no band carries its version"
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), [t.get_text() for t in plan_ax.texts]
    finally:
        plt.close(fig)


def test_plot_without_matplotlib_names_the_extra_in_one_line(tmp_path, capsys, monkeypatch):
    _guarded_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err == 'raycomp plot: needs matplotlib, not installed: pip install "raycomp[plot]"\n'
    assert 'pip install "raycomp[plot]"' in (REPO / "docs" / "usage.md").read_text()


# --- the command line -------------------------------------------------------------------------------
def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"raycomp {version('raycomp')}\n"


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    _guarded_run(tmp_path / "run")
    read, write = os.pipe()
    child = subprocess.Popen([sys.executable, "-m", "raycomp.cli", "inspect", str(tmp_path / "run")],
                             stdout=write, stderr=subprocess.PIPE, cwd=REPO)
    os.close(write)
    os.close(read)  # the reader is gone before the first line is written (as ``| head`` after its lines)
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) in (0, 141) and err == "", err


# --- inspect's counts, ranges and status ---------------------------------------------------------------
def test_inspect_counts_what_its_rows_are_and_its_step_ranges_do_not_overlap(tmp_path, capsys):
    _guarded_run(tmp_path / "run")
    assert cli.main(["inspect", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(x for x in lines if x.startswith("plan timeline ("))
    assert header == ("plan timeline (6 rows: 1 start, 1 controller switch, 2 guard fallbacks, 2 recoveries; "
                      "from plans.jsonl):")
    at = lines.index(header)
    rows = lines[at + 1:lines.index("", at)]
    assert all(x.startswith("  step ") for x in rows)
    assert len(rows) == 6 == sum(int(n) for n in re.findall(r"(\d+) [a-z]", header.split(":")[0].split("(")[1]))
    table = lines.index(next(x for x in lines if x.strip().startswith("plan ") and "ratio" in x))
    spans = []
    for row in lines[table + 1:]:
        if not row.strip().startswith("v"):
            break
        first, last = (int(n) for n in row.split()[1].split("-"))
        spans.append((first, last, row.split()[-1] if "guard" not in row else "guard"))
    # v0 at 0; v1 compressed 1, held dense 2-3, compressed 4-5, held 6, compressed 7-39: in order, disjoint
    assert [(a, b) for a, b, _ in spans] == [(0, 0), (1, 1), (2, 3), (4, 5), (6, 6), (7, 39)]
    assert [kind == "guard" for _, _, kind in spans] == [False, False, True, False, True, False]
    assert "total: wire 10,400 B" in "\n".join(lines) and "dense 32,000 B" in "\n".join(lines)


def test_a_run_without_summary_is_not_called_running(tmp_path, capsys):
    _guarded_run(tmp_path / "run")
    hours_ago = time.time() - 2 * 3600
    for log in (tmp_path / "run" / "steps").iterdir():
        os.utime(log, (hours_ago, hours_ago))
    assert cli.main(["inspect", str(tmp_path / "run")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("run run: no summary.json: still running, or ended without raycomp.train.finish(); "
                     "last step written 2 h ago, 40 steps, 2 ranks, policy ?")
