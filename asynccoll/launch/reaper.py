"""The launcher's reaper: ends the ranks of a launcher that died and unlinks their segments.

``asynccoll run`` starts one per node, ``python -m asynccoll.launch.reaper TAG DIR GRACE``, in
a session of its own, with a pipe on its standard input whose only writer is the launcher.
The launcher writes the process id of every rank it starts (each leads its process group),
one per line, and ``done`` once it has stopped its ranks and unlinked the job's segments
itself. End of input without ``done`` means the launcher died (``SIGKILL`` included, which it
cannot handle): the reaper waits up to ``GRACE`` seconds for the ranks to end (each was sent
``SIGTERM`` by the kernel, ``PR_SET_PDEATHSIG``), kills the process groups still there, waits
for them, and unlinks every segment of the job's tag in ``DIR``
(:func:`asynccoll.comm.shm.unlink_job`). A rank's own handler cannot be relied on for this:
Python runs it on the main thread only, never while that thread is stuck.

Costs one small process per node for the job's life, blocked on its input.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Sequence

from ..comm.shm import unlink_job

__all__ = ["main"]


def _wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to end (pidfds: no polling); return those
    still running."""
    fds: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds[os.pidfd_open(pid)] = pid
    deadline = time.monotonic() + timeout
    try:
        while fds:
            ready, _, _ = select.select(list(fds), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for fd in ready:
                del fds[fd]
                os.close(fd)
        return list(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the reaper (module doc); returns the exit code."""
    tag, directory, grace = (argv if argv is not None else sys.argv[1:])
    pids: list[int] = []
    for line in sys.stdin:
        word = line.strip()
        if word == "done":
            return 0
        if word.isdigit():
            pids.append(int(word))
    left = _wait_gone(pids, float(grace))
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    _wait_gone(left, 30.0)
    unlink_job(tag, directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
