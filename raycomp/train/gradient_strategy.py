"""How a model's gradients are reduced across ranks, as ``raycomp.train`` drives it: the
protocol a gradient strategy implements, with defaults for its optional members.

A custom strategy subclasses :class:`GradientStrategy` (``docs/usage.md``). Defined in
``raycomp._internal.train.gradient_strategy`` so that the loop and the built-in strategies
never import this public package; this module is where users import them from.
"""

from raycomp._internal.train.gradient_strategy import (
    GradientState,
    GradientStrategy,
    GradientStrategyFactory,
    StrategySetup,
)

__all__ = ["GradientState", "GradientStrategy", "GradientStrategyFactory", "StrategySetup"]
