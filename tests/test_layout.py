"""The package layout of DESIGN §1: imports point one way, no module at the root that belongs in a
subpackage, no two modules importing each other.

The layering, bottom to top: ``buffers`` (with ``errors`` and ``results``, which import nothing
of the package's) ← ``transport`` ← ``sched`` ← ``collectives`` ← ``comm`` ← ``train`` /
``torch``, with ``sim``, ``launch``, ``inspect``, ``testing`` and ``cli`` on top. A part may
import its own part and any part below it. Imports are read with ``ast`` (nothing is run), and
imports under ``TYPE_CHECKING`` count too: a type-only import against the layering is still a
dependency a reader has to follow.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator

import pytest

import asynccoll

PKG = pathlib.Path(asynccoll.__file__).parent

#: the parts by level; a part may import parts of its own level or lower, never higher
LEVELS: dict[str, int] = {
    "errors": 0, "results": 0, "buffers": 1,
    "transport": 2, "sched": 3, "collectives": 4, "comm": 5, "train": 6, "torch": 6,
    "sim": 7, "launch": 7, "inspect": 7, "testing": 8, "cli": 9, "demo": 9, "__init__": 10,
}
#: pairs of parts of one level that must not import each other (DESIGN: "comm never imports
#: launch or inspect"; those live above comm, so the levels already say it; these are the
#: side-by-side parts)
FORBIDDEN_SIDEWAYS = {("train", "torch"), ("launch", "inspect"), ("inspect", "launch"),
                      ("sim", "launch")}
ROOT_MODULES = {"__init__", "buffers", "errors", "results", "cli", "demo"}


def _modname(path: pathlib.Path) -> str:
    parts = ("asynccoll", *path.relative_to(PKG).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(mod: str) -> str:
    bits = mod.split(".")
    return bits[1] if len(bits) > 1 else "__init__"


def _imports(path: pathlib.Path) -> Iterator[tuple[str, int]]:
    mod = _modname(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("asynccoll"):
                    yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "asynccoll" or target.startswith("asynccoll."):
                yield target, node.lineno
                for a in node.names:  # ``from . import testing`` names a module
                    yield f"{target}.{a.name}", node.lineno


def _modules() -> dict[str, pathlib.Path]:
    return {_modname(f): f for f in sorted(PKG.rglob("*.py"))}


def layering_violations() -> list[str]:
    """Every import against the layering, as ``file:line: part imports part``."""
    bad = []
    for mod, f in _modules().items():
        src = _part(mod)
        for target, line in _imports(f):
            dst = _part(target)
            if dst == src or dst not in LEVELS or target == "asynccoll":
                continue
            if src == "__init__":
                continue  # the root re-exports the public API from every part
            if LEVELS[dst] > LEVELS[src] or (src, dst) in FORBIDDEN_SIDEWAYS:
                bad.append(f"{f.relative_to(PKG.parent)}:{line}: {src} imports {dst} "
                           f"({target})")
    return sorted(set(bad))


def import_circles() -> list[str]:
    """Pairs of modules that import each other (a package re-exporting its modules aside)."""
    mods = _modules()
    edges: dict[str, set[str]] = {}
    for mod, f in mods.items():
        for target, _ in _imports(f):
            t = target
            while t and t not in mods:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != mod:
                edges.setdefault(mod, set()).add(t)
    out = []
    for a, outs in edges.items():
        for b in outs:
            if a < b and a in edges.get(b, set()) and mods[a].name != "__init__.py" \
                    and mods[b].name != "__init__.py":
                out.append(f"{mods[a].relative_to(PKG.parent)} <-> "
                           f"{mods[b].relative_to(PKG.parent)}")
    return sorted(out)


def test_every_part_has_a_level() -> None:
    parts = {_part(m) for m in _modules()} - {"__init__"}
    assert parts <= set(LEVELS), f"parts without a level in this test: {parts - set(LEVELS)}"


def test_imports_follow_the_layering() -> None:
    bad = layering_violations()
    assert not bad, "imports against DESIGN §1's layering:\n" + "\n".join(bad)


def test_no_two_modules_import_each_other() -> None:
    circles = import_circles()
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_nothing_at_the_root_that_belongs_in_a_subpackage() -> None:
    stray = sorted(f.name for f in PKG.glob("*.py") if f.stem not in ROOT_MODULES)
    assert not stray, f"modules at the package root: {stray}"


#: the longest a module of ``comm/`` may be (the membership issue's bound: a module past it
#: holds two things and is split, as ``joining`` was into ``state_digest``)
COMM_MAX_LINES = 600


def test_no_comm_module_over_its_bound() -> None:
    long = {f.name: n for f in sorted((PKG / "comm").glob("*.py"))
            if (n := len(f.read_text().splitlines())) > COMM_MAX_LINES}
    assert not long, f"comm modules over {COMM_MAX_LINES} lines: {long}"


def test_the_checker_finds_a_violation(tmp_path: pathlib.Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: a sched module importing comm is reported with its file and line."""
    fake = tmp_path / "asynccoll"
    (fake / "sched").mkdir(parents=True)
    (fake / "comm").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "sched" / "__init__.py").write_text("")
    (fake / "comm" / "__init__.py").write_text("")
    (fake / "sched" / "bad.py").write_text("import os\n\nfrom ..comm import x\n")
    (fake / "comm" / "a.py").write_text("from . import b\n")
    (fake / "comm" / "b.py").write_text("from .a import y\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert layering_violations() == [
        "asynccoll/sched/bad.py:3: sched imports comm (asynccoll.comm)",
        "asynccoll/sched/bad.py:3: sched imports comm (asynccoll.comm.x)"]
    assert import_circles() == ["asynccoll/comm/a.py <-> asynccoll/comm/b.py"]
