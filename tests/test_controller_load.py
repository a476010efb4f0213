"""Load smoke test of the controller actor (quick mode of ``python -m jobs.bench controller``)."""

from __future__ import annotations

from jobs.bench_controller import render_markdown, run_load

WORKERS, RATE, DURATION, RUNS = 16, 10.0, 5.0, 4


def test_controller_serves_quick_load_with_bounded_memory(ray_cluster):
    res = run_load(workers=WORKERS, rate=RATE, duration=DURATION, runs=RUNS, n_layers=20,
                   generators=2, log=lambda *a: None)

    assert res["sent"] > 0 and res["errors"] == 0 and res["unresolved"] == 0, res["generators"]
    assert res["rejected"] == 0 and res["accepted"] == res["sent"]
    assert res["achieved_rate"] >= 0.8 * WORKERS * RATE, res["achieved_rate"]
    assert res["latency"]["samples"] == res["sent"]  # every call timed
    assert res["latency"]["p99_ms"] < 500, res["latency"]
    assert res["rss"]["end_mb"] - res["rss"]["start_mb"] < 50, res["rss"]

    health = res["health"]
    assert health["runs"] == RUNS and health["reports"] == res["sent"] and not health["rejected"]
    assert set(res["runs"]) == {f"load-{i:03d}" for i in range(RUNS)}
    assert sum(run["reports"] for run in res["runs"].values()) == res["sent"]
    for run in res["runs"].values():
        assert run["detections"] >= 1  # the critical policy ran (warm-up is 20 of ~50 steps)
    # the exporter kept answering while the load ran, and saw every report at the end
    assert res["scrapes"] and all(s["ok"] for s in res["scrapes"]), res["scrapes"]
    assert res["scrapes"][-1]["reports_total"] == res["sent"]

    report = render_markdown(res, "python -m jobs.bench controller --quick", {"cpu_model": "test"})
    assert "| reports sent / accepted / rejected / errors |" in report and "## Interpretation" in report


def test_generator_drops_reports_like_a_worker_when_the_controller_does_not_answer(ray_cluster):
    from jobs.bench_controller import LoadGenerator

    @ray_cluster.remote(num_cpus=0, max_concurrency=64)
    class Stalled:
        def ingest(self, report):
            import time

            time.sleep(3.0)  # answers only after the load
            return True

    generator = LoadGenerator()
    generator.attach(Stalled.remote())
    ranks = [("load-000", 0, 0.0), ("load-000", 1, 0.05)]
    out = generator.drive(ranks, n_layers=2, rate=10.0, duration=0.98, start_at=0.0, max_in_flight=3)
    # 10 reports due per rank: 3 sent (then 3 unanswered), 7 dropped, every sent one answered
    assert (out["sent"], out["dropped"], out["accepted"], out["unresolved"]) == (6, 14, 6, 0), out
