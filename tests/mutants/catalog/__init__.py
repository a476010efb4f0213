"""Every mutant, by area. An entry: name, anchor (the function, method, class or assignment
that holds the code, by qualified name), the snippet inside it, its replacement, the test
selection, and the bug in one line. See tests/mutants/anchor.py for how a snippet is found."""

from . import (
    benchmarks,
    compressors,
    controller,
    elastic,
    error_feedback,
    hook,
    integrations,
    levels,
    local_steps,
    loss_scale,
    policies,
    reducer,
    run_story,
    sharded,
    training,
    transports,
)

__all__ = ["MUTANTS"]

MUTANTS = (
    *error_feedback.MUTANTS,
    *transports.MUTANTS,
    *compressors.MUTANTS,
    *reducer.MUTANTS,
    *hook.MUTANTS,
    *training.MUTANTS,
    *integrations.MUTANTS,
    *loss_scale.MUTANTS,
    *policies.MUTANTS,
    *controller.MUTANTS,
    *sharded.MUTANTS,
    *local_steps.MUTANTS,
    *benchmarks.MUTANTS,
    *elastic.MUTANTS,
    *levels.MUTANTS,
    *run_story.MUTANTS,
)
