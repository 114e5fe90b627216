"""Lazy package exports (PEP 562): a package's public names are imported on first use.

Every process the launcher starts (the ranks, the launcher itself, its reaper) imports
``asynccoll``; importing every subpackage eagerly cost 0.7 to 0.8 CPU-seconds per process, most
of it in modules that process never uses (the reaper waits on a pipe and unlinks segments; a
rank of a NumPy job needs neither the training classes nor the test worlds). A package lists
where each public name lives and calls :func:`exports`; type checkers see the names through the
package's ``if TYPE_CHECKING:`` imports. It lives here, in the lowest part of the package,
because every part's ``__init__`` above it uses it and nothing stands at the package's root
beside the basics (DESIGN §1).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


class _Package(types.ModuleType):
    """A package whose public function shares its name with the submodule that defines it
    (``asynccoll.launch.connect``, the function, in ``asynccoll/launch/connect.py``). The import
    system binds a submodule on its package when it is first imported; eagerly, the package's
    own ``from .connect import connect`` then put the function back. Lazily, nothing does, so
    that binding is skipped for such names and the name resolves to the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in self.__dict__.get("_SHADOWED", ()):
            return
        super().__setattr__(name, value)


def exports(package: str, where: Mapping[str, str], namespace: dict[str, Any],
            modules: tuple[str, ...] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``where`` maps each public name to the submodule (relative to ``package``) that defines
    it; ``modules`` names submodules exported as themselves (``asynccoll.testing``). A value is
    cached in ``namespace`` (the package's globals) on first use."""
    shadowed = {n for n, m in where.items() if m == "." + n}
    if shadowed:
        namespace["_SHADOWED"] = frozenset(shadowed)
        sys.modules[package].__class__ = _Package

    def __getattr__(name: str) -> Any:
        mod = where.get(name)
        if mod is None:
            # a submodule, as when the package imported every part eagerly
            # (``import asynccoll; asynccoll.train.EagerSGD``)
            if name in modules or (not name.startswith("__")
                                   and importlib.util.find_spec(f"{package}.{name}")):
                return importlib.import_module("." + name, package)
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where) | set(modules))

    return __getattr__, __dir__
