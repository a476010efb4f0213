"""The mutation check: does the test suite notice when the code is broken on purpose?

    python -m tests.mutants              # every mutant (scripts/mutants.sh is the same)
    python -m tests.mutants --list       # each mutant's anchors, where they are found, its tests
    python -m tests.mutants --only NAME  # one mutant (repeatable)
    python -m tests.mutants --baseline   # also run each selection unmutated first

``anchor`` places an edit (a snippet inside a named definition, found by parsing, matched
token by token); ``mutant`` is the entry type; ``catalog`` holds the entries by area;
``runner`` copies the repository, applies a mutant and runs its tests.
"""
