"""Shared-memory segments under loss and contention: a rank SIGKILLed while the segments are
being set up, or half-way through writing its reduced block into its peers' shared arrays, two
jobs at once on one host, and segment names already taken by another user.

A SIGKILL *between* calls, once every segment is unlinked, is
``tests/adversarial/test_lost_rank.py``; ``Segment`` itself refusing another user's or a
world-readable file is ``tests/comm/test_shm.py::test_segments_are_private`` (here: the whole
communicator, which must give shared memory up on every rank and take the network). The job's
segment token (drawn by rank 0 at first use) is fixed by the test, so that the check for
leftovers looks at this job's segments only, whatever else runs on the machine. Real processes
over tcp.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _helpers import (
    SECRET,
    SHM_VICTIM_PREAMBLE,
    async_child,
    free_port,
    run_killed_job,
    shm_left,
    spawn_world,
)

import asynccoll
from asynccoll.collectives.shm import SHM_MIN_BYTES
from asynccoll.comm.shm import SHM_DIR, job_prefix, job_tag, segment_path

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess]


def _left(token: int) -> list[str]:
    """This user's segments of the job whose token is ``token``."""
    prefix = job_prefix(job_tag(token))
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix))


def _fix_token(token: int) -> None:
    """Make this process's communicators name their segments with ``token``."""
    from asynccoll.comm import dense

    assert hasattr(dense, "new_token"), "the communicator no longer draws tokens this way"
    dense.new_token = lambda: token  # type: ignore[attr-defined]


# -- a rank SIGKILLed with its segment created, before the others have mapped it -------------

RANK = """
import asyncio, json, os, signal, sys, time, numpy as np, asynccoll
from asynccoll.comm import dense, shm

token, out = int(sys.argv[1]), sys.argv[2]
dense.new_token = lambda: token
if os.environ["ASYNCCOLL_RANK"] == "2":
    create = shm.Segment.create.__func__

    def create_then_die(cls, path, nbytes):
        seg = create(cls, path, nbytes)
        with open(out + "/killed", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    shm.Segment.create = classmethod(create_then_die)


async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=30)
    async with comm:
        await comm.barrier()
        x = np.ones(1 << 18, np.float32)
        try:
            await comm.allreduce(x, algorithm="shm", out=x)
            got = {"t": time.time(), "rank": None, "msg": "the allreduce completed"}
        except asynccoll.PeerLostError as exc:
            got = {"t": time.time(), "rank": exc.rank, "msg": str(exc)}
        with open(f"{out}/rank-{comm.rank}.json", "w") as f:
            json.dump(got, f)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_during_segment_setup_is_reported_and_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    token, port = secrets.randbits(62), free_port()
    procs = []
    try:
        for r in range(4):
            env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(r),
                   "ASYNCCOLL_WORLD_SIZE": "4", "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
                   "ASYNCCOLL_TRANSPORT": "tcp", "ASYNCCOLL_SECRET": SECRET}
            procs.append(subprocess.Popen([sys.executable, str(script), str(token),
                                           str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        for r, p in enumerate(procs):
            out, _ = p.communicate(timeout=60)
            if r != 2:
                assert p.returncode == 0, out
        assert procs[2].returncode == -signal.SIGKILL
        killed = float((tmp_path / "killed").read_text())
        for r in (0, 1, 3):
            got = json.loads((tmp_path / f"rank-{r}.json").read_text())
            assert got["rank"] == 2, (r, got)
            assert got["t"] - killed < 2.0, (r, got["t"] - killed)
        # The killed rank's own segment was created but not yet mapped by every peer, so
        # its owner never unlinked it: the survivors do, knowing its name.
        assert not _left(token), "left in /dev/shm after a SIGKILL during setup"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for name in _left(token):  # do not leave the machine dirtier than the test found it
            os.unlink(os.path.join(SHM_DIR, name))


# -- a rank SIGKILLed mid-way through pushing its block into its peers' shared arrays ---------

PUSH_RANK = SHM_VICTIM_PREAMBLE + """

from asynccoll.collectives import shm as builders

if VICTIM:
    push = builders.SHM_INPLACE_OWN_KERNELS[builders.SHM_PUSH]

    def push_half_then_die(out_, inputs, params, msgs):
        half = out_.size // 2  # half the block reduced and written into the peers' arrays
        push(out_[:half], [x[:half] for x in inputs], params, msgs)
        die()

    builders.SHM_INPLACE_OWN_KERNELS[builders.SHM_PUSH] = push_half_then_die


