"""What a run shows: the Prometheus metric catalogue, the generated dashboard, and
``raycomp inspect`` / ``raycomp plot`` over a run's files."""
