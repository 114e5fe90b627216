"""Each rank's fatal error, recorded for the launcher, so that it blames the first failure.

When one rank raises, the others soon fail too (they lose it, or their collectives time out),
and whichever exits first is not the one that failed first. ``asynccoll run`` therefore gives
each rank a file to write its uncaught exception to (``ASYNCCOLL_ERROR_FILE``, the way
torchelastic's error files work); :func:`~asynccoll.launch.connect` installs the hook that
writes it. The launcher reads the files, takes a failure that is not a consequence of another
rank's loss as the cause (the earliest, if several), prints its traceback first and one line
for each rank that failed after it.

The hook (:func:`install`) is process-wide, as any ``sys.excepthook`` is, and is installed only
when ``ASYNCCOLL_ERROR_FILE`` is set (by ``asynccoll run``); under other launchers nothing
changes. With it, the rank does not print the traceback itself: the launcher prints it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from ..errors import CollectiveTimeoutError, PeerLostError

__all__ = ["ENV", "RankError", "forget", "install", "lost_peer", "read"]

#: the variable naming the file a rank writes its fatal error to
ENV = "ASYNCCOLL_ERROR_FILE"


@dataclass(frozen=True)
class RankError:
    """One rank's uncaught exception: what, when (``time.time()``) and whether it followed
    another rank's loss (``lost_peer``: the rank lost, or ``None``)."""

    rank: int
    time: float
    type: str
    message: str
    traceback: str
    lost_peer: int | None

    @property
    def follow_on(self) -> bool:
        """True when this failure is a consequence of another rank's failure."""
        return self.lost_peer is not None or self.type == CollectiveTimeoutError.__name__


def lost_peer(exc: BaseException) -> int | None:
    """The rank named by a :class:`~asynccoll.PeerLostError` in ``exc``'s chain, else None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, PeerLostError):
            return e.rank
        e = e.__cause__ or e.__context__
    return None


def write(path: str | os.PathLike[str], rank: int, exc: BaseException) -> None:
    """Write ``exc`` as ``rank``'s record to ``path`` (atomically: a reader never sees half)."""
    rec = RankError(rank, time.time(), type(exc).__name__, str(exc),
                    "".join(traceback.format_exception(exc)), lost_peer(exc))
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(rec), f)
    os.replace(tmp, path)


def install(path: str, rank: int) -> None:
    """Make an uncaught exception of this process write ``rank``'s record to ``path`` instead
    of printing its traceback (``KeyboardInterrupt`` and ``SystemExit`` print as before).
    Idempotent. If the file cannot be written, the traceback is printed as usual."""
    prev = sys.excepthook
    if getattr(prev, "_asynccoll_errorfile", False):
        return

    def hook(tp: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        if isinstance(exc, Exception):
            try:
                write(path, rank, exc.with_traceback(tb))
                return
            except OSError:
                pass
        prev(tp, exc, tb)

    hook._asynccoll_errorfile = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def read(directory: Path) -> Mapping[int, RankError]:
    """Every record in ``directory`` (files named ``rank-R.json``), by rank; unreadable or
    half-written files are skipped."""
    out: dict[int, RankError] = {}
    for f in directory.glob("rank-*.json"):
        try:
            rec = RankError(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        out[rec.rank] = rec
    return out


def forget(directory: Path, rank: int) -> None:
    """Remove ``rank``'s record from ``directory`` (the rank is restarted: a record of its new
    process must not be mistaken for its last one's)."""
    with contextlib.suppress(FileNotFoundError):
        (directory / f"rank-{rank}.json").unlink()
