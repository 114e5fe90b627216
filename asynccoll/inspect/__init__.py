"""Inspection: render schedules, record and read traces, export timelines, explain hangs.

- :mod:`~asynccoll.inspect.kinds`: the collectives by kind name, built for any P and rank;
- :mod:`~asynccoll.inspect.render`: text (rich), DOT, JSON and PNG; :mod:`.html` the HTML pages;
- :mod:`~asynccoll.inspect.tracefile`: the on-disk trace format and :class:`TraceWriter`;
- :mod:`~asynccoll.inspect.summary`: per-collective and per-execution summaries of traces;
- :mod:`~asynccoll.inspect.perfetto`: Chrome trace-event JSON and the HTML timeline;
- :mod:`~asynccoll.inspect.pending`: explain hangs; the registry of live executors.

The ``asynccoll inspect`` command is :mod:`asynccoll.inspect.cli`. Submodules are imported
lazily, so importing this package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pending import dump_pending, explain, register_executor, unregister_executor
    from .render import render
    from .tracefile import TraceWriter, load_dir

__all__ = ["TraceWriter", "dump_pending", "explain", "load_dir", "register_executor", "render",
           "unregister_executor"]

_WHERE = {"TraceWriter": "tracefile", "load_dir": "tracefile", "render": "render",
          "dump_pending": "pending", "explain": "pending", "register_executor": "pending",
          "unregister_executor": "pending"}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'asynccoll.inspect' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
