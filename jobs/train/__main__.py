"""``python -m jobs.train``: see :mod:`jobs.train.cli`."""

import sys

from jobs.train.cli import main

sys.exit(main())
