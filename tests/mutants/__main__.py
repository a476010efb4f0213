"""``python -m tests.mutants``: the mutation check (see tests/mutants/runner.py)."""

import sys

from .runner import main

sys.exit(main())
