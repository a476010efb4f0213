"""The typed options of :func:`raycomp.train.prepare_model`, each with its default.

Defined in ``raycomp._internal.train.options`` (the loop reads them without importing this
public package); this module is where users import them from.
"""

from raycomp._internal.train.options import TrainOptions, resolve_options

__all__ = ["TrainOptions", "resolve_options"]
