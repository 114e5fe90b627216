"""Which traced collectives a person sees: the application's own, not the runtime's.

A Communicator runs small collectives of its own beside the application's: the host discovery
(``hosts``), the check that every rank defined a collective alike at its first use
(``agree``), the shared-memory setup's flag and probe (``shm_ok``, ``cma_probe``). They are
traced like any other, under those names, and would crowd every view of a short run.
:func:`user_traces` drops them (the trace views' default); ``asynccoll inspect trace --all``
keeps them. A ``barrier`` stays: the application may have called it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from .tracefile import RankTrace

__all__ = ["INTERNAL", "internal_ids", "user_traces"]

#: the collective names the runtime traces for itself
INTERNAL = ("hosts", "agree", "shm_ok", "cma_probe")


def internal_ids(traces: Mapping[int, RankTrace]) -> set[int]:
    """The schedule ids whose recorded collective name is one of :data:`INTERNAL`."""
    return {sid for rt in traces.values() for sid, rec in rt.schedules.items()
            if str(rec.get("collective") or rec.get("name") or "") in INTERNAL}


def user_traces(traces: Mapping[int, RankTrace], show_all: bool = False
                ) -> dict[int, RankTrace]:
    """``traces`` without the runtime's own collectives (all of them when ``show_all``); the
    records themselves are shared, not copied. Costs O(schedules) per rank."""
    hidden = set() if show_all else internal_ids(traces)
    if not hidden:
        return dict(traces)
    return {r: replace(rt,
                       schedules={s: v for s, v in rt.schedules.items() if s not in hidden},
                       executions={s: v for s, v in rt.executions.items() if s not in hidden},
                       pending={s: v for s, v in rt.pending.items() if s not in hidden})
            for r, rt in traces.items()}
