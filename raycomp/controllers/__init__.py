"""``raycomp.controllers`` in a source checkout.

The controller's code lives in the repository's top-level ``controllers/`` folder. A built
wheel maps that folder here (``[tool.setuptools.package-dir]`` in pyproject.toml), so an
installed raycomp adds no top-level package but ``raycomp``; in a checkout this file points
the package's search path at the folder and runs its ``__init__``, so both import the same
code under the same name. Import the controller as ``raycomp.controllers``, never as
``controllers`` (ruff's banned-api rule refuses the bare name).
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "controllers")]
_init = Path(__path__[0]) / "__init__.py"
exec(compile(_init.read_text(), str(_init), "exec"))
del _init, Path
