"""What :mod:`raycomp.train` runs inside each worker: the step loop, the plan hand-off, the
gradient strategies, checkpoints, resume and resize."""
