"""The controller's intake and exporter: what reports it accepts and what it exports."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "controller-accepts-nan-stats", "GradStats.from_dict",
        '        for key in _STATS_FLOATS:\n            _finite(f"stats.{key}", data.get(key))\n',
        '        for key in _STATS_FLOATS:\n            pass\n',
        "tests/test_controller.py",
        "GradStats.from_dict lets NaN/Inf/missing run-level statistics through",
    ),
    mutant(
        "controller-accepts-nan-layer-stats", "_layer_ok",
        "            if type(value) is bool or not isfinite(value):\n                return False\n",
        "            if type(value) is bool:\n                return False\n",
        "tests/test_controller.py",
        "per-layer statistics with NaN/Inf pass the controller's fast check",
    ),
    mutant(
        "skipped-steps-not-exported", "ControllerCollector._run",
        "        f[\"raycomp_skipped_steps_total\"].add_metric([rid], run.skipped_steps)\n",
        "        f[\"raycomp_skipped_steps_total\"].add_metric([rid], 0)\n",
        "tests/test_observability.py -k real_run",
        "the skipped-steps counter stays at 0 whatever the guard or the scaler skipped",
        timeout_s=300,
    ),
    mutant(
        "late-evaluation-ignored", "RunState.add",
        "                self._step_evals[stats.rank] = stats.eval_metric\n"
        "                self.eval_metric = _mean(list(self._step_evals.values()))\n",
        "                pass\n",
        "tests/test_controller.py -k sent_again",
        "an evaluation after a run's last boundary reaches the controller but is dropped as a late report",
    ),
    mutant(
        "repeated-interval-timed-twice", "RunState.add",
        "        if not repeat:  # the same interval again adds no timing sample\n",
        "        if True:\n",
        "tests/test_controller.py -k sent_again",
        "a rank's interval sent again with its evaluation adds a second sample to the step-time histograms",
    ),
    mutant(
        "repeat-first-loses-evaluation", "RunState.add",
        "        if stats.rank in pending and stats.eval_metric is None:",
        "        if False:",
        "tests/test_controller.py -k sent_again",
        "a boundary report taken after its own repeat overwrites the evaluation the repeat carried",
    ),
    mutant(
        "plan-switch-rule-uncounted", "RunState.install",
        "            self.switches_by_rule[rule] = self.switches_by_rule.get(rule, 0) + 1\n",
        "            pass\n",
        "tests/test_policy_state.py -k facts",
        "plan switches are not counted by the rule that decided them: the metric shows none",
    ),
    mutant(
        "policy-restore-skips-the-wrapped", "Policy.load_state_dict",
        "        if self.inner is not None:\n            self.inner.load_state_dict(saved[\"inner\"])\n",
        "",
        "tests/test_policy_state.py -k round_trips",
        "a controller restart restores the fallback gate but not the policy it wraps: the policy starts afresh",
    ),
    mutant(
        "adaptive-restore-keeps-the-old-cost-model", "AdaptivePolicy.restored",
        "        self.cost.state, self.choice.state = self.state.cost, self.state.choice\n",
        "        pass\n",
        "tests/test_policy_state.py -k round_trips",
        "after a restart the policy's state is loaded but its cost model and chooser still work on fresh ones",
    ),
)
