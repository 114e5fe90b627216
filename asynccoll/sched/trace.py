"""Per-op timing of each execution, kept in preallocated arrays.

For the last ``capacity`` executions of a schedule (a ring), each op's *posted* (handed to the
transport or kernel), *fired* (dependencies met) and *completed* times and the bytes it moved;
per execution, when it was armed, started from inside (``nan`` when activated only from
outside) and completed. The running execution lives in its executor's preallocated lists
(a few list stores per op, cheap enough to leave on; :meth:`Trace.record` reads them live) and
is copied into the ring's arrays in one vectorised store per column when it ends. A ``sink``
callback receives each finished execution's record (to write traces to disk).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["Trace"]

POSTED, FIRED, COMPLETED = 0, 1, 2


class Trace:
    """The ring of execution records of one executor."""

    def __init__(self, n_ops: int, capacity: int = 64,
                 sink: Callable[[dict[str, Any]], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.n_ops = n_ops
        self.capacity = capacity
        self.sink = sink
        self.times = np.full((capacity, n_ops, 3), np.nan)
        self.nbytes = np.zeros((capacity, n_ops), dtype=np.int64)
        #: per row: execution, armed, started, completed
        self.meta = np.full((capacity, 4), np.nan)
        self.extra: list[dict[str, Any]] = [{} for _ in range(capacity)]
        self._live: tuple[int, Sequence[float], Sequence[float], Sequence[float],
                          Sequence[int]] | None = None

    def begin(self, execution: int, now: float) -> np.ndarray:
        """Reset the row of ``execution``; return its ``(n_ops, 3)`` time array."""
        row = execution % self.capacity
        t: np.ndarray = self.times[row]
        t.fill(np.nan)
        self.nbytes[row].fill(0)
        self.meta[row] = (execution, now, np.nan, np.nan)
        self.extra[row] = {}
        return t

    def attach(self, execution: int, posted: Sequence[float], fired: Sequence[float],
               completed: Sequence[float], nbytes: Sequence[int]) -> None:
        """Point :meth:`record` of the running ``execution`` at the executor's live columns.

        An executor keeps the running execution in lists (a list store costs a fraction of a
        NumPy scalar store) and copies them in with :meth:`store` when it ends.
        """
        self._live = (execution, posted, fired, completed, nbytes)

    def store(self, execution: int, posted: Sequence[float], fired: Sequence[float],
              completed: Sequence[float], nbytes: Sequence[int]) -> None:
        """Write the per-op columns of ``execution`` (one vectorised copy per column)."""
        if self._live is not None and self._live[0] == execution:
            self._live = None
        row = execution % self.capacity
        if self.meta[row, 0] != execution:
            return  # the ring has moved on (or the row was never begun)
        t = self.times[row]
        t[:, POSTED] = posted
        t[:, FIRED] = fired
        t[:, COMPLETED] = completed
        self.nbytes[row] = nbytes

    def started(self, execution: int, now: float) -> None:
        self.meta[execution % self.capacity, 2] = now

    def end(self, execution: int, now: float) -> None:
        self.meta[execution % self.capacity, 3] = now
        if self.sink is not None:
            self.sink(self.record(execution))

    def row_bytes(self, execution: int) -> np.ndarray:
        """The per-op byte counts of ``execution``'s row."""
        b: np.ndarray = self.nbytes[execution % self.capacity]
        return b

    def executions(self) -> list[int]:
        """The executions held, oldest first."""
        es = [int(e) for e in self.meta[:, 0] if not math.isnan(e)]
        return sorted(es)

    def record(self, execution: int) -> dict[str, Any]:
        """The JSON-safe record of ``execution`` (``KeyError`` if no longer held)."""
        row = execution % self.capacity
        if self.meta[row, 0] != execution:
            raise KeyError(f"execution {execution} is not in the trace ring")
        _, armed, started, completed = (float(x) for x in self.meta[row])

        def f(x: float) -> float | None:
            return None if math.isnan(x) else x

        live = self._live
        if live is not None and live[0] == execution:  # still running: read the live columns
            ops = [[f(a), f(b), f(c), int(n)] for a, b, c, n in zip(*live[1:], strict=True)]
        else:
            ops = [[f(float(a)), f(float(b)), f(float(c)), int(n)]
                   for (a, b, c), n in zip(self.times[row], self.nbytes[row], strict=True)]
        return {
            "execution": execution,
            "armed": f(armed),
            "started": f(started),
            "completed": f(completed),
            "activation": "internal" if not math.isnan(started) else "external",
            "ops": ops,
            **self.extra[row],
        }

    def to_dict(self) -> dict[str, Any]:
        """Every held execution, oldest first; op columns: posted, fired, completed, bytes."""
        return {"columns": ["posted", "fired", "completed", "bytes"],
                "executions": [self.record(e) for e in self.executions()]}
