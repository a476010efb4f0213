"""Sharded data parallel (FSDP2): the control row, plan installation, residuals."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "sharded-control-row-via-host", "control_row",
        "    norm_sq = norm_sq.float().reshape(1)\n",
        "    norm_sq = norm_sq.float().reshape(1).cpu()\n",
        "tests/test_device.py -k control_row",
        "FSDP's control row reads the gradient norm on the host: a sync every step on CUDA",
    ),
    mutant(
        "sharded-control-never-rides", "ShardedState.control_bytes",
        "        if self._calls != len(self.comms) or self._control is None:\n",
        "        if True:\n",
        "tests/test_sharded.py",
        "the guard's control floats never ride in the last unit's all-to-all: an extra collective per step",
    ),
    mutant(
        "sharded-plan-not-installed", "ShardedState._install",
        "            if spec != comm.spec:\n                comm.set_spec(spec)\n",
        "            pass\n",
        "tests/test_sharded.py",
        "a new plan never reaches the units' comms: FSDP stays on its first plan",
    ),
    mutant(
        "sharded-norm-of-one-rank", "ShardedState.gradient_norm",
        "        return math.sqrt(math.fsum(n * n for n in self.rank_norms) / len(self.rank_norms))\n",
        "        return self.rank_norms[0]\n",
        "tests/test_sharded.py",
        "the guard watches rank 0's gradient norm only",
    ),
    mutant(
        "sharded-resume-drops-residuals", "CompressedReduceScatter.load_state_dict",
        "        self.residual = None if residual is None else residual.clone()\n",
        "        self.residual = None\n",
        "tests/test_fsdp_job.py -k bit_for_bit",
        "a resumed sharded run loses every unit's error-feedback residual",
    ),
)
