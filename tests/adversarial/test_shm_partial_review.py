"""An adversarial review of the partial collectives through shared memory (asynccoll.comm.shm,
``PartialSegments``): what a user or a failure could do to them, in real processes over tcp.

Each job runs one scenario of the rank script below (P processes started without the
launcher), with the job's segment token fixed so that the check for leftovers in /dev/shm
looks at this job's files only. Bugs this review found, fixed (each has its test here):

* ``shm=`` took any value: ``shm="no"`` went through shared memory, ``shm=0`` meant
  "automatic" (``ValueError`` naming ``shm`` now, in ``DenseOps.partial_plan``);
* ``shm=True`` with a network ``algorithm`` (even a misspelt one) dropped it in silence
  (``ValueError`` naming both now);
* a process that ended without closing its communicator (no ``async with``) left its
  segments in /dev/shm for good when fewer than two executions had run (they are unlinked
  at interpreter exit now, ``PartialSegments``' finalizer).
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _helpers import SECRET, free_port

from asynccoll.comm.shm import SHM_DIR, job_prefix, job_tag

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess]

RANK = r'''
import asyncio, json, os, signal, sys, time, numpy as np, asynccoll
from asynccoll.comm import dense, partial, shm

out, token, scen = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dense.new_token = lambda: token
R = int(os.environ["ASYNCCOLL_RANK"])
P = int(os.environ["ASYNCCOLL_WORLD_SIZE"])
VICTIM = R == P - 1


def left():
    prefix = shm.job_prefix(shm.job_tag(token))
    return sorted(f for f in os.listdir(shm.SHM_DIR) if f.startswith(prefix))


def report(res):
    with open(f"{out}/rank-{R}.json", "w") as f:
        json.dump(res, f)


def die():
    with open(f"{out}/killed", "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


if scen == "kill_between" and VICTIM:
    # dies right after completing execution 0, before execution 1: nobody has unlinked yet
    nxt = partial.PartialAllreduce._shm_next

    def next_then_die(self, e):
        nxt(self, e)
        if self.name == "A" and e == 0:
            die()

    partial.PartialAllreduce._shm_next = next_then_die


async def badarg(comm, res):
    x = np.zeros(1 << 16, np.float32)
    for i, kw in enumerate([{"shm": "yes"}, {"shm": "no"}, {"shm": 1}, {"shm": 0},
                            {"shm": True, "algorithm": "ring"},
                            {"shm": True, "algorithm": "bogus"}]):
        try:
            comm.partial_allreduce("solo", like=x, name=f"bad{i}", path=asynccoll.DataPath(**kw))
            res[str(i)] = ["created"]
        except Exception as e:
            res[str(i)] = [type(e).__name__, str(e)]
    sv = asynccoll.SparseVector(np.array([0]), np.array([1.0], np.float32), 8)
    try:
        # shared memory asked for with the network-only algorithm: refused, the name free
        comm.partial_allreduce("solo", like=sv, name="sparse", path=asynccoll.DataPath(
            shm=True, algorithm="ssar_recursive_double"))
        res["sparse"] = ["created"]
    except Exception as e:
        res["sparse"] = [type(e).__name__, str(e)]
    # the communicator still works, the refused names are free, the automatic names unshifted
    h = comm.partial_allreduce("solo", like=x, name="bad0", accumulate="sum",
                               path=asynccoll.DataPath(shm=np.bool_(True)))
    g = comm.partial_allreduce("solo", like=x, accumulate="sum")
    res["through"] = [h._segments is not None, g._segments is not None]
    tot = (await h(np.full_like(x, R + 1))).value + (await h.flush()).value
    tot2 = (await g(np.full_like(x, R + 1))).value + (await g.flush()).value
    res["sums"] = [float(tot.min()), float(tot.max()), float(tot2.min()), float(tot2.max())]


async def many(comm, res):
    # handles of every kind, size and dtype at once, created in different orders on different
    # ranks (explicit names), the last rank late; called all at once on rank 0, one after the
    # other (reversed) elsewhere; one handle nobody calls but everyone flushes
    specs = {"a": ("solo", np.float32, (40000,)), "b": ("majority", np.float64, (200, 300)),
             "c": ("two_choice", np.int32, (1 << 16,)), "d": ("quorum", np.float32, (1 << 19,)),
             "e": ("deadline", np.float64, (20000,)), "f": ("solo", np.int64, (5,)),
             "g": ("quorum", np.int16, (3, 70000))}
    names = sorted(specs) if R % 2 == 0 else sorted(specs)[::-1]
    if VICTIM:
        await asyncio.sleep(0.3)
    hs = {}
    for n in names:
        k, dt, shp = specs[n]
        policy = {"quorum": asynccoll.Quorum(max(1, P // 2)),
                  "deadline": asynccoll.Deadline(quorum=max(1, P // 2), bounds=0.05)}.get(k, k)
        hs[n] = comm.partial_allreduce(policy, like=np.zeros(shp, dt), accumulate="sum",
                                       name=n, path=asynccoll.DataPath(shm=True))
    idle = comm.partial_allreduce("solo", like=np.zeros(1 << 16, np.float32),
                                  accumulate="sum", name="idle",
                                  path=asynccoll.DataPath(shm=True))
    res["through"] = all(h._segments is not None for h in (*hs.values(), idle))
    tot = {n: np.zeros(specs[n][2], np.float64) for n in specs}
    order = sorted(specs)
    for t in range(4):
        xs = {n: np.full(specs[n][2], R + 1, specs[n][1]) for n in order}
        if R == 0:
            rs = await asyncio.gather(*(hs[n](xs[n]) for n in order))
        else:
            rs = [await hs[n](xs[n]) for n in order[::-1]][::-1]
        for n, r in zip(order, rs):
            tot[n] += r.value
    for n in order:
        tot[n] += (await hs[n].flush()).value
    fi = await idle.flush()
    res["idle"] = [float(fi.value.max()), fi.count]
    res["tot"] = {n: [float(v.min()), float(v.max())] for n, v in tot.items()}
    # calls resume after a flush (the two segment sets go on alternating)
    s = np.zeros(40000, np.float64)
    for t in range(3):
        s += (await hs["a"](np.full(40000, t + 1, np.float32))).value
    s += (await hs["a"].flush()).value
    res["resume"] = [float(s.min()), float(s.max())]
    await comm.barrier()
    # the idle handle may have run a single execution (the flush's): its files stay till close
    mine = {os.path.basename(idle._segments.path(q, p)) for q in range(P) for p in (0, 1)}
    res["left_mid"] = [f for f in left() if f not in mine]
    res["executions"] = {n: h.completed for n, h in hs.items()}


async def sizes(comm, res):
    from asynccoll.collectives.partial import meta_len, packs_meta
    from asynccoll.collectives.shm import SHM_ONE_SHOT_READ

    assert P == 2
    m = meta_len(P) if packs_meta(np.dtype(np.float32), "sum", P) else 0
    edge = SHM_ONE_SHOT_READ // (4 * P) - m  # float32 elements where two-shot starts
    cases = [(np.float32, (32767,), None), (np.float32, (32768,), None),
             (np.int32, (128, 256), None), (np.float64, (16384,), None),
             (np.float32, (edge - 1,), None), (np.float32, (edge,), None),
             (np.float32, (edge - 1,), False), (np.uint8, (1 << 17,), True)]
    got = []
    for i, (dt, shp, flag) in enumerate(cases):
        h = comm.partial_allreduce("solo", like=np.zeros(shp, dt), accumulate="sum",
                                   name=f"s{i}", path=asynccoll.DataPath(shm=flag))
        acc = np.zeros(shp, np.int64)
        for t in range(3):
            acc += (await h(np.full(shp, R + t, dt))).value.astype(np.int64)
        acc += (await h.flush()).value.astype(np.int64)
        got.append([h._ex.schedule.meta["partial"].get("shm"), int(acc.min()), int(acc.max())])
        await h.close()
    res["cases"] = got


async def env_off(comm, res):
    # ASYNCCOLL_SHM=0: nothing automatic, shm=True still goes through shared memory
    x = np.zeros(1 << 17, np.float32)
    a = comm.partial_allreduce("solo", like=x, accumulate="sum", name="auto")
    b = comm.partial_allreduce("solo", like=x, accumulate="sum", name="asked",
                               path=asynccoll.DataPath(shm=True))
    res["through"] = [a._segments is not None, b._segments is not None]
    s = 0.0
    for h in (a, b):
        s += float((await h(x + R + 1)).value[7]) + float((await h.flush()).value[7])
    res["sum"] = s


async def group(comm, res):
    sub = await comm.split(R % 2)
    h = sub.partial_allreduce("majority", like=np.zeros((256, 300), np.float64),
                              accumulate="sum", name="same-name")
    k = comm.partial_allreduce("solo", like=np.zeros(1 << 16, np.float32), accumulate="sum",
                               name="same-name")
    res["through"] = [h._segments is not None, k._segments is not None]
    tot = 0.0
    for t in range(4):
        tot += float((await h(np.full((256, 300), R, np.float64))).value[-1, -1])
        tot += 1000 * float((await k(np.full(1 << 16, R, np.float32))).value[-1])
    tot += float((await h.flush()).value[-1, -1]) + 1000 * float((await k.flush()).value[-1])
    res["tot"] = tot
    await sub.close()


async def close_one(comm, res):
    x = np.zeros(1 << 16, np.float32)
    h = comm.partial_allreduce("solo", like=x, accumulate="sum", name="c",
                               path=asynccoll.DataPath(shm=True))
    await h(x)
    await h.flush()
    await comm.barrier()
    if VICTIM:
        await h.close()
        res["left_closed"] = [f for f in left() if f.endswith((f"-{R}.0", f"-{R}.1"))]
    else:
        try:
            await h(x + 1, timeout=1.0)
            await h(x + 1, timeout=1.0)
            res["call"] = "completed"
        except asynccoll.CollectiveTimeoutError:
            res["call"] = "CollectiveTimeoutError"
    await comm.barrier()
    g = comm.partial_allreduce("solo", like=x, accumulate="sum", name="d",
                               path=asynccoll.DataPath(shm=True))
    res["after"] = float((await g(x + 1)).value[0]) + float((await g.flush()).value[0])
    await comm.barrier()


async def kill(comm, res):
    # the victim holds two handles: A (the one called) and B (never called by anyone)
    x = np.ones(1 << 16, np.float32)
    a = comm.partial_allreduce("solo", like=x, name="A", path=asynccoll.DataPath(shm=True))
    comm.partial_allreduce("solo", like=x, name="B", path=asynccoll.DataPath(shm=True))
    await comm.barrier()
    if VICTIM and scen == "kill_before_first":
        die()
    if VICTIM and scen == "kill_stopped":
        with open(f"{out}/pid", "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    if scen != "kill_between":
        await asyncio.sleep(0.2)
    try:
        for i in range(20):
            await a(x, timeout=1.0)
        res["a"] = ["completed"]
    except asynccoll.PeerLostError as e:
        res["a"] = ["PeerLostError", e.rank]
    except asynccoll.CollectiveTimeoutError:
        res["a"] = ["CollectiveTimeoutError"]
        if R == 0:  # the stopped rank is killed now (as a job scheduler would)
            os.kill(int(open(f"{out}/pid").read()), signal.SIGKILL)
            with open(f"{out}/killed", "w") as f:
                f.write(repr(time.time()))
        await asyncio.sleep(0.5)
    res["t"] = time.time()


async def main():
    if scen == "no_close":
        # no ``async with``, no close: the process just ends (one execution at most)
        comm = await asynccoll.connect(timeout=60, collective_timeout=20)
        x = np.ones(1 << 16, np.float32)
        a = comm.partial_allreduce("solo", like=x, name="A", path=asynccoll.DataPath(shm=True))
        comm.partial_allreduce("solo", like=x, name="B", path=asynccoll.DataPath(shm=True))
        if R == 0:
            await a(x)
        # a rank that leaves the barrier first and ends closes at exit, serving this one
        # until it is out too (it was a lost rank here, about one run in five under load)
        await comm.barrier()
        report({"left": left()})
        return
    comm = await asynccoll.connect(timeout=60, collective_timeout=20)
    res = {}
    async with comm:
        fn = scen if scen in globals() else "kill"
        await globals()[fn](comm, res)
    res["left_after"] = left()
    report(res)


asyncio.run(main())
'''


def _left(token: int) -> list[str]:
    prefix = job_prefix(job_tag(token))
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix))


def _start(tmp: Path, P: int, scen: str, token: int, env: dict[str, str] | None = None
           ) -> list[subprocess.Popen[bytes]]:
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "rank.py"
    script.write_text(RANK)
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, str(script), str(tmp), str(token), scen],
        env={**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(r),
             "ASYNCCOLL_WORLD_SIZE": str(P), "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
             "ASYNCCOLL_TRANSPORT": "tcp", "ASYNCCOLL_SECRET": SECRET, **(env or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(P)]


def _finish(procs: list[subprocess.Popen[bytes]], tmp: Path, dead: tuple[int, ...] = (),
            timeout: float = 45.0, any_rc: bool = False) -> dict[int, Any]:
    try:
        errs = [p.communicate(timeout=timeout)[1].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = {}
    for r, p in enumerate(procs):
        if r in dead:
            continue
        if not any_rc:
            assert p.returncode == 0, f"rank {r} (rc {p.returncode}):\n{errs[r][-3000:]}"
        out[r] = json.loads((tmp / f"rank-{r}.json").read_text())
    return out


def _job(tmp: Path, P: int, scen: str, *, dead: tuple[int, ...] = (),
         env: dict[str, str] | None = None, any_rc: bool = False) -> tuple[dict[int, Any], int]:
    token = secrets.randbits(62)
    try:
        got = _finish(_start(tmp, P, scen, token, env), tmp, dead, any_rc=any_rc)
        assert _left(token) == [], "left in /dev/shm"
        return got, token
    finally:
        for name in _left(token):
            os.unlink(os.path.join(SHM_DIR, name))


@pytest.mark.timeout(60)
def test_bad_shm_arguments_are_refused_and_the_communicator_works(tmp_path: Path) -> None:
    got, _ = _job(tmp_path, 2, "badarg")
    for o in got.values():
        for i in map(str, range(4)):  # "yes", "no", 1, 0: a bool or None only
            assert o[i][0] == "ValueError", o[i]
            assert "shm must be True, False or None" in o[i][1], o[i]
        for i in ("4", "5"):  # shm=True with a network algorithm: not dropped in silence
            assert o[i][0] == "ValueError", o[i]
            assert "shm=True" in o[i][1], o[i]
            assert "algorithm" in o[i][1], o[i]
        assert o["sparse"][0] == "ValueError", o["sparse"]
        assert "shm" in o["sparse"][1], o["sparse"]
        assert o["through"] == [True, True]  # 256 KiB: shared memory by default too
        assert o["sums"] == [3.0, 3.0, 3.0, 3.0]


@pytest.mark.timeout(60)
def test_many_handles_in_any_order_interleaved_idle_and_resumed(tmp_path: Path) -> None:
    P = 3
    got, _ = _job(tmp_path, P, "many")
    calls = 4 * sum(r + 1 for r in range(P))
    for r, o in got.items():
        assert o["through"], o
        for n, (lo, hi) in o["tot"].items():
            assert lo == hi == calls, (r, n, lo, hi)  # every contribution exactly once
        assert o["idle"] == [0.0, 0], o["idle"]
        assert o["resume"] == [P * 6.0, P * 6.0]
        # every handle ran two executions or more: nothing of theirs left while still open
        assert all(e >= 1 for e in o["executions"].values()), o["executions"]
        assert o["left_mid"] == [], o["left_mid"]


@pytest.mark.timeout(60)
def test_sizes_dtypes_and_the_thresholds(tmp_path: Path) -> None:
    got, _ = _job(tmp_path, 2, "sizes")
    want = sum(r + t for r in range(2) for t in range(3))  # 9
    assert got[0]["cases"] == got[1]["cases"]
    algos = [c[0] for c in got[0]["cases"]]
    # 128 KiB - 4 bytes: the network's; from 128 KiB: shared memory; one-shot below
    # P x size = 16 MiB, two-shot from it; shm=False refuses; uint8 asked for
    assert algos == [None, "one_shot", "one_shot", "one_shot", "one_shot", "two_shot", None,
                     "one_shot"], algos
    assert all(c[1:] == [want, want] for c in got[0]["cases"]), got[0]["cases"]


@pytest.mark.timeout(60)
def test_asynccoll_shm_0_and_one_rank(tmp_path: Path) -> None:
    got, _ = _job(tmp_path / "off", 2, "env_off", env={"ASYNCCOLL_SHM": "0"})
    for o in got.values():
        assert o["through"] == [False, True]
        assert o["sum"] == 2 * 3.0
    got, _ = _job(tmp_path / "one", 1, "env_off")
    assert got[0]["through"] == [False, True]  # P = 1: asked only
    assert got[0]["sum"] == 2.0


@pytest.mark.timeout(60)
def test_groups_and_the_parent_use_one_name_apart(tmp_path: Path) -> None:
    got, _ = _job(tmp_path, 4, "group")
    for r, o in got.items():
        assert o["through"] == [True, True]
        # the group of r % 2 sums ranks r % 2 and r % 2 + 2; the parent sums 0 + 1 + 2 + 3
        assert o["tot"] == 4 * (2 * (r % 2) + 2) + 1000 * 4 * 6, (r, o["tot"])


@pytest.mark.timeout(60)
def test_a_handle_closed_on_one_rank(tmp_path: Path) -> None:
    got, _ = _job(tmp_path, 3, "close_one")
    assert got[2]["left_closed"] == []  # its own segments go at once
    for r in (0, 1):
        # the others wait for it (close is local) but are not hurt
        assert got[r]["call"] in ("CollectiveTimeoutError", "completed")
    assert all(o["after"] == 3.0 for o in got.values())


@pytest.mark.timeout(60)
def test_two_jobs_at_once_with_the_same_handle_names(tmp_path: Path) -> None:
    tokens = [secrets.randbits(62), secrets.randbits(62)]
    try:
        jobs = [_start(tmp_path / f"job{j}", 2, "group" if j else "many", tokens[j])
                for j in range(2)]
        many = _finish(jobs[0], tmp_path / "job0")
        grp = _finish(jobs[1], tmp_path / "job1")
        assert all(o["through"] for o in many.values())
        assert many[0]["tot"] == {n: [12.0, 12.0] for n in "abcdefg"}
        # 2 ranks: each is its own group (no segments), the parent through shared memory
        assert [o["through"] for o in grp.values()] == [[False, True], [False, True]]
        assert [o["tot"] for o in grp.values()] == [4 * 0 + 1000 * 4 * 1, 4 * 1 + 1000 * 4]
        assert _left(tokens[0]) == _left(tokens[1]) == []
    finally:
        for t in tokens:
            for name in _left(t):
                os.unlink(os.path.join(SHM_DIR, name))


@pytest.mark.timeout(60)
def test_ending_without_closing_leaves_nothing(tmp_path: Path) -> None:
    # Fixed: a handle's segments stay linked until its second execution; a process that ended
    # without closing its communicator left them in /dev/shm for good. (Its exit also crashed
    # with SIGSEGV, shared memory or not, until the progress thread was stopped at exit:
    # tests/adversarial/test_exit_without_close.py.)
    _job(tmp_path, 3, "no_close")


@pytest.mark.alone
@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["kill_before_first", "kill_between", "kill_stopped"])
def test_a_rank_killed_or_stopped(tmp_path: Path, when: str) -> None:
    P = 3
    got, _ = _job(tmp_path, P, when, dead=(P - 1,))
    killed = float((tmp_path / "killed").read_text())
    for r, o in got.items():
        if when == "kill_stopped":
            # a stopped rank is not a lost one: the calls time out; once it is killed, the
            # survivors' close unlinks its segments (it never could)
            assert o["a"] == ["CollectiveTimeoutError"], (r, o)
        else:
            assert o["a"] == ["PeerLostError", P - 1], (r, o)
            assert o["t"] - killed < 2.0, (r, o["t"] - killed)

