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
        "        for fragment in self.schedule.due(self.inner_steps - self.origin):\n",
        "        for fragment in self.schedule.due(self.inner_steps - self.origin + dist.get_rank(self.group)):\n",
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
    mutant(
        "local-ddp-keeps-reducing-gradients", "LocalState._ddp_sync",
        "            self.model.require_backward_grad_sync = on\n",
        "            self.model.require_backward_grad_sync = True\n",
        "tests/test_local_train.py -k inner_steps_send_nothing",
        "during local steps DDP still all-reduces every step's gradients: nothing is saved on the wire",
    ),
    mutant(
        "local-sync-not-judged-by-the-guard", "TrainLoop.after_optimizer_step",
        "            self._verdict(self.guard.judge_sync(self.global_step, rows))\n",
        "            pass\n",
        "tests/test_local_train.py -k guard_judges",
        "the losses that ride inside a sync are never judged: local steps never fall back",
    ),
    mutant(
        "local-leaves-without-merging-replicas", "LocalState.set_plan",
        "                self.steps.merge_all()  # the ranks leave with the same weights\n",
        "                pass\n",
        "tests/test_local_train.py -k leaving_local_steps",
        "leaving local steps keeps each rank's own weights: per-step training goes on from replicas that differ",
    ),
    mutant(
        "local-checkpoint-drops-the-replicas", "own_state",
        "        \"replica\": None if loop.sync.per_step else {\n",
        "        \"replica\": None if True else {\n",
        "tests/test_local_train.py -k killed",
        "a checkpoint during local steps keeps only rank 0's weights: a resumed rank 1 trains on rank 0's replica",
    ),
    mutant(
        "local-loss-never-steps-back", "LocalChoice._follow_loss",
        "        self.behind = self.behind + 1 if level > limit else 0\n",
        "        self.behind = 0\n",
        "tests/test_local_policy.py -k loss_that_falls_behind",
        "a loss that drifts up under local steps never halves H: auto keeps an H the run cannot afford",
    ),
    mutant(
        "local-min-gain-ignores-the-optimizer", "local_min_gain",
        "    return LOCAL_MIN_GAIN[\"linear\" if lossy_suits(optimizer) else \"other\"]\n",
        "    return LOCAL_MIN_GAIN[\"linear\"]\n",
        "tests/test_local_policy.py -k min_gain",
        "an AdamW run takes local steps for a 10% predicted gain, as SGD would",
    ),
    mutant(
        "local-outer-steps-not-counted", "TrainLoop.after_optimizer_step",
        "            self.outer_steps += not any(row[0] for row in rows)  # a non-finite mean skips the outer step\n",
        "            pass\n",
        "tests/test_local_train.py -k inner_steps_send_nothing",
        "raycomp_outer_steps_total stays at zero: the dashboard shows no sync of a run in local steps",
    ),
)
