"""The reference of a whole job config (``python -m jobs.train``), generated as raycomp's
(:mod:`raycomp.config.reference`) from the same kind of source: each field's ``#:`` comment.

::

    python -m jobs.config.job_reference               # a job config at every default, commented
    python -m jobs.config.job_reference --markdown    # docs/job-configuration.md

The Markdown covers the sections only a job has (run, workload, scaling, benchmark); the
worker-side ones are in docs/configuration.md (``raycomp config --markdown``). The YAML
holds every section, a complete job config to start from.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jobs.config.job_sections import BenchmarkSection, RunSection, ScalingSection, WorkloadSection
from raycomp.config import reference

__all__ = ["JOB_SECTIONS", "OWN_SECTIONS", "REGENERATE", "example_yaml", "main", "markdown"]

#: the command that writes docs/job-configuration.md
REGENERATE = "python -m jobs.config.job_reference --markdown > docs/job-configuration.md"

#: the sections only a job config has
OWN_SECTIONS = (("run", RunSection), ("workload", WorkloadSection), ("scaling", ScalingSection),
                ("benchmark", BenchmarkSection))
#: every section of a job config (``jobs.config.JobConfig``), in the order a config reads
JOB_SECTIONS = (*OWN_SECTIONS[:3], *reference.TOP_SECTIONS, OWN_SECTIONS[3])

_INTRO = """\
The sections a job config of `python -m jobs.train` has besides raycomp's own
`compression`, `controller` and `checkpoint`, which [configuration.md](configuration.md)
documents. A job config is YAML (`--config FILE`) plus `key=value` overrides, validated
before Ray is touched. `python -m jobs.config.job_reference > my.yaml` writes a whole job
config at its defaults, each field with its meaning."""

_HEADER = """\
# A job config of `python -m jobs.train` at every default, each field with its meaning in
# one line (docs/job-configuration.md and docs/configuration.md for the whole reference).
# Keep what you change: python -m jobs.train --config my.yaml [key=value ...]"""


def markdown() -> str:
    return reference.markdown(OWN_SECTIONS, with_train_options=False, intro=_INTRO, command=REGENERATE,
                              title="Job configuration reference (`python -m jobs.train`)")


def example_yaml() -> str:
    return reference.example_yaml(JOB_SECTIONS, header=_HEADER)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.config.job_reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="the reference of the job's own sections")
    args = parser.parse_args(argv)
    print(markdown() if args.markdown else example_yaml(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
