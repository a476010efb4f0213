"""Two-level reduction (raycomp._internal.reduce.two_level): the node's exchange, the pieces across nodes, the
all-gather back, and what rides with them."""

from ..mutant import mutant

TESTS = "tests/test_two_level.py"

MUTANTS = (
    mutant(
        "two-level-piece-reduced-on-one-level-only", "TwoLevelReducer.start",
        "            if mean.data_ptr() != piece.data_ptr():\n                piece.copy_(mean)\n",
        "            pass\n",
        TESTS,
        "a compressed piece's cross-node mean is dropped: every node keeps its own node mean",
    ),
    mutant(
        "two-level-rank-syncs-another-ranks-piece", "TwoLevelReducer.start",
        "        mine = layout.mine(segment, intra.rank)\n",
        "        mine = layout.mine(segment, 0)\n",
        TESTS,
        "a rank reduces across nodes the pieces of position 0, not its own",
    ),
    mutant(
        "two-level-residual-shared-between-hops", "TwoLevelReducer.start",
        "        mine = layout.mine(segment, intra.rank)\n",
        "        mine = layout.mine(segment, intra.rank)\n"
        "        for i, piece in mine:\n"
        "            owed = self.memory.residual(names[i])\n"
        "            if owed is not None:\n"
        "                piece.add_(owed)\n",
        TESTS,
        "the cross-node residual joins the piece at the node's hop and again at the cross-node one: sent twice",
    ),
    mutant(
        "two-level-node-sum-not-mean", "_node_mean",
        "    return segments.sum(0).div_(segments.shape[0])\n",
        "    return segments.sum(0)\n",
        TESTS,
        "the node's pieces are summed, not averaged: the mean is L times too large",
    ),
    mutant(
        "two-level-control-summed-in-the-node-only", "TwoLevelReducer.start",
        "            control=control, dense_bytes=",
        "            control=None, dense_bytes=",
        TESTS,
        "control values (non-finite flags) never cross nodes: a node cannot see another's NaN",
    ),
)

MUTANTS = (
    *MUTANTS,
    mutant(
        "cost-model-prices-two-levels-as-flat", "CostModel.levels",
        "        if per_node == 1:\n            return w, 1\n",
        "        if True:\n            return w, 1\n",
        "tests/test_cost_model_ranks.py",
        "a two-level run's compressed plan is priced as W flat ranks: all-gathers look (W-1)/(K-1) times dearer",
    ),
)

MUTANTS = (
    *MUTANTS,
    mutant(
        "two-level-resize-drops-a-position", "owed_memory",
        "            for name, piece in state[\"memory\"].get(key, {}).items():\n",
        "            for name, piece in state[\"memory\"].get(key, {}).items() if state[\"levels\"][\"position\"] == 0 else ():\n",
        "tests/test_two_level_resize.py",
        "a rank's residual lost in a two-level resize: only position 0's pieces are merged",
    ),
    mutant(
        "two-level-resize-means-over-ranks", "owed_memory",
        "        nodes = states[0][\"levels\"][\"nodes\"]\n",
        "        nodes = len(states)\n",
        "tests/test_two_level_resize.py",
        "the pieces' sum is divided by the old ranks, not the nodes: a two-level resize owes L times too little",
    ),
)

LOCAL_TESTS = "tests/test_two_level_local.py"

MUTANTS = (
    *MUTANTS,
    mutant(
        "node-replica-inner-step-not-reduced", "LocalState._ddp_strategy",
        "            self.model.require_backward_grad_sync = per_step or self.node_replicas\n",
        "            self.model.require_backward_grad_sync = per_step\n",
        LOCAL_TESTS,
        "local steps between nodes switch DDP off: a node's ranks drift apart instead of training as one replica",
    ),
    mutant(
        "node-replica-inner-step-sums", "CompressionState.reduce_inside_node",
        "        buffer.div_(intra.size)\n",
        "",
        LOCAL_TESTS,
        "an inner step's gradient is the node's sum, not its mean",
    ),
    mutant(
        "node-replica-sync-on-every-rank", "LocalSteps.__init__",
        "            TwoLevelReducer(levels, plan, **options)",
        "            CompressedReducer(plan, **options)",
        LOCAL_TESTS,
        "a sync between node replicas goes flat: every rank sends the whole pseudo-gradient across nodes",
    ),
)

