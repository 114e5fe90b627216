"""Taking a lost rank back (issue 32, "Grow back"): state transfer to a joiner, a restarted
process's time to its first contribution, the members' step during the join, training under
churn.

    python bench/join.py [--quick | --full] [--out F.json] [--plot F.png] [--parts LIST]
                         [--path read,ring,tcp] [--sizes 64M,1G] [--repeat N] [--churn-runs N]

P = 4 real rank processes under ``asynccoll run -n 4 --max-restarts N`` over loopback tcp;
a rank dies by SIGKILL, the launcher restarts it (``ASYNCCOLL_RESTART``), it joins the
running job. The rank programs are in ``bench/_join_job.py``. Parts:

* ``transfer``: the state (two uint32 arrays, as parameters and momentum, of ``size`` bytes
  together) striped by the three members to the joiner through
  :func:`asynccoll.comm.joining.admit` / :func:`~asynccoll.comm.joining.join` (a tiny solo
  handle beside it, so the handle's rebuild costs nothing), by each ``--path``: ``read`` (the
  default on one host: the joiner reads each member's stripe straight out of its memory,
  :mod:`asynccoll.comm.state_send`), ``ring`` (``ASYNCCOLL_CMA=0``: the members hand their
  stripes over through rings in shared memory at every size, though by default only stripes
  of ``ASYNCCOLL_JOIN_RING_MIN`` (128 MiB) or more take it) and ``tcp`` (``ASYNCCOLL_SHM=0``),
  in turn; the job's segments in a private directory, counted after the job:
  ``segments_left``. Transfer time: from the first member entering ``admit`` to the joiner
  having every stripe and its digest (its ``check`` starting);
  ``effective``: to the last rank through the digest comparison that ends the join (the
  members hash their whole state meanwhile). The peers, measured in the same run right after
  each repeat: raw loopback TCP, one stream of ``size`` bytes from one process to another
  (``sock_sendall`` / ``sock_recv_into`` into a touched buffer, timed from the first byte sent
  to a 1-byte acknowledgement), on uvloop (the loop of asynccoll's progress thread) and on
  plain asyncio; and one copy of ``size`` bytes in one process (``np.copyto`` between touched
  arrays: the ceiling of a path that copies each byte once on one core).
  Each rank's CPU seconds (every thread) in ``admit`` / ``join`` are recorded: the cost,
  which the load of a shared machine does not change as it does the wall time.
  With ``--sample``, the joiner and rank 0 also sample where their threads are every 2 ms
  (``_join_job.Sampler``; the shares are in the JSON's ``profiles``: the account of the costs
  in docs/benchmarks.md).
* ``restart``: :class:`asynccoll.EagerSGD` (solo, momentum 0.5, ``step_s`` of simulated
  compute per step) with a state of 1 MiB and of the largest size that fits this machine's
  memory (every rank holds about 9.5 times its state: measured; by default at most 128 MiB,
  whose steps already take seconds here). From the restarted process's ``connect()``
  returning to its join step returning, and to its first step after the join returning (its
  first contribution); every member's per-step times, and the step that contains the join
  against the member's median step without a join or a loss.
* ``grow`` (not in the default parts): the same figures for a rank added to a running job:
  P one-rank launchers under ``--nnodes P-1:P``, nodes 0..P-2 start the job, node P-1's
  launcher is started once they train; from the new rank's ``connect()`` to its join step and
  to its first contribution, and the P - 1 members' step with the join against their median
  (states of 1 MiB and 64 MiB, or ``--restart-sizes``).
* ``churn``: the hyperplane task of ``bench/hyperplane.py`` (P = 4, c = 50 ms, D = 0.5c)
  under EagerSGD solo, ``accumulate=True``; every ``--kill-every`` seconds the parent SIGKILLs a
  rank chosen at random among those training (not one that is joining: a kill during a join is
  a separate, known gap; and none in the last ``min(100, steps / 3)`` steps: a rank killed as
  the others finish has nobody to join), the launcher restarts it (``--max-restarts 1000``)
  and it joins; the same runs without kills. Final validation MSE (after ``finish()``), wall
  time, kills, joins; a failed run is recorded with the launcher's exit code, its summary
  lines and every traceback the ranks printed, not hidden.

The default is sized for about 10 minutes on the 2-core machine (64 MiB and 1 GiB, 3
repeats, the restart at 1 MiB and at most 128 MiB, churn runs of 500 steps); ``--full`` (what
docs/benchmarks.md quotes: 28 minutes under a load average of 12-20) 64 MiB, 256 MiB and 1 GiB,
5 repeats, the largest restart state that fits, churn runs of 1200 steps; ``--quick`` (76 s
under load) one repeat of 64 MiB, 1 MiB and a short churn pair. Times are
``time.monotonic()``, one clock for every process of a Linux host. Every process started is
stopped, by PID, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import free_port, spawn_world, stats, write_json

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("_join_job.py")
P = 4
MiB = 1 << 20
ANCHOR_GBPS = 2.4  # torchft's process-group transfer: 12 GB in about 5 s (issue 32)
SHM_GOAL_GBPS = 5.0  # the goal through shared memory (issue 32): read in place or a ring
GOAL_STEP_RATIO = 1.5
#: resident bytes per rank of the EagerSGD job: about 9.5 x the state plus 150 MiB (measured:
#: 559 MiB at a 64 MiB state, 2484 MiB at 256 MiB: parameters, momentum, the sync buffer, the
#: result buffer, the gradient, the handle's buffers and survival's copies)
EAGER_RSS = (9.5, 150 * MiB)
#: what a donor logs when it cannot make its segment (the run is then marked as fallen back)
FELL_BACK = "goes over the network: no shared-memory segment"


# -- running a job -----------------------------------------------------------------------------
class Job:
    """One ``asynccoll run`` of a ``_join_job.py`` program; its reports, log and kills."""

    def __init__(self, program: str, cfg: dict[str, Any], restarts: int,
                 env: dict[str, str] | None = None) -> None:
        self.program, self.cfg, self.restarts = program, cfg, restarts
        self.env = env or {}
        self.rc: int | None = None
        self.log = ""
        self.reports: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.joins: list[dict[str, Any]] = []
        self.t0 = 0.0  # when the launcher started (time.monotonic())

    def run(self, timeout: float, tick: Callable[[Job, Path], None] | None = None) -> Job:
        with tempfile.TemporaryDirectory(prefix="join-bench-") as tmp:
            out = Path(tmp)
            cmd = [sys.executable, "-m", "asynccoll.cli", "run", "-n", str(P),
                   "--max-restarts", str(self.restarts), str(JOB), self.program, tmp,
                   json.dumps(self.cfg)]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **self.env}
            self.t0 = time.monotonic()
            with open(out / "launcher.log", "wb") as log:
                proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    deadline = time.monotonic() + timeout
                    while proc.poll() is None and time.monotonic() < deadline:
                        time.sleep(0.1)
                        if tick is not None:
                            tick(self, out)
                    self.rc = proc.poll()
                finally:
                    _stop(proc, out)
            self.log = (out / "launcher.log").read_text(errors="replace")
            for f in sorted(out.glob("rank-*.json")):
                self.reports.append(json.loads(f.read_text()))
            for f in sorted(out.glob("joined-*.json")):
                self.joins.append(json.loads(f.read_text()))
        return self

    def run_grow(self, timeout: float, wait_s: float) -> Job:
        """The job on P one-rank nodes under ``--nnodes P-1:P``: nodes 0..P-2 start it; once
        their ranks train, ``wait_s`` later, node P-1's launcher adds rank P-1 to it."""
        with tempfile.TemporaryDirectory(prefix="join-bench-") as tmp:
            out = Path(tmp)
            port = free_port()
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                   "ASYNCCOLL_SECRET": "join-bench-grow-secret-0123456789", **self.env}

            def launcher(node: int) -> subprocess.Popen[bytes]:
                cmd = [sys.executable, "-m", "asynccoll.cli", "run", "-n", "1", "--nnodes",
                       f"{P - 1}:{P}", "--node-rank", str(node), "--rdzv", f"127.0.0.1:{port}",
                       "--rdzv-timeout", "60", str(JOB), self.program, tmp,
                       json.dumps(self.cfg)]
                with open(out / f"launcher-{node}.log", "wb") as log:
                    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

            self.t0 = time.monotonic()
            deadline = self.t0 + timeout
            procs = [launcher(0)]
            try:
                procs += [launcher(k) for k in range(1, P - 1)]
                started = None
                while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                    time.sleep(0.05)
                    training = [f for f in out.glob("status-*")
                                if f.read_text().endswith("training")]
                    if started is None and len(training) == P - 1:
                        started = time.monotonic()
                    if started is not None and time.monotonic() >= started + wait_s:
                        procs.append(launcher(P - 1))
                        break
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                codes = [p.poll() for p in procs]
                self.rc = None if None in codes or len(procs) < P else max(
                    c for c in codes if c is not None)
            finally:
                for p in procs:
                    _stop(p, out)
            self.log = "\n".join((out / f"launcher-{k}.log").read_text(errors="replace")
                                 for k in range(len(procs)))
            for f in sorted(out.glob("rank-*.json")):
                self.reports.append(json.loads(f.read_text()))
        return self

    @property
    def failed(self) -> bool:
        return self.rc != 0 or not self.reports

    def failure(self) -> dict[str, Any]:
        """What a failed run said: exit code (None: timed out), the launcher's own lines, every
        traceback a rank printed, the log's tail."""
        lines = self.log.splitlines()
        tracebacks, cur = [], None
        for ln in lines:
            m = re.match(r"\[(\d+)\] (.*)", ln)
            body = m.group(2) if m else ln
            if body.startswith("Traceback"):
                cur = [ln]
                tracebacks.append(cur)
            elif cur is not None and m and (body.startswith(" ") or re.match(r"\w+(\.\w+)*"
                                                                             r"(Error|Exception)",
                                                                             body)):
                cur.append(ln)
            else:
                cur = None
        return {"rc": self.rc, "timed_out": self.rc is None,
                "launcher": [ln for ln in lines if ln.startswith("asynccoll run")],
                "tracebacks": ["\n".join(t) for t in tracebacks],
                "log_tail": "\n".join(lines[-60:])}

    def by(self, restarted: bool) -> list[dict[str, Any]]:
        return [r for r in self.reports if bool(r["restart"]) == restarted]


