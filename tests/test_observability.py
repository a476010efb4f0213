"""Metrics end to end: a real Prometheus (Debian package) scrapes the controller's exporter
during a real 2-worker run; every dashboard query returns data, the catalogue and the
dashboard agree, and the scraped byte counters equal the run's summary.json."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from jobs import dashboard
from jobs.faults import DrillConfig
from jobs.train import prepare, run
from raycomp._internal.observe.metrics import CATALOGUE, series_names
from raycomp.controllers.exporter import Exporter
from raycomp.controllers.service import Controller
from raycomp.controllers.state import RunState
from tests.distributed import free_port
from tests.support.controller_reports import register, report
from tests.support.repo import REPO

DIGITS = str(REPO / "jobs" / "configs" / "digits.yaml")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.read().decode()


def _api(base: str, endpoint: str, params: dict) -> list[dict]:
    """The result of a Prometheus HTTP API query (``/api/v1/<endpoint>``)."""
    answer = json.loads(scrape(f"{base}/api/v1/{endpoint}?" + urllib.parse.urlencode(params)))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def query(base: str, expr: str) -> list[dict]:
    return _api(base, "query", {"query": expr})


def query_range(base: str, expr: str, start: float, end: float, step: float = 2.0) -> list[dict]:
    """``expr`` evaluated every ``step`` seconds from ``start`` to ``end``, as a dashboard
    panel shows it over a time range."""
    return _api(base, "query_range", {"query": expr, "start": start, "end": end, "step": step})


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture
def prometheus(tmp_path):
    """A real Prometheus server on a free loopback port, scraping every second."""
    assert shutil.which("prometheus"), "the Debian package 'prometheus' is installed by scripts/setup.sh"
    sd_file = tmp_path / "targets.json"
    config = dashboard.prometheus_config(str(sd_file), interval="1s")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(dashboard.alert_rules()))
    for _attempt in range(3):  # a port found free can be taken before Prometheus binds it
        port = free_port()
        log = tmp_path / "prometheus.log"
        process = subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=log.open("w"),
        )
        base = f"http://127.0.0.1:{port}"
        up = wait_for(lambda base=base, process=process: _ready(base) or process.poll() is not None, timeout=30)
        if up and process.poll() is None:
            break
        process.terminate()
        process.wait(timeout=20)
    else:
        raise AssertionError(log.read_text()[-2000:])
    try:
        yield base, sd_file
    finally:
        process.terminate()
        process.wait(timeout=20)


def _ready(base: str) -> bool:
    try:
        return "Ready" in scrape(f"{base}/-/ready")
    except OSError:
        return False


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_every_dashboard_query_returns_data_from_a_real_run(ray_cluster, prometheus, tmp_path):
    base, sd_file = prometheus
    run_id = f"prom-{tmp_path.name}"
    name = f"ctl-prom-{tmp_path.name}"[:60]  # unique: the detached actor outlives this test in the session's cluster
    config, run_id, output = prepare([
        "--config", DIGITS, "--output", str(tmp_path / "run"), "--run-id", run_id,
        # each evaluation 2 s longer: Prometheus (1 s scrapes) sees the fallback counter at 0
        # before the step-30 fault and at 1 after it. Without the pause a fast run can train
        # before the first scrape, the counter first scraped at 1, which the fallback
        # annotation's changes(...[1m]) shows as no change
        "workload.epochs=3", "faults.nan_at_step=30", "compression.guard.stable_steps=10",
        "faults.slow_eval_seconds=2",
        f"controller.name={name}", "controller.metrics_port=0",
        f"controller.metrics_sd_file={sd_file}",
    ], DrillConfig)
    started = time.time()
    summary = run(config, run_id, output)
    assert summary["status"] == "succeeded"
    import ray

    # the node-link panel shows two-level runs only, and no two-level run fits this one-node
    # cluster: a run registers as one (2 nodes of 2 workers, its node link timed), as a
    # two-level run's rank 0 does (the switched testbed's long checks train real ones), here
    # before the fp16 run so that the dashboard's time range holds its samples
    levels_id = f"levels-{tmp_path.name}"
    ray.get(ray.get_actor(name, namespace=config.controller.namespace).register_run.remote(
        levels_id, 4, {"fc1.weight": [64, 64]}, "static", {}, 0, 5, 1024, per_node=2, node_link=1 / 5e8))
    # and an fp16 run beside it, for the loss-scale panel
    fp16_config, fp16_id, fp16_output = prepare([
        "--config", DIGITS, "--output", str(tmp_path / "fp16"), "--run-id", f"prom16-{tmp_path.name}",
        "workload.epochs=1", "workload.precision=fp16", "faults.slow_eval_seconds=2",
        f"controller.name={name}", "controller.metrics_port=0", f"controller.metrics_sd_file={sd_file}",
    ], DrillConfig)
    assert run(fp16_config, fp16_id, fp16_output)["status"] == "succeeded"
    controller = ray.get_actor(name, namespace=config.controller.namespace)
    ray.get(controller.ingest.remote({"run_id": "no-such-run"}))  # a malformed report: counted
    ray.get(controller.ingest.remote({**report(run_id, 0, 999), "loss": float("nan")}))

    # the last scrape after the run ended carries the final totals
    wire = f'sum(raycomp_wire_bytes_total{{run="{run_id}"}})'
    assert wait_for(lambda: [r for r in query(base, wire) if float(r["value"][1]) == summary["wire_bytes_total"]]), (
        query(base, wire), summary["wire_bytes_total"])
    inside = wait_for(lambda: query(base, f'raycomp_node_link_bytes_per_second{{run="{levels_id}"}}'))
    assert inside and float(inside[0]["value"][1]) == pytest.approx(5e8)  # the registered link, scraped
    dense = query(base, f'sum(raycomp_dense_bytes_total{{run="{run_id}"}})')
    assert float(dense[0]["value"][1]) == summary["dense_bytes_total"]
    assert wait_for(lambda: query(base, 'sum(raycomp_controller_rejected_reports_total) >= 2'))
    skipped = query(base, f'raycomp_skipped_steps_total{{run="{run_id}"}}')
    assert float(skipped[0]["value"][1]) == summary["skipped_steps"] == 1  # the NaN step
    scale = query(base, f'raycomp_loss_scale{{run="{fp16_id}"}}')
    assert float(scale[0]["value"][1]) == 2.0**16  # the scaler's default: digits never overflows
    assert not query(base, f'raycomp_loss_scale{{run="{run_id}"}}')  # fp32: no scaler, no series

    board = json.loads((REPO / "dashboards" / "grafana" / "raycomp.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board["annotations"]["list"]]
    assert len(exprs) == sum(len(m.panels) for m in CATALOGUE) + 1
    # over the run's time range, as the dashboard shows it: a windowed expression such as
    # changes(...[1m]) has data only within a minute of its event, not at any one instant
    ended = time.time()
    # the standalone exporter's names (source "raycomp"); Ray's are checked in tests/test_ray_metrics.py
    exprs = [e.replace("${source}", "raycomp") for e in exprs]
    empty = [e for e in exprs
             if not query_range(base, e.replace("$run", f"{run_id}|{fp16_id}|{levels_id}"), started, ended)]
    assert not empty, f"queries without data: {empty}"
    rules = json.loads(scrape(f"{base}/api/v1/rules"))["data"]["groups"]
    assert {r["name"] for g in rules for r in g["rules"]} == {"RaycompFallbackStuck", "RaycompNoReports"}


def test_catalogue_and_dashboard_agree():
    assert dashboard.main(["--check"]) == 0, "dashboards/ are stale: run python -m jobs.dashboard"
    board = json.loads((REPO / "dashboards" / "grafana" / "raycomp.json").read_text())
    text = json.dumps([t["expr"] for p in board["panels"] for t in p.get("targets", [])]).replace("${source}", "raycomp")
    queried = set(re.findall(r"raycomp_[a-z_]+", text))
    stored = {s for m in CATALOGUE for s in series_names(m)}
    assert queried <= stored, f"dashboard queries metrics outside the catalogue: {queried - stored}"
    for metric in CATALOGUE:
        assert any(s in queried for s in series_names(metric)), f"{metric.name} is on no panel"
        assert metric.name.startswith("raycomp_")
        assert metric.kind != "counter" or metric.name.endswith("_total")
        assert metric.kind != "histogram" or metric.name.endswith("_seconds")
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "source", "run"} <= variables
    assert {p["title"] for p in board["panels"] if p["type"] == "row"} == {
        "Compression", "Convergence", "Controller decisions", "Throughput"}


def test_raycomp_dashboard_writes_the_committed_files(tmp_path):
    from raycomp import cli

    assert cli.main(["dashboard", "--out", str(tmp_path / "out")]) == 0
    written = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert written == ["grafana/raycomp.json", "prometheus/alerts.yml", "prometheus/prometheus.yml"]
    for name in written:
        assert (tmp_path / "out" / name).read_text() == (REPO / "dashboards" / name).read_text(), name


def test_the_dashboard_reads_the_metrics_from_either_source():
    """Every query names its metrics through the ``source`` variable: the exporter's names
    with one choice, Ray's (``ray_`` + the same name) with the other, never both at once."""
    from raycomp._internal.observe.dashboard import SOURCES

    board = json.loads((REPO / "dashboards" / "grafana" / "raycomp.json").read_text())
    source = next(v for v in board["templating"]["list"] if v["name"] == "source")
    assert [o["value"] for o in source["options"]] == [value for _, value in SOURCES] == ["raycomp", "ray_raycomp"]
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board["annotations"]["list"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    stored = {s for m in CATALOGUE for s in series_names(m)}
    for expr in exprs:
        assert "${source}_" in expr and "raycomp_" not in expr, expr
        for prefix in ("raycomp", "ray_raycomp"):
            names = set(re.findall(r"[a-z_]*raycomp_[a-z_]+", expr.replace("${source}", prefix)))
            assert names and names <= {prefix.removesuffix("raycomp") + s for s in stored}, (expr, names)


def test_exporter_survives_bad_input_and_counts_rejects(tmp_path):
    controller = Controller()
    exporter = Exporter(controller, "127.0.0.1", 0, str(tmp_path / "targets.json"))
    try:
        targets = json.loads((tmp_path / "targets.json").read_text())
        assert targets[0]["targets"] == [f"127.0.0.1:{exporter.port}"]
        register(controller, "r1")
        for bad in ({**report("r1", 0, 4), "loss": float("nan")}, report("ghost", 0, 4), [1, 2], {"run_id": 3}):
            controller.ingest(bad)
        for rank in (0, 1):
            controller.ingest(report("r1", rank, 4))
        text = scrape(exporter.url)
        assert 'raycomp_controller_rejected_reports_total{reason="malformed"} 3.0' in text
        assert 'raycomp_controller_rejected_reports_total{reason="unknown_run"} 1.0' in text
        assert 'raycomp_wire_bytes_total{rank="1",run="r1"} 4000.0' in text
        assert 'raycomp_layer_grad_norm{layer="fc1.weight",run="r1"} 1.0' in text
        assert "ghost" not in text
    finally:
        exporter.close()


def test_layer_labels_are_bounded():
    from raycomp._internal.observe.metrics import MAX_LAYER_LABELS, OTHER_LAYERS, group_layers

    sizes = {f"l{i}": i + 1 for i in range(100)}
    grouped = group_layers({n: 1.0 for n in sizes}, sizes, "rss")
    assert len(grouped) == MAX_LAYER_LABELS and "l99" in grouped and "l0" not in grouped
    assert grouped[OTHER_LAYERS] == pytest.approx((100 - MAX_LAYER_LABELS + 1) ** 0.5)


def test_metrics_endpoint_binds_loopback_by_default():
    from raycomp.config import ControllerSection

    assert ControllerSection().metrics_host == "127.0.0.1"
    from raycomp._internal.observe.metrics import SD_DIR

    prometheus_yml = (REPO / "dashboards" / "prometheus" / "prometheus.yml").read_text()
    assert f"{SD_DIR}/*.json" in prometheus_yml


def test_the_plan_s_local_steps_are_exported_as_their_interval(tmp_path):
    from raycomp.config import LocalSection

    controller = Controller()
    exporter = Exporter(controller, "127.0.0.1", 0, str(tmp_path / "targets.json"))
    try:
        local = LocalSection(mode="fixed", sync_every=8).model_dump(mode="json")
        controller.register_run("per-step", 2, {"fc1.weight": 4096}, "static", {}, 0, 5, 1024)
        controller.register_run("local", 2, {"fc1.weight": 4096}, "static", {"local": local}, 0, 5, 1024)
        for rank, outer in ((0, 3), (1, 2)):  # a rank's report may lag the other's
            assert controller.ingest({**report("local", rank, 9), "layers": [], "outer_steps": outer, "lr": 0.05})
        text = scrape(exporter.url)
        assert 'raycomp_learning_rate{run="local"} 0.05' in text
        assert 'raycomp_learning_rate{run="per-step"}' not in text  # no rate reported: no series
        assert 'raycomp_local_sync_every{run="local"} 8.0' in text
        assert 'raycomp_local_sync_every{run="per-step"} 0.0' in text
        assert 'raycomp_outer_steps_total{run="local"} 3.0' in text
        assert 'raycomp_outer_steps_total{run="per-step"} 0.0' in text
    finally:
        exporter.close()


def test_the_bytes_inside_nodes_are_exported_per_rank_beside_those_across(tmp_path):
    controller = Controller()
    exporter = Exporter(controller, "127.0.0.1", 0, str(tmp_path / "targets.json"))
    try:
        controller.register_run("levels", 4, {"fc1.weight": 4096}, "static", {}, 0, 5, 1024, per_node=2,
                                node_link=1 / 5e8)
        for rank in range(4):
            controller.ingest({**report("levels", rank, 4), "layers": [], "intra_bytes": 1000.0 * (rank + 1)})
        text = scrape(exporter.url)
        assert 'raycomp_intra_node_bytes_total{rank="3",run="levels"} 4000.0' in text
        assert 'raycomp_wire_bytes_total{rank="3",run="levels"} 4000.0' in text
        inside = re.search(r'^raycomp_node_link_bytes_per_second\{run="levels"\} (\S+)$', text, re.M)
        assert inside is not None and float(inside.group(1)) == pytest.approx(5e8)  # the timed link inside nodes
        restored = RunState.from_dict(controller.runs["levels"].to_dict())  # a controller restart keeps them
        assert restored.per_rank_intra == {0: 1000.0, 1: 2000.0, 2: 3000.0, 3: 4000.0}
        assert restored.node_link == 1 / 5e8
        restored.resize(2)  # an elastic restart: the new ranks report their own totals
        assert restored.per_rank_intra == {}
    finally:
        exporter.close()


@pytest.mark.parametrize("bad", [0.0, -1e-9, float("nan"), float("inf"), "fast", True])
def test_a_registration_with_a_bad_node_link_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"^node_link: expected None or a finite number of seconds per byte > 0"):
        Controller().register_run("r", 4, {"fc1.weight": 4096}, "static", {}, 0, 5, 1024, per_node=2,
                                  node_link=bad)


def test_the_dashboard_imports_without_a_dangling_input():
    """Grafana's import asks for each ``__inputs`` entry and substitutes ``${NAME}`` where it
    occurs: an input that no panel, variable or annotation names would be asked for and then
    used nowhere. Every data source is the ``datasource`` variable, picked on the dashboard."""
    board = json.loads((REPO / "dashboards" / "grafana" / "raycomp.json").read_text())
    text = json.dumps({k: v for k, v in board.items() if k != "__inputs"})
    for declared in board.get("__inputs", []):
        assert "${" + declared["name"] + "}" in text, f"input {declared['name']} is used nowhere"
    sources = [p["datasource"] for p in board["panels"] if "datasource" in p]
    sources += [t["datasource"] for p in board["panels"] for t in p.get("targets", [])]
    sources += [a["datasource"] for a in board["annotations"]["list"]]
    assert sources and all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources), sources
