"""Registries for exspec's extension points: a class per file, registered by name.

Attention backends (`exspec.engine.backends`) and speculation policies (`exspec.scheduler.policies`) are each a
folder holding the interface (its `__init__.py`) and one file per implementation, named as it registers:

    @BACKENDS.register("mine")          # in engine/backends/mine.py
    class MyBackend(AttentionBackend): ...

Adding one is that file plus its import at the bottom of the folder's `__init__.py`; every list of names
(flag choices, config validation, errors) comes from the registry. `listed()` reads the same names from the
file names without importing the folder, so that `exspec --help` needs no torch; `register` refuses a class
whose file is named otherwise, which keeps the two the same. Torch-free, like `exspec.errors`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Name -> class for one extension point (`kind`, e.g. "attention backend"), in registration order."""

    def __init__(self, kind: str, package: str) -> None:
        self.kind = kind
        self.package = package  # the folder's package: each class must live in `package.<name>`
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: registers the class under `name` and sets its `name` attribute. The class must live in
        the folder's file of that name (`listed()` reads the names from the files), or in a test module."""

        def wrap(cls: T) -> T:
            if cls.__module__ != f"{self.package}.{name}" and not cls.__module__.startswith(("tests.", "__main__")):
                folder = self.package.partition(".")[2].replace(".", "/")  # exspec.engine.backends: engine/backends
                raise TypeError(f"{self.kind} {name!r} must live in {folder}/{name}.py, not {cls.__module__}")
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            cls.name = name
            self._classes[name] = cls
            return cls

        return wrap

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def items(self) -> tuple[tuple[str, T], ...]:
        return tuple(self._classes.items())

    def get(self, name: str) -> T:
        """The class registered as `name`; ValueError naming the choices otherwise."""
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"{self.kind} must be one of {', '.join(self._classes)}, got {name!r}")
        return cls

    def unregister(self, name: str) -> None:
        """For tests that register a throwaway class."""
        self._classes.pop(name, None)


def listed(package: str) -> tuple[str, ...]:
    """The names a registry folder (`exspec.<layer>.<folder>`) holds, sorted, read from its file names without
    importing it or its layer (so without torch)."""
    parent, _, folder = package.rpartition(".")
    spec = importlib.util.find_spec(parent)  # imports only the packages above `parent`
    path = Path(next(iter(spec.submodule_search_locations))) / folder
    return tuple(sorted(p.stem for p in path.glob("*.py") if p.stem != "__init__"))