async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=30)
    async with comm:
        x = await comm.empty(4 << 20, np.float32)
        got = {"rank": None, "msg": "every allreduce completed"}
        try:
            for step in range(3):
                x[...] = comm.rank + step
                await comm.allreduce(x, out=x)
                assert x[0] == sum(range(comm.size)) + comm.size * step
        except asynccoll.PeerLostError as exc:
            got = {"rank": exc.rank, "msg": str(exc)}
        got["t"] = time.time()
        with open(f"{out}/rank-{comm.rank}.json", "w") as f:
            json.dump(got, f)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_while_pushing_into_shared_arrays_is_reported_and_leaves_nothing(
        tmp_path: Path) -> None:
    # Rank 2 dies half-way through writing its reduced block into its peers' arrays (from
    # comm.empty, 16 MiB, the in-place two-shot): the survivors, waiting for its "reduced"
    # message or still pushing their own blocks, learn of it within 2 s, and the segments
    # (unlinked once mapped) leave nothing behind.
    token = secrets.randbits(62)
    try:
        got = run_killed_job(tmp_path, PUSH_RANK, 4, [str(token), str(tmp_path), "push"],
                             kill="2", timeout=60)
        killed = float((tmp_path / "killed").read_text())
        for r, g in got.items():
            assert g["rank"] == 2, (r, g)
            assert g["t"] - killed < 2.0, (r, g["t"] - killed)
        assert not shm_left(token), "left in /dev/shm after a SIGKILL mid-call"
    finally:
        for name in shm_left(token):
            os.unlink(os.path.join(SHM_DIR, name))


# -- two jobs on one host at once --------------------------------------------------------------

async def _job_main(rank: int, P: int, ports: list[int], tokens: list[int],
                    algorithm: str | None) -> bool:
    """Rank ``rank`` of 2 * 2 processes: rank ``rank % 2`` of job ``rank // 2``."""
    job, me = divmod(rank, 2)
    _fix_token(tokens[job])
    comm = await asynccoll.connect(rank=me, world_size=2, store=f"127.0.0.1:{ports[job]}",
                                   transport="tcp", timeout=60, collective_timeout=30)
    ok = True
    async with comm:
        n = SHM_MIN_BYTES // 4 * 4  # 1 MiB of float32: the default takes shared memory
        for step in range(8):
            x = np.full(n, 1000 * job + 10 * step + me, np.float32)
            want = np.full(n, 2 * (1000 * job + 10 * step) + 1, np.float32)
            got = await comm.allreduce(x, algorithm=algorithm)
            ok &= bool(np.array_equal(got, want))
        await comm.barrier()
    return ok


@pytest.mark.timeout(120)
def test_two_jobs_at_once_do_not_interfere() -> None:
    # Two jobs of 2 processes each, running the same collectives at the same time, so they use
    # the same schedule ids; each through shared memory (asked for by name: it raises if it
    # cannot), each getting its own sums.
    tokens = [secrets.randbits(62)]
    tokens.append(tokens[0] ^ 1)
    ports = [free_port(), free_port()]
    try:
        out = spawn_world(async_child, 4, (_job_main, ports, tokens, "shm"), 90)
        assert out == [True] * 4
        assert [_left(t) for t in tokens] == [[], []]
    finally:
        for t in tokens:
            for name in _left(t):
                os.unlink(os.path.join(SHM_DIR, name))


# -- a segment name already taken, by another user -------------------------------------------

async def _squatted_main(rank: int, P: int, port: int, token: int) -> dict[str, bool]:
    import logging

    _fix_token(token)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("asynccoll.comm").addHandler(Keep(logging.WARNING))
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60, collective_timeout=30)
    seen: dict[str, bool] = {}
    async with comm:
        n = SHM_MIN_BYTES // 4 * 4
        x = np.full(n, rank + 1, np.float32)
        try:
            await comm.allreduce(x, algorithm="shm")
            seen["shm refused"] = False
        except asynccoll.ExecutionError as exc:
            seen["shm refused"] = "shared memory" in str(exc)
        want = np.full(n, 3, np.float32)
        seen["sums right"] = all([bool(np.array_equal(await comm.allreduce(x), want))
                                  for _ in range(3)])
        seen["fell back, saying so"] = any("shared memory" in w for w in warnings)
        await comm.barrier()
    return seen


@pytest.mark.timeout(120)
def test_a_segment_name_taken_by_another_user_is_refused() -> None:
    # Files planted under every name rank 1 of the job could give its segments (the first 64
    # schedule ids), of the right size, owned by another user (when the test runs as root) and
    # readable by all: rank 1 cannot create its segments (O_EXCL), rank 0 refuses to map the
    # planted ones (owner, mode), so every rank gives shared memory up together: asked for by
    # name it raises, by default the allreduce takes the network; nothing planted is read.
    token, port = secrets.randbits(62), free_port()
    n = SHM_MIN_BYTES // 4 * 4 * 4
    planted = [segment_path(token, sid, 1) for sid in range(1, 65)]
    try:
        for path in planted:
            with open(path, "wb") as f:
                f.truncate(n)  # sparse: the right size, no memory taken
            os.chmod(path, 0o644)
            if os.geteuid() == 0:
                os.chown(path, 65534, 65534)
        out = spawn_world(async_child, 2, (_squatted_main, port, token), 90)
        want = {"shm refused": True, "sums right": True, "fell back, saying so": True}
        assert out == [want, want]
        assert _left(token) == sorted(os.path.basename(p) for p in planted)
    finally:
        for path in planted:
            if os.path.exists(path):
                os.unlink(path)
        for name in _left(token):
            os.unlink(os.path.join(SHM_DIR, name))
