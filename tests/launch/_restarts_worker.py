"""A rank of the restart tests. Usage: _restarts_worker.py MODE VICTIMS [CODE].

Every start prints ``start K env H`` first (K: ``ASYNCCOLL_RESTART``, 0 when unset; H: a hash
of the environment without ``ASYNCCOLL_RESTART``; and ``ASYNCCOLL_MAX_FAILURES``) and touches
``TEST_SHARED/started-RANK-K``. VICTIMS: comma-separated ranks.

once     a victim's first start waits until every rank of the node started, then SIGKILLs
         itself (the last victim exits CODE instead, when given); its restart exits 0. The
         others wait (up to 20 s) until every victim restarted, then exit 0: they run on
         while the victims restart.
always   the victims SIGKILL themselves on every start; the others sleep up to 30 s, or, with
         a third argument N, until every victim has started N times.
late     the others exit 0 at once (touching ``TEST_SHARED/done-RANK``); a victim waits for
         them, then exits 3 (the job was done without it).
node     a first start sleeps up to 30 s (the test kills node 1's launcher); a restart exits 0;
         node 0's ranks exit 0 once ``TEST_SHARED/go`` exists (at most 30 s).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

rank = int(os.environ["ASYNCCOLL_RANK"])
restart = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
mode, victims = sys.argv[1], [int(v) for v in sys.argv[2].split(",") if v]
shared = Path(os.environ["TEST_SHARED"])
env = sorted((k, v) for k, v in os.environ.items() if k != "ASYNCCOLL_RESTART")
digest = hashlib.sha256(repr(env).encode()).hexdigest()[:12]
print(f"start {restart} env {digest} max_failures "
      f"{os.environ.get('ASYNCCOLL_MAX_FAILURES', '-')}", flush=True)
(shared / f"started-{rank}-{restart}").touch()


def wait_for(pred: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.02)


if mode == "once":
    if rank in victims and restart == 0:
        local = int(os.environ["ASYNCCOLL_LOCAL_WORLD_SIZE"])
        wait_for(lambda: len(list(shared.glob("started-*-0"))) >= local, 20)
        if len(sys.argv) > 3 and rank == victims[-1]:
            sys.exit(int(sys.argv[3]))
        os.kill(os.getpid(), signal.SIGKILL)
    if rank not in victims:
        wait_for(lambda: all((shared / f"started-{v}-1").exists() for v in victims), 20)
    sys.exit(0)
if mode == "always":
    if rank in victims:
        os.kill(os.getpid(), signal.SIGKILL)
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    wait_for(lambda: n and all((shared / f"started-{v}-{n - 1}").exists() for v in victims), 30)
    # the victim's last start kills itself at once: let the launcher see that before this rank
    # exits 0 (a failure after a rank finished is not restarted, nor counted: the job is done)
    time.sleep(1.0)
    sys.exit(0)
if mode == "late":
    if rank not in victims:
        (shared / f"done-{rank}").touch()
        sys.exit(0)
    local = int(os.environ["ASYNCCOLL_LOCAL_WORLD_SIZE"])
    wait_for(lambda: len(list(shared.glob("done-*"))) >= local - len(victims), 20)
    time.sleep(0.5)  # (the launcher has seen them exit)
    sys.exit(3)
if mode == "node":
    if restart:
        sys.exit(0)
    if os.environ["ASYNCCOLL_NODE_RANK"] == "0":
        wait_for(lambda: (shared / "go").exists(), 30)
        sys.exit(0)
    time.sleep(30)
    sys.exit(0)
raise SystemExit(f"unknown mode {mode}")
