"""Search compression schedules with Ray Tune: every trial is a full Ray Train job.

    python -m jobs.tune --config jobs/configs/tune_digits.yaml [--output DIR] [--name NAME] [key=value ...]

The tune config names a base job config (like ``jobs.train --config``), a search space over
its keys, the objective and the ASHA settings; it is validated before Ray is touched (a bad
one exits with code 2 and one line naming the key). Each trial is a ``jobs.train.run``
(a ``TorchTrainer`` around ``jobs.train.train_loop``) under its own run id in the controller
service (so every trial shows up on the dashboard), reporting to Tune once per epoch; ASHA
stops trials whose objective lags. Two baselines run as extra trials unless switched off: ``dense``
(plain all-reduce) and ``default`` (the base config unchanged).

Writes into ``<output_dir>/<name>/``: ``results.csv``, ``results.md``, ``best_config.yaml``
(a full job config for ``jobs.train`` / ``ray job submit``), ``pareto.png`` and ``runs/<run id>/``
(each trial's summary, step logs, checkpoints). Run the same command again to resume an
interrupted search (``Tuner.restore``); finished trials are not run again.

The parts, in the order a search uses them: :mod:`~jobs.tune.spec` (the tune config),
:mod:`~jobs.tune.space` (the search space), :mod:`~jobs.tune.objective` (a trial's score),
:mod:`~jobs.tune.trials` (one trial), :mod:`~jobs.tune.search` (the Tuner),
:mod:`~jobs.tune.results` (tables, best config, Pareto plot), :mod:`~jobs.tune.cli`.
"""

from jobs.tune.cli import main, prepare, run
from jobs.tune.objective import METRIC, Objective
from jobs.tune.results import pareto_front
from jobs.tune.space import flatten_search, trial_config
from jobs.tune.spec import ObjectiveSection, TuneSetup, TuneSpec, load_tune_config
from jobs.tune.trials import RunRegistry

__all__ = ["METRIC", "Objective", "ObjectiveSection", "RunRegistry", "TuneSetup", "TuneSpec", "flatten_search",
           "load_tune_config", "main", "pareto_front", "prepare", "run", "trial_config"]
