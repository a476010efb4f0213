"""``python -m jobs.faults``: ``python -m jobs.train`` with the ``faults.*`` keys allowed
(the job config is :class:`jobs.faults.DrillConfig`)."""

from __future__ import annotations

import sys

from jobs.faults import DrillConfig
from jobs.train import main as train_main


def main(argv: list[str] | None = None) -> int:
    return train_main(argv, schema=DrillConfig)


if __name__ == "__main__":
    sys.exit(main())
