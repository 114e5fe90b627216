"""A budget of log lines, so that a flood of refused connections cannot flood the log too."""

from __future__ import annotations

__all__ = ["LogBudget"]


class LogBudget:
    """At most ``burst`` log lines per ``period`` seconds; says how many were held back.

    The caller passes the time (its loop's clock), so the budget needs no clock of its own.
    Costs two comparisons per call.
    """

    def __init__(self, burst: int = 10, period: float = 10.0) -> None:
        if burst < 1 or period <= 0:
            raise ValueError(f"burst must be >= 1 and period > 0, got {burst} and {period}")
        self.burst = burst
        self.period = period
        self._start = -period
        self._said = 0
        self._quiet = 0

    def take(self, now: float) -> tuple[bool, int]:
        """Whether to log now, and how many lines were held back since the last one."""
        if now - self._start >= self.period:
            self._start, self._said = now, 0
        if self._said < self.burst:
            self._said += 1
            quiet, self._quiet = self._quiet, 0
            return True, quiet
        self._quiet += 1
        return False, 0
