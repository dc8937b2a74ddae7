"""Package exports imported on first use (PEP 562), so that a package's torch-free modules (its configs, the
constants the command line reads) import without the package's torch-heavy ones. Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The package's module-level `__getattr__`: `exports` maps each public name to the module defining it; a
    name is imported on first access and kept in the package's `namespace` (its `globals()`)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(exports[name]), name)
        namespace[name] = value
        return value

    return __getattr__
