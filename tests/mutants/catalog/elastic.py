"""Elastic resizes: a checkpoint of W workers restored on W' (raycomp._internal.train.resize) and the
controller's view of the new size."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "resize-loses-a-ranks-residual", "_mean_memory",
        "            present = [m[key][name] for m in memories if name in m.get(key, {})]\n",
        "            present = [m[key][name] for m in memories[:-1] if name in m.get(key, {})]\n",
        "tests/test_resize.py",
        "a rank's residual lost in a resize: the merge leaves out the last old rank's error feedback",
    ),
    mutant(
        "resize-keeps-the-old-link-figures", "CostModel.forget",
        "        self.state.bw, self.state.compute = self.assumed_bw, None\n"
        "        self.state.overhead.clear()\n",
        "        pass\n",
        "tests/test_resize.py -k controller",
        "after a resize the cost model keeps pricing plans with the link and compute measured at the old size",
    ),
)
