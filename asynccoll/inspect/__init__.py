"""Inspection: render schedules, read traces, export timelines, explain hangs.

- :mod:`~asynccoll.inspect.kinds`: the collectives by kind name, built for any P and rank;
- :mod:`~asynccoll.inspect.graph`: the drawing model every renderer shares;
- :mod:`~asynccoll.inspect.render`: text (rich), DOT, JSON and PNG; :mod:`.html` the HTML pages;
- :mod:`~asynccoll.inspect.tracefile`: reading the trace files a run wrote;
- :mod:`~asynccoll.inspect.summary`: per-collective and per-execution summaries of traces;
- :mod:`~asynccoll.inspect.perfetto`: Chrome trace-event JSON and the HTML timeline;
- :mod:`~asynccoll.inspect.pending`: explain hangs from snapshots or live executors;
- :mod:`~asynccoll.inspect.stragglers`: lateness per rank (the straggler report);
- :mod:`~asynccoll.inspect.visible`: which traced collectives a person sees (not the
  runtime's own, unless asked).

Writing traces, the live-op registry (with its ``SIGUSR1`` dump), what a rank waits for
(:mod:`asynccoll.sched.waits`) and the flight recorder (:mod:`asynccoll.sched.flight`) belong
to the engine: :class:`asynccoll.sched.TraceWriter`, :class:`asynccoll.sched.LiveOps`.

The ``asynccoll inspect`` command is :mod:`asynccoll.inspect.cli`. Submodules are imported
lazily, so importing this package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..transport.lazy import exports

if TYPE_CHECKING:
    from .pending import explain, explain_executors
    from .render import render
    from .tracefile import load_dir

__all__ = ["explain", "explain_executors", "load_dir", "render"]

_WHERE = {"load_dir": ".tracefile", "render": ".render", "explain": ".pending",
          "explain_executors": ".pending"}
__getattr__, __dir__ = exports(__name__, _WHERE, globals())
