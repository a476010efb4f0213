"""Train with adaptive gradient compression as a Ray Train job: ``python -m jobs.train``.

The parts, in the order a run uses them: :mod:`~jobs.train.cli` (the command line, the checks
before Ray is touched), :mod:`~jobs.train.driver` (Ray, the controller service, the
``TorchTrainer``), :mod:`~jobs.train.worker` (the loop every worker runs, a user of
:mod:`raycomp.train`), :mod:`~jobs.train.summary` (``summary.json`` and ``plot.png``).
"""

from jobs.train.cli import EXIT_BAD_INPUT, main, parse_args, prepare
from jobs.train.driver import conclude, controller_for, loop_config, run, start_ray, trainer_for
from jobs.train.summary import build_summary, plot, write_outputs, write_summary
from jobs.train.worker import Precision, TargetStop, evaluated_once, quiet_worker_logs, train_loop

__all__ = ["EXIT_BAD_INPUT", "Precision", "TargetStop", "build_summary", "conclude", "controller_for",
           "evaluated_once", "loop_config", "main", "parse_args", "plot", "prepare", "quiet_worker_logs", "run",
           "start_ray", "train_loop", "trainer_for", "write_outputs", "write_summary"]
