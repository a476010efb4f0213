"""``python -m jobs.bench <benchmark> [options]``: see :mod:`jobs.bench.cli`."""

import sys

from jobs.bench.cli import main

sys.exit(main())
