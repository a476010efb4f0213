"""Local steps: the outer step, the averaged pseudo-gradient, the schedule, resume."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "local-outer-step-skipped", "LocalSteps._finish",
        "        self.outer.step()\n",
        "        pass\n",
        "tests/test_local_steps.py -k outer_step",
        "the outer optimizer never steps: every sync resets the ranks to the first global weights",
    ),
    mutant(
        "local-pseudo-gradient-not-averaged", "LocalSteps._finish",
        "            self.global_params[i].grad = mean.to(self.global_params[i].dtype)\n",
        "            self.global_params[i].grad = self.global_params[i].detach() - self.params[i].detach().float()\n",
        "tests/test_local_steps.py -k outer_step",
        "each rank steps the global weights with its own pseudo-gradient, not the ranks' mean",
    ),
    mutant(
        "local-fragment-schedule-differs-on-one-rank", "LocalSteps.step",
        "        for fragment in self.schedule.due(self.inner_steps):\n",
        "        for fragment in self.schedule.due(self.inner_steps + dist.get_rank(self.group)):\n",
        "tests/test_local_steps.py -k fragments_sync",
        "rank 1 starts each fragment's sync one step early: the ranks' collectives no longer pair up",
    ),
    mutant(
        "local-resume-drops-outer-momentum", "LocalSteps.load_state_dict",
        "        self.outer.load_state_dict(state[\"outer\"])\n",
        "        pass\n",
        "tests/test_local_steps.py -k resume",
        "a resumed run restarts the outer optimizer's Nesterov momentum from zero",
    ),
)
