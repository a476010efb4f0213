"""Sharded data parallel (FSDP2): the control row, plan installation, residuals, and the two
levels of a model sharded per node (raycomp._internal.fsdp.two_level)."""

from ..mutant import mutant

LEVELS = "tests/test_sharded_levels.py"

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
        "        if self._calls != len(self.comms) or self._control is None or self.cross is not None:\n",
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
    mutant(
        "sharded-levels-shard-reduced-on-one-level-only", "CrossNodeShards.hook",
        "            mean = self.reducer.start([unit], [shard], overwrite=True).wait()[0]\n",
        "            mean = shard\n",
        LEVELS,
        "a shard never crosses nodes: every node steps on its own node's mean",
    ),
    mutant(
        "sharded-levels-rows-ride-one-node", "ShardedState.control_bytes",
        "        if self._calls != len(self.comms) or self._control is None or self.cross is not None:\n",
        "        if self._calls != len(self.comms) or self._control is None:\n",
        LEVELS,
        "the guard's rows ride the node's all-to-all: no rank sees the other node's rows",
    ),
    mutant(
        "sharded-levels-node-bytes-in-the-ledger", "ShardedState.reduced",
        "            self.intra_bytes += wire\n            return\n",
        "            self.intra_bytes += wire\n",
        LEVELS,
        "the bytes that stayed inside the node are counted as crossing nodes too",
    ),
    mutant(
        "sharded-levels-resume-at-any-place", "CrossNodeShards.load_state_dict",
        "        self.levels.check_place(state.get(\"levels\"))\n",
        "        pass\n",
        LEVELS,
        "a rank resumes another position's shard residuals as its own",
    ),
)
