"""What a run tells of itself: why it stays dense, the reasons' words, ``raycomp inspect`` /
``plot`` and the command line (tests/test_run_story.py)."""

from ..mutant import mutant

STORY = "tests/test_run_story.py"

MUTANTS = (
    mutant(
        "reason-calls-a-link-fast-or-slow", "AdaptiveWhy.text",
        '        name = "link" if self.levels is None else "node link"\n',
        '        name = ("slow " if ratio >= 1 else "fast ") + ("link" if self.levels is None else "node link")\n',
        f"{STORY} -k reason_gives_the_link",
        "a reason calls a 1.11 MB/s link fast and a 12.5 MB/s one slow, against its own MB/s figure",
    ),
    mutant(
        "dense-run-says-nothing", "worker_summary",
        "    why = dense_why(summary)\n",
        "    why = None\n",
        f"{STORY} -k held_dense",
        "a run held dense all run (one worker, Adam on a link that cannot pay) finishes without saying why",
        timeout_s=400,
    ),
    mutant(
        "inspect-hides-why-dense", "raycomp/_internal/observe/run_report.py:inspect",
        "    if held:\n",
        "    if False:\n",
        f"{STORY} -k held_dense",
        "raycomp inspect of a run held dense does not say why",
        timeout_s=400,
    ),
    mutant(
        "dense-why-forgets-one-worker", "dense_why",
        "    if world == 1:\n",
        "    if False:\n",
        f"{STORY} -k dense_why_names",
        "a one-worker run's reason for staying dense is not that there is nothing to reduce",
    ),
    mutant(
        "plot-bytes-on-a-log-axis", "figure",
        "    bytes_ax.set_ylim(0, max([*wire, *dense, 1.0]) * 1.4)\n",
        '    bytes_ax.set_yscale("log")\n',
        f"{STORY} -k plot_draws",
        "the bytes panel on a log axis over a narrow range: 80 bytes look like the wire far above dense",
    ),
    mutant(
        "plot-band-labels-overlap", "figure",
        "        if (stop - start) / span >= 0.04:\n"
        "            plan_ax.text(start, 0.3 + 0.4 * (index % 2), f\" v{run.timeline[index].get('version')}\","
        " va=\"center\",\n"
        "                         fontsize=7, clip_on=True)\n",
        "        plan_ax.text(start, 0.5, f\" v{run.timeline[index].get('version')} {to}\", va=\"center\", fontsize=7,\n"
        "                     clip_on=True)\n",
        f"{STORY} -k plot_draws",
        "every plan band carries its whole description on one line: narrow bands' labels overlap",
    ),
    mutant(
        "plot-names-bare-matplotlib", "raycomp/_internal/observe/run_plot.py:main",
        'print(f"raycomp plot: needs {missing}, not installed: {PLOT_INSTALL}", file=sys.stderr)',
        'print(f"raycomp plot: needs {missing}, not installed: pip install {missing}", file=sys.stderr)',
        f"{STORY} -k plot_without",
        "raycomp plot without matplotlib does not name the raycomp[plot] extra",
    ),
    mutant(
        "closed-pipe-traceback", "raycomp/cli.py:main",
        "    except BrokenPipeError:\n",
        "    except ZeroDivisionError:\n",
        f"{STORY} -k closed_pipe",
        "raycomp inspect RUN | head ends in a BrokenPipeError traceback",
    ),
    mutant(
        "timeline-header-counts-switches-only", "_timeline_counts",
        '    return f"{rows}: {\', \'.join(parts)}" if parts else rows\n',
        '    return f"{kinds.count(\'plan\')} switches"\n',
        f"{STORY} -k counts_what",
        "the plan timeline's header counts 2 switches above 7 rows",
    ),
    mutant(
        "bytes-rows-merge-a-plan-s-stretches", "_stretches",
        "                stretch, previous = stretch + 1, plan\n",
        "                previous = plan\n",
        f"{STORY} -k counts_what",
        "the bytes table sums a plan left and taken again into one row, whose step range overlaps the others'",
    ),
    mutant(
        "no-summary-called-running", "_status",
        '    return f"no summary.json: still running, or ended without raycomp.train.finish(){ago}"\n',
        '    return "running (no summary.json yet)"\n',
        f"{STORY} -k without_summary",
        "a run that ended without raycomp.train.finish() shows as running forever",
    ),
)
