"""Generate this repository's Grafana dashboard and Prometheus files from the metric catalogue.

    python -m jobs.dashboard [--check]

Writes what :mod:`raycomp._internal.observe.dashboard` generates (``raycomp dashboard --out DIR`` for an
installed raycomp) into ``dashboards/``: ``grafana/raycomp.json``,
``prometheus/prometheus.yml`` and ``prometheus/alerts.yml``. ``--check`` exits 1 if the
committed files differ from what the catalogue generates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raycomp._internal.observe.dashboard import alert_rules, dashboard, prometheus_config
from raycomp._internal.observe.dashboard import files as files_under

__all__ = ["ROOT", "alert_rules", "dashboard", "files", "main", "prometheus_config"]

ROOT = Path(__file__).resolve().parents[1] / "dashboards"


def files() -> dict[Path, str]:
    """The generated files under ``dashboards/`` and their text."""
    return files_under(ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dashboard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed files are stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in files().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale (run python -m jobs.dashboard): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
