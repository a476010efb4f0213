"""``python -m jobs.tune``: see :mod:`jobs.tune`."""

import sys

from jobs.tune.cli import main

sys.exit(main())