def _stop(proc: subprocess.Popen[bytes], out: Path) -> None:
    """Stop the launcher (it stops its ranks), then any rank still alive, by PID."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    for f in out.glob("status-*"):
        pid = _pid_of(f)
        if pid is not None and _is_rank(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _pid_of(status: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(status.read_text().split()[0])
    return None


def _is_rank(pid: int) -> bool:
    """Whether ``pid`` is alive and one of this benchmark's rank processes."""
    try:
        return JOB.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _mem_available() -> int:
    for ln in Path("/proc/meminfo").read_text().splitlines():
        if ln.startswith("MemAvailable:"):
            return int(ln.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def _label(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


# -- part 1: state transfer --------------------------------------------------------------------
def transfer_once(size: int, victim: int, path: str, sample: bool = False) -> dict[str, Any]:
    """One job: the victim killed, restarted, its state received through ``path`` (``read``:
    read in place out of the members' memory; ``ring``: the members hand it over through
    rings in shared memory, ``ASYNCCOLL_CMA=0``; ``tcp``: ``ASYNCCOLL_SHM=0``).
    The job's segments go to a private directory, counted when the job has ended."""
    cfg: dict[str, Any] = {"bytes": size, "timeout": 300, "victim": victim, "kill_at": 3,
                           "step_s": 0.02, "max_s": 120, "sample": sample}
    if path == "ring":
        cfg["ring_min"] = 0  # the ring at every size (by default from 128 MiB per stripe)
    with tempfile.TemporaryDirectory(prefix="join-shm-", dir="/dev/shm") as shm_dir:
        env = {"ASYNCCOLL_SHM_DIR": shm_dir, "ASYNCCOLL_SHM": "0" if path == "tcp" else "1",
               "ASYNCCOLL_CMA": "1" if path == "read" else "0"}
        job = Job("transfer", cfg, 1, env).run(timeout=300)
        left = os.listdir(shm_dir)
    joiner, members = job.by(True), job.by(False)
    if job.failed or len(joiner) != 1 or len(members) != P - 1:
        return {"failed": job.failure()}
    j = joiner[0]
    start = min(m["t_admit0"] for m in members)
    end = max(r["t_check1"] for r in job.reports)
    digests = {r["digest"] for r in job.reports}
    return {"transfer_s": j["t_check0"] - start, "effective_s": end - start,
            "check_s": max(r["t_check1"] - r["t_check0"] for r in job.reports),
            "joiner_rss_mib": j["maxrss_mib"],
            "member_rss_mib": max(m["maxrss_mib"] for m in members),
            "joiner_cpu_s": j["cpu_s"], "members_cpu_s": sum(m["cpu_s"] for m in members),
            "equal": len(digests) == 1, "segments_left": len(left),
            "fell_back": FELL_BACK in job.log,
            "profiles": {f"rank {r['rank']}{' (joiner)' if r['restart'] else ''}": r["profile"]
                         for r in job.reports if "profile" in r}}


def hash_rate(size: int, reps: int) -> list[float]:
    """GB/s of ``reps`` 64-bit XXH3 hashes of ``size`` touched bytes on one thread (the
    digest's hash, :mod:`asynccoll.comm.state_digest`): every rank hashes its whole state in a
    join, so P of them bound the transfer on a machine with fewer cores than ranks."""
    import xxhash

    a = np.ones(size, np.uint8)
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(a)
        rates.append(size / (time.perf_counter() - t0) / 1e9)
    return rates


def _holder(size: int, q: Any, ev: Any) -> None:
    """:func:`cma_read`'s other process: a touched array of ``size`` bytes, its address put on
    ``q``, held until ``ev``."""
    a = np.arange(size // 4, dtype=np.uint32)
    q.put(int(a.__array_interface__["data"][0]))
    ev.wait(600)


def cma_read(size: int, reps: int) -> list[float]:
    """GB/s of ``reps`` reads of ``size`` bytes out of another process's touched array into a
    touched one of this process (``process_vm_readv`` in 8 MiB units on one thread): the copy
    that a read in place makes, and its cost per core."""
    import multiprocessing as mp

    from asynccoll.comm.cma import read_remote

    ctx = mp.get_context("spawn")
    q, ev = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_holder, args=(size, q, ev), daemon=True)
    proc.start()
    try:
        there = q.get(timeout=120)
        dst = np.full(size, 1, np.uint8)
        here = int(dst.__array_interface__["data"][0])
        unit, rates = 8 << 20, []
        for _ in range(reps):
            t0 = time.perf_counter()
            for lo in range(0, size, unit):
                read_remote(proc.pid, there + lo, here + lo, min(unit, size - lo))
            rates.append(size / (time.perf_counter() - t0) / 1e9)
        return rates
    finally:
        ev.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def memcpy(size: int, reps: int) -> list[float]:
    """GB/s of ``reps`` copies of ``size`` bytes between two touched arrays of this process
    (``np.copyto``, one core): the ceiling of a path that copies each byte once."""
    a, b = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    b[:] = 2
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        rates.append(size / (time.perf_counter() - t0) / 1e9)
    return rates


def _raw_peer(rank: int, world: int, port: int, size: int, reps: int, uv: bool,
              q: Any) -> None:
    """One side of the raw stream (:func:`_harness.spawn_world`'s target): rank 1 receives
    into a touched buffer (as the joiner's arrays are) and acknowledges each transfer with
    one byte; rank 0 sends and reports GB/s from its first byte to the acknowledgement."""

    async def receive(loop: asyncio.AbstractEventLoop, view: memoryview) -> list[float]:
        srv = socket.create_server(("127.0.0.1", port))
        srv.setblocking(False)
        conn, _ = await loop.sock_accept(srv)
        srv.close()
        conn.setblocking(False)
        for _ in range(reps):
            got = 0
            while got < size:
                n = await loop.sock_recv_into(conn, view[got:])
                if not n:
                    raise ConnectionError("the sender closed")
                got += n
            await loop.sock_sendall(conn, b"a")
        conn.close()
        return []

    async def send(loop: asyncio.AbstractEventLoop, view: memoryview) -> list[float]:
        s = socket.socket()
        s.setblocking(False)
        for _ in range(600):  # until the receiver listens
            try:
                await loop.sock_connect(s, ("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                s.close()
                s = socket.socket()
                s.setblocking(False)
                await asyncio.sleep(0.05)
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            await loop.sock_sendall(s, view)
            if await loop.sock_recv(s, 1) != b"a":
                raise ConnectionError("the receiver closed")
            rates.append(size / (time.perf_counter() - t0) / 1e9)
        s.close()
        return rates

    async def main() -> list[float]:
        view = memoryview(np.ones(size, np.uint8))
        return await (send if rank == 0 else receive)(asyncio.get_running_loop(), view)

    try:
        if uv:
            import uvloop

            rates = uvloop.run(main())
        else:
            rates = asyncio.run(main())
        q.put((rank, "ok", rates))
    except Exception:
        q.put((rank, "error", traceback.format_exc()))


def raw_tcp(size: int, reps: int, uv: bool) -> list[float]:
    """GB/s of ``reps`` transfers of ``size`` bytes over one loopback TCP stream."""
    rates: list[float] = spawn_world(_raw_peer, 2, (free_port(), size, reps, uv), 300)[0]
    return rates


def part_transfer(sizes: list[int], repeat: int, paths: list[str], rng: random.Random,
                  notes: list[str], sample: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    avail = _mem_available()
    loops = [("uvloop", True), ("asyncio", False)]
    for size in sizes:
        need = P * size + P * 150 * MiB
        if need > 0.7 * avail:
            notes.append(f"transfer {_label(size)} skipped: needs about {need / 2**30:.1f} GiB, "
                         f"{avail / 2**30:.1f} GiB available")
            print(notes[-1], file=sys.stderr)
            continue
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
        fails: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
        raw: dict[str, list[float]] = {name: [] for name, _ in loops}
        copies: list[float] = []
        hashes: list[float] = []
        reads: list[float] = []
        for _ in range(repeat):  # the paths and the peers in turn: the same load on each
            for path in paths:
                res = transfer_once(size, rng.randrange(P), path, sample)
                (fails[path] if "failed" in res else runs[path]).append(res)
            for name, uv in loops:
                raw[name] += raw_tcp(size, 3, uv)
            copies += memcpy(size, 3)
            hashes += hash_rate(size, 3)
            reads += cma_read(size, 3)
        here = []
        for path in paths:
            row: dict[str, Any] = {"case": "state transfer", "impl": "asynccoll",
                                   "transport": path, "P": P, "donors": P - 1, "size": size,
                                   "runs": len(runs[path]),
                                   "failures": [f["failed"] for f in fails[path]]}
            ok = runs[path]
            if ok:
                row.update(stats("GBps", [size / r["transfer_s"] / 1e9 for r in ok]))
                row.update(stats("effective_GBps", [size / r["effective_s"] / 1e9 for r in ok]))
                for key in ("transfer_s", "effective_s", "check_s", "joiner_rss_mib",
                            "member_rss_mib", "joiner_cpu_s", "members_cpu_s"):
                    row.update(stats(key, [r[key] for r in ok]))
                row.update(stats("cpu_s_per_GiB", [(r["joiner_cpu_s"] + r["members_cpu_s"])
                                                   / (size / 2**30) for r in ok]))
                row["state_equal_every_run"] = all(r["equal"] for r in ok)
                row["segments_left"] = [r["segments_left"] for r in ok]
                row["fell_back_to_tcp"] = sum(r["fell_back"] for r in ok)
                if sample:
                    row["profiles"] = [r["profiles"] for r in ok]
            here.append(row)
        for name, _ in loops:
            here.append({"case": "one tcp stream", "impl": "asyncio-raw", "loop": name,
                         "size": size, "runs": len(raw[name]), **stats("GBps", raw[name])})
        here.append({"case": "one copy", "impl": "numpy-copyto", "size": size,
                     "runs": len(copies), **stats("GBps", copies)})
        here.append({"case": "one hash", "impl": "xxh3-64", "size": size,
                     "runs": len(hashes), **stats("GBps", hashes)})
        here.append({"case": "one read in place", "impl": "process_vm_readv", "size": size,
                     "runs": len(reads), **stats("GBps", reads)})
        # what this machine's cores allow a join that copies each byte once and hashes the
        # whole state on every one of the P ranks (the digest check): with a copy at one
        # np.copyto's rate, and at one read in place's (the copy the default path makes)
        cores = os.cpu_count() or 1
        h, c, r = (float(np.median(v)) for v in (hashes, copies, reads))
        here.append({"case": "cpu ceiling", "impl": "model", "size": size, "cores": cores,
                     "formula": "cores / (P / one hash + 1 / one copy)",
                     "GBps_median": cores / (P / h + 1 / c)})
        here.append({"case": "cpu ceiling, read in place", "impl": "model", "size": size,
                     "cores": cores, "formula": "cores / (P / one hash + 1 / one read in place)",
                     "GBps_median": cores / (P / h + 1 / r)})
        _say_transfer(here)
        rows += here
    return rows


def _say_transfer(rows: list[dict[str, Any]]) -> None:
    peers = {r.get("loop", r["case"]): r["GBps_median"] for r in rows
             if r["case"] != "state transfer"}
    for a in (r for r in rows if r["case"] == "state transfer"):
        if "GBps_median" not in a:
            print(f"transfer {_label(a['size'])} {a['transport']}: every run failed",
                  file=sys.stderr)
            continue
        print(f"transfer {_label(a['size'])} {a['transport']}: {a['GBps_median']:.2f} GB/s "
              f"[{a['GBps_min']:.2f}, {a['GBps_max']:.2f}] (with the digest check "
              f"{a['effective_GBps_median']:.2f}); CPU {a['cpu_s_per_GiB_median']:.2f} s/GiB "
              f"over the 4 ranks; {len(a['failures'])} failed; segments left "
              f"{sum(a['segments_left'])}", file=sys.stderr)
    print(f"  peers: one raw tcp stream uvloop {peers['uvloop']:.2f}, asyncio "
          f"{peers['asyncio']:.2f} GB/s; one copy {peers['one copy']:.2f} GB/s; one hash "
          f"{peers['one hash']:.2f} GB/s; one read in place {peers['one read in place']:.2f} "
          f"GB/s; so this machine's cores allow at most {peers['cpu ceiling']:.2f} GB/s to a "
          "join that copies once and hashes on every rank, "
          f"{peers['cpu ceiling, read in place']:.2f} with the copy a read in place",
          file=sys.stderr)


# -- parts 2 and 3: restart to first contribution, the members' step during the join -----------
def _phase_sums(spans: list[list[Any]], a: float, b: float) -> dict[str, float]:
    """The seconds each timed part (``_join_job._phases``) took between ``a`` and ``b``."""
    out: dict[str, float] = {}
    for name, t0, t1 in spans:
        if a <= t0 and t1 <= b:
            out[name] = out.get(name, 0.0) + t1 - t0
    return out


def _covered(spans: list[tuple[float, float]]) -> float:
    """The seconds the union of ``spans`` covers."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _join_phases(spans: list[list[Any]], a: float, b: float) -> dict[str, float]:
    """The join step's parts: its sync event's (flush, allreduce, broadcast) and the
    admission's, with ``until_go`` (from the member's digest to its first stripe sent: the
    header to the joiner and the joiner's ``GO`` back) and ``admit_other`` (the rest)."""
    out = _phase_sums(spans, a, b)
    inside = [s for s in spans if a <= s[1] and s[2] <= b]
    adm = [s for s in inside if s[0] == "admit"]
    gives = [s for s in inside if s[0] == "give"]
    digs = [s for s in inside if s[0] == "digest"]
    if adm and gives:
        before = max((s[2] for s in digs + [s for s in inside if s[0] == "grow"]
                      if s[2] <= gives[0][1]), default=adm[0][1])
        out["until_go"] = min(g[1] for g in gives) - before
        # the joiners' stripes go in parallel: first start to last end
        out["give"] = max(g[2] for g in gives) - min(g[1] for g in gives)
        # the parts overlap (a large state's digest runs on a thread while the stripes go):
        # the rest is what no part covers
        out["admit_other"] = out["admit"] - _covered(
            [(t0, t1) for n, t0, t1 in inside if n in ("make_comm", "grow", "digest", "give",
                                                       "check")]
            + [(before, min(g[1] for g in gives))])
    return {k: round(v, 5) for k, v in out.items()}


def restart_once(size: int, victim: int, step_s: float, sync_every: int | None = None
                 ) -> dict[str, Any]:
    # a large state's steps take seconds: the restart is over within a step or two
    short = size >= 64 * MiB
    cfg = {"bytes": size, "timeout": 300, "victim": victim, "kill_at": 3 if short else 5,
           "step_s": step_s, "max_s": 240, "steps": 10 if short else 15,
           "after": 3 if short else 5, "sync_every": sync_every}
    job = Job("restart", cfg, 1).run(timeout=330)
    return _joined_run(job, job.by(True), job.by(False), victim)


def grow_once(size: int, step_s: float, sync_every: int | None = None) -> dict[str, Any]:
    """:func:`restart_once` for growth: P - 1 ranks train, rank P - 1 is added to the running
    job (a node's launcher started later under ``--nnodes P-1:P``) and taken in."""
    short = size >= 64 * MiB
    cfg = {"bytes": size, "timeout": 300, "victim": -1, "kill_at": -1, "world": P,
           "step_s": step_s, "max_s": 240, "steps": 10 if short else 15,
           "after": 3 if short else 5, "sync_every": sync_every}
    wait = max(3, 4 if short else 6) * (step_s + (0.5 if short else 0.0))
    job = Job("restart", cfg, 0).run_grow(timeout=330, wait_s=wait)
    new = [r for r in job.reports if r["rank"] == P - 1]
    return _joined_run(job, new, [r for r in job.reports if r["rank"] != P - 1], P - 1)


def _joined_run(job: Job, joiner: list[dict[str, Any]], members: list[dict[str, Any]],
                victim: int) -> dict[str, Any]:
    """One run's figures: the joiner's times, and each member's step with the join against
    its median step."""
    if job.failed or len(joiner) != 1 or len(members) != P - 1:
        return {"failed": job.failure()}
    j = joiner[0]
    js = j["steps"]
    if len(js) < 2 or not js[0][3]:
        return {"failed": {"why": "the restarted process's first step did not join",
                           **job.failure()}}
    c1 = j["t_connect1"]
    out: dict[str, Any] = {
        "victim": victim,
        "start_to_connected_s": c1 - j["t_start"],
        "connect_s": c1 - j["t_connect0"],
        "connect_to_joined_s": js[0][1] - c1,
        "connect_to_first_contribution_s": js[1][1] - c1,
        "first_included": bool(js[1][5]),
        "equal": len({r["digest"] for r in job.reports}) == 1,
        "rss_mib": max(r["maxrss_mib"] for r in job.reports), "members": []}
    for m in members:
        s = m["steps"]
        dur = [b - a for a, b, *_ in s]
        ws = [w for _, _, w, *_ in s]
        holds = [i for i, (a, b, *_) in enumerate(s) if a <= m.get("t_admit0", -1.0) <= b]
        if not holds:
            return {"failed": {"why": f"member {m['rank']} has no step holding its admit",
                               **job.failure()}}
        g = holds[0]
        # the loss's step: where the world shrank, or the join's own step when the restart
        # was quicker than the step (the recovery and the join in one step)
        lost = next((i for i in range(1, len(s)) if ws[i] < ws[i - 1]), g)
        # the median step: no join, no loss, no sync event (a sync event without a join is
        # measured apart: ``sync_step_s``, with its parts)
        plain = [d for i, d in enumerate(dur) if i >= 2 and i not in (lost, g) and not s[i][4]]
        syncs = [i for i in range(2, len(s)) if s[i][4] and i not in (lost, g)]
        med = float(np.median(plain))
        spans = m.get("spans", [])
        sync_parts = [_phase_sums(spans, s[i][0], s[i][1]) for i in syncs]
        out["members"].append({
            "rank": m["rank"], "join_step_s": dur[g], "median_step_s": med,
            "ratio": dur[g] / med, "loss_step_s": dur[lost],
            "loss_and_join_in_one_step": lost == g,
            "admit_s": m["t_admit1"] - m["t_admit0"], "join_step": g,
            "sync_step_s": float(np.median([dur[i] for i in syncs])) if syncs else None,
            "sync_ratio": float(np.median([dur[i] for i in syncs])) / med if syncs else None,
            "join_phases_s": _join_phases(spans, s[g][0], s[g][1]),
            "sync_phases_s": {k: round(float(np.median([p.get(k, 0.0) for p in sync_parts])), 5)
                              for k in sorted({k for p in sync_parts for k in p})},
            "loss_step": lost, "steps_s": dur, "world": ws, "synced": [x[4] for x in s]})
    return out


def part_restart(sizes: list[int], repeat: int, step_s: float, rng: random.Random,
                 sync_every: int | None = None, grow: bool = False) -> list[dict[str, Any]]:
    """The restart part, or with ``grow`` the same figures for a rank added to a running job
    (its cases named ``growth ...``)."""
    rows = []
    what = "growth" if grow else "restart"
    for size in sizes:
        runs, fails = [], []
        for _ in range(repeat):
            res = grow_once(size, step_s, sync_every) if grow else \
                restart_once(size, rng.randrange(P), step_s, sync_every)
            (fails if "failed" in res else runs).append(res)
        base = {"impl": "asynccoll", "transport": "tcp",
                "state_path": "default (read in place on one host)", "P": P, "size": size,
                "sync_every": sync_every,
                "step_compute_s": step_s, "runs": len(runs),
                "failures": [f["failed"] for f in fails]}
        row: dict[str, Any] = {"case": f"{what} to first contribution", **base}
        mrow: dict[str, Any] = {"case": "members' step during the join" + (
            " (growth)" if grow else ""), **base}
        if runs:
            for key in ("start_to_connected_s", "connect_s", "connect_to_joined_s",
                        "connect_to_first_contribution_s", "rss_mib"):
                row.update(stats(key, [r[key] for r in runs]))
            row["first_contribution_included"] = [r["first_included"] for r in runs]
            row["state_equal_every_run"] = all(r["equal"] for r in runs)
            ms = [m for r in runs for m in r["members"]]
            worst = [max(m["ratio"] for m in r["members"]) for r in runs]
            mrow.update(stats("ratio", [m["ratio"] for m in ms]))
            mrow.update(stats("worst_member_ratio", worst))
            mrow.update(stats("join_step_s", [m["join_step_s"] for m in ms]))
            mrow.update(stats("median_step_s", [m["median_step_s"] for m in ms]))
            mrow.update(stats("admit_s", [m["admit_s"] for m in ms]))
            with_sync = [m for m in ms if m["sync_step_s"] is not None]
            if with_sync:
                mrow.update(stats("sync_step_s", [m["sync_step_s"] for m in with_sync]))
                mrow.update(stats("sync_ratio", [m["sync_ratio"] for m in with_sync]))
            for key in ("join_phases_s", "sync_phases_s"):
                names = sorted({k for m in ms for k in m[key]})
                mrow[key] = {k: float(np.median([m[key].get(k, 0.0) for m in ms]))
                             for k in names}
            mrow["per_member"] = [{k: m[k] for k in ("rank", "join_step_s", "sync_step_s",
                                                     "median_step_s", "join_phases_s",
                                                     "sync_phases_s")} for m in ms]
            mrow["loss_step_s"] = [m["loss_step_s"] for m in ms]
            mrow["loss_and_join_in_one_step"] = sum(m["loss_and_join_in_one_step"] for m in ms)
            mrow["per_run"] = [{"victim": r["victim"], "members": [
                {k: m[k] for k in ("rank", "join_step", "loss_step", "steps_s", "world",
                                   "synced")}
                for m in r["members"]]} for r in runs]
        rows += [row, mrow]
        if runs:
            print(f"{what} {_label(size)}: connect -> joined "
                  f"{row['connect_to_joined_s_median']:.2f} s, -> first contribution "
                  f"{row['connect_to_first_contribution_s_median']:.2f} s "
                  f"[{row['connect_to_first_contribution_s_min']:.2f}, "
                  f"{row['connect_to_first_contribution_s_max']:.2f}]; members' join step "
                  f"{mrow['ratio_median']:.2f}x their median [{mrow['ratio_min']:.2f}, "
                  f"{mrow['ratio_max']:.2f}]; {len(fails)} failed", file=sys.stderr)
            if "sync_step_s_median" in mrow:
                print(f"{what} {_label(size)}: sync step without a join "
                      f"{mrow['sync_step_s_median']:.3f} s ({mrow['sync_ratio_median']:.2f}x), "
                      f"join step {mrow['join_step_s_median']:.3f} s", file=sys.stderr)
            for key in ("sync_phases_s", "join_phases_s"):
                print(f"  {key}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                               mrow[key].items()), file=sys.stderr)
        else:
            print(f"{what} {_label(size)}: every run failed", file=sys.stderr)
    return rows


def largest_restart_size(notes: list[str], cap: int) -> int:
    """The largest state among 1 GiB, 512, 256, 128, 64 MiB, at most ``cap``, whose EagerSGD
    job fits in 60 % of the memory available now."""
    avail = _mem_available()
    for size in (s for s in (1 << 30, 512 * MiB, 256 * MiB, 128 * MiB, 64 * MiB) if s <= cap):
        need = P * (EAGER_RSS[0] * size + EAGER_RSS[1])
        if need <= 0.6 * avail:
            capped = f", at most {_label(cap)} without --full" if cap < 1 << 30 else ""
            notes.append(f"restart: largest state {_label(size)} (needs about "
                         f"{need / 2**30:.1f} GiB over {P} ranks; {avail / 2**30:.1f} GiB "
                         f"available{capped})")
            return size
    return 64 * MiB


# -- part 4: training under churn --------------------------------------------------------------
class Watcher:
    """Reads the ranks' status files while a churn job runs: notes when all P first train
    (``started``), and, with ``every`` set, every ``every`` seconds from then SIGKILLs a rank
    drawn at random among those training (by the PID in its status file, checked to be a rank
    of this job); no kill once a rank is finishing."""

    def __init__(self, every: float | None, rng: random.Random) -> None:
        self.every, self.rng = every, rng
        self.next: float | None = None
        self.started: float | None = None

    def __call__(self, job: Job, out: Path) -> None:
        states = {}
        for f in out.glob("status-*"):
            with contextlib.suppress(OSError, ValueError):
                pid, state = f.read_text().split()
                states[int(f.name.split("-")[1])] = (int(pid), state)
        now = time.monotonic()
        training = [r for r, (pid, s) in states.items() if s == "training" and _is_rank(pid)]
        if self.started is None:
            if len(training) == P:
                self.started = now
                self.next = None if self.every is None else now + self.every
            return
        if any(s == "finishing" for _, s in states.values()):
            self.next = None
        if self.next is None or now < self.next or not training:
            return
        assert self.every is not None
        victim = self.rng.choice(sorted(training))
        pid = states[victim][0]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        job.kills.append({"t": now, "rank": victim, "pid": pid,
                          "training": sorted(training)})
        self.next = now + self.every


def churn_once(churn: bool, cfg: dict[str, Any], every: float, rng: random.Random
               ) -> dict[str, Any]:
    job = Job("churn", cfg, 1000)
    watch = Watcher(every if churn else None, rng)
    job.run(timeout=cfg["steps"] * 0.6 + 120, tick=watch)
    t0 = job.t0 if watch.started is None else watch.started  # training began
    curves = [[(t - t0, s, v) for t, s, v in r["curve"]] for r in job.reports]
    res: dict[str, Any] = {
        "churn": churn, "kills": [{**k, "t": k["t"] - t0} for k in job.kills],
        "joins": sorted(({**j, "t": j["t"] - t0} for j in job.joins), key=lambda j: j["t"]),
        "processes": len(job.reports),
        "startup_s": None if watch.started is None else watch.started - job.t0,
        "curve": sorted(pt for c in curves for pt in c)}
    finals = [r for r in job.reports if "final_val_mse" in r]
    if job.failed or len({r["rank"] for r in finals}) != P:
        res["failed"] = job.failure()
        return res
    last = {r["rank"]: r for r in sorted(finals, key=lambda r: r["restart"])}
    res.update(final_val_mse=float(np.median([r["final_val_mse"] for r in last.values()])),
               wall_s=max(r["t_end"] for r in last.values()) - t0,
               equal=len({r["digest"] for r in last.values()}) == 1,
               steps=max(r["step_count"] for r in last.values()))
    return res


def part_churn(runs: int, steps: int, every: float, rng: random.Random) -> list[dict[str, Any]]:
    cfg = {"steps": steps, "dim": 128, "step_ms": 50.0, "delay_ratio": 0.5, "lr": 0.3,
           "timeout": 120, "quiet_steps": min(100, steps // 3)}
    rows = []
    for churn in (False, True):
        done = [churn_once(churn, cfg, every, rng) for _ in range(runs)]
        ok = [d for d in done if "failed" not in d]
        row: dict[str, Any] = {"case": "churn" if churn else "no churn", "impl": "asynccoll",
                               "transport": "tcp", "P": P, "steps": steps,
                               "kill_every_s": every if churn else None,
                               "runs": len(done), "failed_runs": len(done) - len(ok),
                               "task": {k: v for k, v in cfg.items() if k != "timeout"}}
        if ok:
            row.update(stats("final_val_mse", [d["final_val_mse"] for d in ok]))
            row.update(stats("wall_s", [d["wall_s"] for d in ok]))
            row["state_equal_every_run"] = all(d["equal"] for d in ok)
        row.update(stats("kills", [len(d["kills"]) for d in done]))
        row["per_run"] = done
        rows.append(row)
        mse = f"final val MSE {row['final_val_mse_median']:.4f} " \
              f"[{row['final_val_mse_min']:.4f}, {row['final_val_mse_max']:.4f}], " \
              f"{row['wall_s_median']:.1f} s" if ok else "no run finished"
        print(f"{row['case']}: {mse}; kills per run {[len(d['kills']) for d in done]}; "
              f"{row['failed_runs']} of {runs} failed", file=sys.stderr)
    return rows


# -- the plot ----------------------------------------------------------------------------------
def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Three panels: transfer GB/s against size with the raw stream and the anchor; every
    member's step time around the join, over its median; validation MSE under churn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    _plot_transfer(axes[0], rows)
    _plot_steps(axes[1], rows)
    _plot_churn(axes[2], rows)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_transfer(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Grouped bars, one group per size: each path (transfer; hatched: with the digest
    check), the raw streams, one copy, and the CPU ceiling; the goals as lines."""
    def ours(path: str) -> Callable[[dict[str, Any]], bool]:
        return lambda r: r["impl"] == "asynccoll" and r.get("transport") == path

    series = [("read in place", "GBps", ours("read"), "tab:blue", ""),
              ("read in place, with the digest check", "effective_GBps", ours("read"),
               "tab:blue", "//"),
              ("ring in shm", "GBps", ours("ring"), "tab:orange", ""),
              ("ring in shm, with the digest check", "effective_GBps", ours("ring"),
               "tab:orange", "//"),
              ("tcp", "GBps", ours("tcp"), "tab:green", ""),
              ("tcp, with the digest check", "effective_GBps", ours("tcp"), "tab:green", "//"),
              ("raw tcp stream, uvloop", "GBps", lambda r: r.get("loop") == "uvloop",
               "tab:grey", ""),
              ("raw tcp stream, asyncio", "GBps", lambda r: r.get("loop") == "asyncio",
               "tab:grey", ".."),
              ("CPU ceiling: copy once, hash on every rank", "GBps",
               lambda r: r.get("case") == "cpu ceiling", "tab:purple", ""),
              ("CPU ceiling, the copy a read in place", "GBps",
               lambda r: r.get("case") == "cpu ceiling, read in place", "tab:purple", "//"),
              ("one copy in one process", "GBps", lambda r: r.get("case") == "one copy",
               "tab:brown", "")]
    cases = ("state transfer", "one tcp stream", "one copy", "cpu ceiling",
             "cpu ceiling, read in place")
    sizes = sorted({r["size"] for r in rows if r.get("case") == "one tcp stream"})
    width = 0.8 / len(series)
    for k, (label, key, pick, colour, hatch) in enumerate(series):
        sel = {r["size"]: r for r in rows if r.get("case") in cases and pick(r)
               and f"{key}_median" in r}
        xs = [i + (k - len(series) / 2 + 0.5) * width for i, n in enumerate(sizes) if n in sel]
        if not xs:
            continue
        got = [sel[n] for n in sizes if n in sel]
        med = np.array([r[f"{key}_median"] for r in got])
        lo = np.array([r.get(f"{key}_min", r[f"{key}_median"]) for r in got])
        hi = np.array([r.get(f"{key}_max", r[f"{key}_median"]) for r in got])
        ax.bar(xs, med, width, yerr=[med - lo, hi - med], capsize=2, color=colour,
               hatch=hatch, edgecolor="white" if not hatch else "black", linewidth=0.3,
               label=label)
    ax.axhline(ANCHOR_GBPS, color="grey", linestyle="--", label="goal over tcp: torchft's 2.4 GB/s")
    ax.axhline(SHM_GOAL_GBPS, color="grey", linestyle=":", label="goal through shm: 5 GB/s")
    ax.set_xticks(range(len(sizes)), [_label(n) for n in sizes])
    ax.set_xlabel("state moved to the joiner (3 donors)")
    ax.set_ylabel("GB/s (median, min-max)")
    ax.set_title("State to a joiner, P = 4, one host (read, ring; tcp on loopback)",
                 fontsize=10)
    ax.legend(fontsize=6, ncol=2, loc="upper left")


def _plot_steps(ax: Any, rows: list[dict[str, Any]]) -> None:
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    sel = [r for r in rows if str(r.get("case")).startswith("members' step during the join")
           and r.get("per_run")]
    for colour, row in zip(colours, sel, strict=False):
        first = True
        for run in row["per_run"]:
            for m in run["members"]:
                d = np.asarray(m["steps_s"])
                g = m["join_step"]
                keep = list(range(2, len(d)))
                med = float(np.median([d[i] for i in keep if i not in (g, m["loss_step"])]))
                ax.plot([i - g for i in keep], d[keep] / med, color=colour, alpha=0.35, lw=1,
                        label=(f"{'growth' if 'growth' in row['case'] else 'restart'}, "
                               f"state {_label(row['size'])}") if first else None)
                first = False
    ax.axhline(GOAL_STEP_RATIO, color="grey", linestyle="--", label="goal: 1.5x")
    ax.axvline(0, color="black", lw=0.6)
    ax.set_xlabel("member's step, relative to the step with the join")
    ax.set_ylabel("step time / member's median")
    ax.set_title("Members' steps around a join (EagerSGD solo, every member,\n"
                 "every run; growth: P - 1 members and a rank added)",
                 fontsize=10)
    ax.legend(fontsize=7)


def _plot_churn(ax: Any, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if row.get("case") not in ("churn", "no churn"):
            continue
        colour = "tab:red" if row["case"] == "churn" else "tab:blue"
        for i, run in enumerate(row["per_run"]):
            if not run["curve"]:
                continue
            t, _, mse = zip(*run["curve"], strict=True)
            failed = " (failed)" if "failed" in run else ""
            ax.plot(t, mse, color=colour, alpha=0.6, lw=1,
                    label=f"{row['case']}{failed}" if i == 0 or failed else None)
            for k in run["kills"]:
                ax.axvline(k["t"], color=colour, alpha=0.25, lw=0.8)
    ax.set_ylim(0.9, 1.4)
    ax.set_xlabel("seconds since every rank trained; vertical lines: kills")
    ax.set_ylabel("validation MSE (zoomed: it starts near 5)")
    ax.set_title("Hyperplane task under churn, P = 4 (a kill every ~10 s)", fontsize=10)
    ax.legend(fontsize=7)


PART_CASES = {"transfer": ("state transfer", "one tcp stream", "one copy", "one hash",
                          "one read in place", "cpu ceiling", "cpu ceiling, read in place"),
              "restart": ("restart to first contribution", "members' step during the join"),
              "grow": ("growth to first contribution",
                       "members' step during the join (growth)"),
              "churn": ("churn", "no churn")}


def kept_rows(path: str, parts: list[str]) -> list[dict[str, Any]]:
    """The rows of ``path`` (an earlier run's JSON) of the parts not in ``parts``, each marked
    ``kept_from``: that run's date and command."""
    old = json.loads(Path(path).read_text())
    keep = {c for part, cases in PART_CASES.items() if part not in parts for c in cases}
    mark = {"date": old["env"].get("date"), "command": old["params"].get("command"),
            "load_average": old["params"].get("load_average")}
    return [{**r, "kept_from": r.get("kept_from", mark)} for r in old["rows"]
            if r.get("case") in keep]


# -- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one repeat, small sizes (~1 min)")
    mode.add_argument("--full", action="store_true", help="5 repeats, 64M/256M/1G (docs)")
    ap.add_argument("--out", default="bench/results/join.json")
    ap.add_argument("--plot", default="bench/results/join.png")
    ap.add_argument("--parts", default="transfer,restart,churn")
    ap.add_argument("--sample", action="store_true", help="sample the transfer's threads "
                    "(the joiner's and rank 0's) every 2 ms; in the JSON")
    ap.add_argument("--path", default="read,ring,tcp", help="the transfer's state paths, "
                    "any of read, ring, tcp")
    ap.add_argument("--sizes", default=None, help="transfer sizes, e.g. 64M,256M,1G")
    ap.add_argument("--restart-sizes", default=None, help="e.g. 1M,256M (default: 1M and the "
                    "largest that fits)")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--churn-runs", type=int, default=None)
    ap.add_argument("--churn-steps", type=int, default=None)
    ap.add_argument("--kill-every", type=float, default=None,
                    help="seconds between kills in the churn part (10; --quick 5)")
    ap.add_argument("--step-s", type=float, default=0.1,
                    help="simulated compute per step in the restart part (s)")
    ap.add_argument("--sync-every", type=int, default=4,
                    help="EagerSGD's sync_every in the restart part: sync events without a "
                    "join, measured apart from the join's (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-other-parts", action="store_true",
                    help="keep the rows of the parts not run now from the --out file already "
                    "there (each marked with that run's date and command)")
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    unknown = set(parts) - {"transfer", "restart", "grow", "churn"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}; known: transfer, restart, grow, churn")
    paths = a.path.split(",")
    if not paths or set(paths) - {"read", "ring", "tcp"}:
        ap.error(f"--path: {a.path!r}; known: read, ring, tcp")
    level = "quick" if a.quick else "full" if a.full else "default"
    sizes = [_size(s) for s in a.sizes.split(",")] if a.sizes else \
        {"quick": [64 * MiB], "default": [64 * MiB, 1 << 30],
         "full": [64 * MiB, 256 * MiB, 1 << 30]}[level]
    repeat = a.repeat or {"quick": 1, "default": 3, "full": 5}[level]
    churn_runs = a.churn_runs or {"quick": 1, "default": 3, "full": 3}[level]
    churn_steps = a.churn_steps or {"quick": 150, "default": 500, "full": 1200}[level]
    kill_every = a.kill_every or (5.0 if a.quick else 10.0)
    rng = random.Random(a.seed)
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    t_all = time.monotonic()
    if "transfer" in parts:
        rows += part_transfer(sizes, repeat, paths, rng, notes, a.sample)
    if "restart" in parts:
        rsizes = [_size(s) for s in a.restart_sizes.split(",")] if a.restart_sizes else \
            [MiB] if a.quick else \
            [MiB, largest_restart_size(notes, (1 << 30) if a.full else 128 * MiB)]
        rows += part_restart(rsizes, repeat, a.step_s, rng, a.sync_every or None)
    if "grow" in parts:
        gsizes = [_size(s) for s in a.restart_sizes.split(",")] if a.restart_sizes else \
            [MiB] if a.quick else [MiB, 64 * MiB]
        rows += part_restart(gsizes, repeat, a.step_s, rng, a.sync_every or None, grow=True)
    if "churn" in parts:
        rows += part_churn(churn_runs, churn_steps, kill_every, rng)
    if a.keep_other_parts and os.path.exists(a.out):
        rows += kept_rows(a.out, parts)
    ratios = {}
    for r in rows:
        if r.get("case") == "state transfer" and "GBps_median" in r:
            for peer in rows:
                if peer.get("impl") in ("asyncio-raw", "numpy-copyto", "model",
                                        "process_vm_readv") \
                        and peer["size"] == r["size"]:
                    what = f"raw {peer['loop']}" if "loop" in peer else peer["case"]
                    ratios[f"{_label(r['size'])} {r['transport']} / {what}"] = \
                        r["GBps_median"] / peer["GBps_median"]
    params = {"command": "python " + " ".join([os.path.relpath(__file__, ROOT),
                                              *(sys.argv[1:] if argv is None else argv)]),
              "level": level, "P": P, "parts": parts, "sizes": sizes, "repeat": repeat,
              "churn_runs": churn_runs, "churn_steps": churn_steps,
              "kill_every_s": kill_every, "restart_step_compute_s": a.step_s,
              "restart_sync_every": a.sync_every or None,
              "seed": a.seed, "paths": paths, "transport": "tcp (loopback)",
              "anchor_GBps": ANCHOR_GBPS, "shm_goal_GBps": SHM_GOAL_GBPS,
              "mem_available_gib": round(_mem_available() / 2**30, 1),
              "load_average": os.getloadavg()}
    write_json(a.out, "join", params, rows, packages=("asynccoll", "uvloop"),
               extra={"ratios": ratios, "notes": notes,
                      "seconds": round(time.monotonic() - t_all, 1)})
    plot(rows, a.plot)
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}", file=sys.stderr)
    print(f"wrote {a.out} ({time.monotonic() - t_all:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