MUTANTS = (
    *MUTANTS,
    mutant(
        "two-level-decision-says-flat", "Chooser._why",
        "            levels=(run.nodes, run.per_node) if run.per_node > 1",
        "            levels=None if run.per_node > 1",
        "tests/test_adaptive_policy.py",
        "a two-level run's decision reads as a flat one: what each level does goes unsaid",
    ),
    mutant(
        "intra-node-bytes-not-reported", "StatsReporter.send",
        "            intra_bytes=state.intra_bytes, fallback_active",
        "            intra_bytes=0.0, fallback_active",
        "tests/test_train_report.py",
        "the bytes sent inside nodes never reach the controller: the dashboard shows one level",
    ),
    mutant(
        "post-local-sgd-ignores-the-node-group", "register_post_local_sgd",
        "    state = PostLocalSGDState(process_group=None, subgroup=node_group, start_localSGD_iter=start,\n"
        "                              post_local_gradient_allreduce=node_group is not None)",
        "    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=start,\n"
        "                              post_local_gradient_allreduce=False)",
        "tests/test_local_baselines.py",
        "torch's two-level post-local SGD runs flat: a node's ranks drift apart between averages",
    ),
    mutant(
        "node-hops-left-unpriced", "CostModel.predict",
        "        inside = self._inside(run, per_node)\n        return",
        "        inside = 0.0\n        return",
        "tests/test_cost_model_ranks.py",
        "a two-level compressed step's exchange and all-gather inside the node cost nothing",
    ),
    mutant(
        "node-hops-counted-twice", "CostModel.measure",
        "                    extra = t.step_seconds - s.compute - per_node * wire / s.bw - decode - inside\n",
        "                    extra = t.step_seconds - s.compute - per_node * wire / s.bw - decode\n",
        "tests/test_cost_model_ranks.py",
        "a measured two-level interval teaches the round overheads the node's hops as well",
    ),
    mutant(
        "node-link-timed-at-a-rings-whole-buffer", "node_seconds_per_byte",
        "    return seconds / intra.allreduce_bytes(buffer.numel() * element)\n",
        "    return seconds / (buffer.numel() * element)\n",
        "tests/test_node_link.py",
        "the node's seconds per byte divide by the buffer, not the 2(L-1)/L of it a rank sends",
    ),
    mutant(
        "inner-step-without-the-nodes-all-reduce", "LocalChoice._auto",
        "        inside = self.cost.node_allreduce(run) if s.inner_compute is None else 0.0\n",
        "        inside = 0.0\n",
        "tests/test_local_policy.py",
        "a node replica's inner step is priced without its all-reduce inside the node",
    ),
    mutant(
        "node-replica-sync-waited-in-its-step", "LocalSteps._start",
        "            pending = self.reducer.start(names, pseudo, closes_step=True, gather_on_wait=True)\n",
        "            pending = self.reducer.start(names, pseudo, closes_step=True)\n",
        "tests/test_two_level_local.py -k overlaps",
        "a node replica's sync waits for its cross-node hop in the step that starts it: no inner step hides it",
    ),
    mutant(
        "two-level-statistics-read-as-whole-layers", "CostModel._elements",
        "        share = piece_on_nodes(run) / allreduce if in_pieces else 1.0\n",
        "        share = 1.0\n",
        "tests/test_cost_model_ranks.py",
        "before a dense interval, a two-level step's piece statistics price dense at 1/L",
    ),
    mutant(
        "element-size-from-statistics-only", "CostModel._elements",
        "        return {name: self.state.element.get(name) or self.state.model_element\n",
        "        return {name: self.state.element.get(name)\n",
        "tests/test_cost_model_ranks.py",
        "a dense interval's own bytes never size the elements: a bf16 model is priced as fp32 until statistics",
    ),
)
