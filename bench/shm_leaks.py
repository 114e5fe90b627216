"""What a job leaves in shared memory when something dies at a random point: 0 bytes, always.

Each trial runs ``asynccoll run -n P`` (P = 3) in a private segment directory
(``ASYNCCOLL_SHM_DIR``, a fresh directory under ``/dev/shm``: the same tmpfs) with one workload
(a *mode*) and kills something at a random moment:

* ``plain``: ``comm.allreduce`` of 1 MiB (one-shot through segments);
* ``cma0``: the same at 8 MiB with ``ASYNCCOLL_CMA=0`` (two-shot through segments);
* ``empty``: arrays of ``comm.empty``, reduced in place;
* ``partial``: a solo partial allreduce handle through shared memory;
* ``sparse``: a sparse solo partial handle whose data phase goes through shared memory;
* ``mixed``: all of the above, interleaved;
* ``launcher-term`` / ``launcher-kill``: the mixed workload, the launcher itself sent
  ``SIGTERM`` / ``SIGKILL`` at a random moment once every rank has connected.

In the first six a random rank SIGKILLs itself at a random moment: in three trials of four
within 1.5 s of its connect (mostly in the collectives), in the fourth within 4 s of its start
(its import and rendezvous included); under ``--max-failures`` 0 (the launcher stops the
others) or 1 (they go on) alternately. A row per mode: trials, how many killed the victim after
it connected, bytes and files left after the launcher (and every rank) exited, which must be
0, and what the launcher found and unlinked (what the ranks' own cleanup left to it; it says
so under ``--verbose``).

    python bench/shm_leaks.py [--quick] [--trials 20] [--modes plain,cma0] [--out F.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parents[1])
P = 3
MODES = ("plain", "cma0", "empty", "partial", "sparse", "mixed", "launcher-term",
         "launcher-kill")

RANK = r'''
import os, sys
mode, victim, kill_at, steps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
R = int(os.environ["ASYNCCOLL_RANK"])


def arm(at):
    import signal, threading
    t = threading.Timer(at, os.kill, (os.getpid(), signal.SIGKILL))
    t.daemon = True
    t.start()


if R == victim and kill_at >= 0 and sys.argv[5] == "start":
    arm(kill_at)
import asyncio
import numpy as np
import asynccoll


async def main():
    comm = await asynccoll.connect(timeout=15, collective_timeout=15)
    print("connected", os.getpid(), flush=True)
    if R == victim and kill_at >= 0 and sys.argv[5] == "connect":
        arm(kill_at)
    try:
        async with comm:
            n = 1 << 18
            x = np.ones(n, np.float32)
            big = np.ones(1 << 21, np.float32)
            rng = np.random.default_rng(R)
            idx = np.sort(rng.choice(1 << 16, 600, replace=False)).astype(np.int32)
            sv = asynccoll.SparseVector(idx, np.ones(600, np.float32), 1 << 16)
            mix = mode not in ("plain", "cma0", "empty", "partial", "sparse")
            ops = []
            if mode == "plain" or mix:
                ops.append(lambda: comm.allreduce(x))
            if mode == "cma0":
                ops.append(lambda: comm.allreduce(big))
            if mode == "empty" or mix:
                e = await comm.empty(n, np.float32)
                e[:] = 1
                ops.append(lambda: comm.allreduce(e, out=e))
            if mode == "partial" or mix:
                h = comm.partial_allreduce(asynccoll.Solo(), like=x,
                                           path=asynccoll.DataPath(shm=True))
                ops.append(lambda: h(x))
            if mode == "sparse" or mix:
                hs = comm.partial_allreduce(asynccoll.Solo(), like=sv, path=asynccoll.DataPath(
                    algorithm="ssar_split_allgather"))
                ops.append(lambda: hs(sv))
            for i in range(steps):
                await ops[i % len(ops)]()
                await asyncio.sleep(0.01)
    except asynccoll.AsyncCollError as exc:  # a lost rank: the job goes on without this one
        print("ended by", type(exc).__name__, flush=True)


asyncio.run(main())
'''

_REMOVED = re.compile(rb"removed (\d+) shared-memory segments \((\d+) bytes\)")


def left(directory: str) -> tuple[int, int]:
    """(files, bytes of memory they hold) in ``directory``."""
    files = held = 0
    for name in os.listdir(directory):
        with contextlib.suppress(FileNotFoundError):
            files, held = files + 1, held + os.lstat(os.path.join(directory, name)).st_blocks * 512
    return files, held


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Wait (no polling: pidfds) until the processes ``pids`` have exited."""
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    try:
        deadline = time.monotonic() + timeout
        while fds:
            ready, _, _ = select.select(fds, [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"ranks still running {timeout} s after the launcher died")
            for fd in ready:
                fds.remove(fd)
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


def trial(mode: str, seed: int, steps: int = 30, timeout: float = 90.0) -> dict[str, Any]:
    """One trial of ``mode`` (module doc) with randomness from ``seed``; returns what was left
    after everything exited and what the launcher unlinked."""
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="asynccoll-leaks-")
    segs = tempfile.mkdtemp(prefix="asynccoll-leaks-", dir="/dev/shm")
    script = os.path.join(work, "rank.py")
    Path(script).write_text(RANK)
    env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_SHM_DIR": segs,
           "ASYNCCOLL_SECRET": "shm-leaks-0123456789abcdef0123456789"}
    if mode == "cma0":
        env["ASYNCCOLL_CMA"] = "0"
    env.pop("ASYNCCOLL_JOB_TAG", None)
    at_launcher = mode.startswith("launcher-")
    if at_launcher:  # the job ends by the launcher's signal only, not by finishing first
        steps = max(steps, 100_000)
    # Three trials in four: the kill lands within 1.5 s of the victim's connect (mostly in the
    # collectives); the fourth: within 4 s of its start (its import and rendezvous too).
    start = seed % 4 == 3
    victim, kill_at = rng.randrange(P), rng.uniform(0.0, 4.0 if start else 1.5)
    failures = seed % 2 if not at_launcher else 0
    cmd = [sys.executable, "-m", "asynccoll.cli", "run", "-n", str(P), "--verbose",
           "--grace", "2", "--max-failures", str(failures), script, mode,
           str(victim if not at_launcher else -1), str(kill_at), str(steps),
           "start" if start else "connect"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        pids: list[int] = []
        if at_launcher:  # once every rank connected, a random moment later: the signal
            assert proc.stdout is not None
            for line in proc.stdout:
                if b"] connected " in line:
                    pids.append(int(line.split()[-1]))
                    if len(pids) == P:
                        break
            time.sleep(rng.uniform(0.0, 1.0))
            proc.send_signal(signal.SIGTERM if mode == "launcher-term" else signal.SIGKILL)
        out, _ = proc.communicate(timeout=timeout)
        if mode == "launcher-kill":
            _wait_gone(pids, timeout)
        files, held = left(segs)
        found = _REMOVED.search(out or b"")
        return {"mode": mode, "seed": seed, "code": proc.returncode,
                "after_connect": f"[{victim}] connected".encode() in (out or b""),
                "files_left": files, "bytes_left": held,
                "launcher_files": int(found.group(1)) if found else 0,
                "launcher_bytes": int(found.group(2)) if found else 0,
                "seconds": time.monotonic() - t0, "output": (out or b"")[-3000:].decode(
                    errors="replace")}
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(segs, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 trials per mode")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/shm_leaks.json")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _harness import write_json

    trials = 2 if args.quick else args.trials
    rows = []
    for mode in args.modes.split(","):
        runs = [trial(mode, args.seed + i) for i in range(trials)]
        row = {"mode": mode, "P": P, "trials": trials,
               "bytes_left_max": max(r["bytes_left"] for r in runs),
               "files_left_max": max(r["files_left"] for r in runs),
               "victim_killed_after_connect": sum(r["after_connect"] for r in runs),
               "trials_with_leftovers_for_the_launcher": sum(bool(r["launcher_files"])
                                                             for r in runs),
               "launcher_bytes_max": max(r["launcher_bytes"] for r in runs),
               "seconds_median": sorted(r["seconds"] for r in runs)[trials // 2]}
        rows.append(row)
        print(row, file=sys.stderr)
        for r in runs:
            if r["files_left"]:
                print(f"LEFT: {r['mode']} seed {r['seed']}:\n{r['output']}", file=sys.stderr)
    write_json(args.out, "shm_leaks", {"trials": trials, "P": P, "modes": args.modes,
                                       "seed": args.seed, "quick": args.quick}, rows)


if __name__ == "__main__":
    main()
