"""exspec: batched speculative decoding done right."""

from pathlib import Path as _Path

__version__ = "0.2.0"

# Run from a source checkout (this folder beside engine/, scheduler/, ... and pyproject.toml), exspec imports with
# no installation: its subpackages are the checkout's top-level folders, as pyproject's package-dir maps them
# (exspec.engine is engine/). An installed exspec, whose parent is site-packages, is left as it is.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "engine" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821 (a package's __path__)
del _Path, _root
