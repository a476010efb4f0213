"""Error feedback: the residual memory and DGC's momentum."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "ef-update-removed", "ResidualMemory.update",
        "        self.residuals[name] = compensated.float() - sent.float()\n",
        "        self.residuals.pop(name, None)\n",
        "tests/test_memory.py",
        "ResidualMemory.update never stores the residual: error feedback does nothing",
    ),
    mutant(
        "dgc-momentum-masking-removed", "DGCMemory.update",
        "            self.velocity[name].masked_fill_(sent != 0, 0.0)\n",
        "            pass\n",
        "tests/test_memory.py",
        "DGC momentum-factor masking: the velocity of sent coordinates is not reset",
    ),
    mutant(
        "dgc-momentum-correction-removed", "DGCMemory.compensate",
        "        u = g.clone() if u is None else u.to(g.device).mul_(self.momentum).add_(g)\n",
        "        u = g.clone()\n",
        "tests/test_memory.py",
        "DGC accumulates the raw gradient instead of the momentum-corrected velocity",
    ),
)
