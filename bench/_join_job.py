"""The rank programs of ``bench/join.py``, run under ``asynccoll run -n P --max-restarts N``:

    python bench/_join_job.py transfer|restart|churn OUT_DIR CONFIG_JSON

Every process (first start or restart, ``ASYNCCOLL_RESTART=k``) writes
``OUT_DIR/rank-R-K.json`` when it ends, and ``OUT_DIR/status-R`` (``PID STATE``: ``joining``,
``training``, ``finishing``) as it goes, and a churn process that joined
``OUT_DIR/joined-R-K.json`` at once, which the parent reads to pick a victim and to stop
what it started. Times are ``time.monotonic()``: on Linux one clock for every process of the
host, so the parent compares them across ranks.

* ``transfer``: :func:`asynccoll.comm.joining.admit` / :func:`~asynccoll.comm.joining.join`
  called directly, a tiny solo handle and a separate state of ``bytes`` (two uint32 arrays, as
  parameters and momentum); the rank ``victim`` SIGKILLs itself at iteration ``kill_at``, the
  members flush and sum the ready flags every iteration (a flush boundary each time), and the
  first iteration that finds the restarted rank ready on every member admits it. ``check``
  (the digest comparison both sides end with) is wrapped to time it apart from the transfer.
* ``restart``: :class:`asynccoll.EagerSGD` (solo, momentum 0.5, parameters of ``bytes / 2``,
  so the state moved is ``bytes``) with ``step_s`` of simulated compute per step; the victim
  SIGKILLs itself at global step ``kill_at``; every step's start and end is recorded, with the
  world size after it, and a member's ``admit_sent`` (wrapped: its start and end), and the
  parts of the sync events and of the join (``spans``: :func:`_phases`); ``sync_every``
  gives sync events without a join to compare with. With ``world`` (``bench/join.py --parts
  grow``) nobody is killed: the job starts with ``world - 1`` ranks and trains until a rank
  added to it (``asynccoll run --nnodes``) has been taken in.
* ``churn``: the hyperplane task of ``bench/hyperplane.py`` (the demo's data and straggler
  draw: ``asynccoll.demo``) under EagerSGD solo with ``accumulate=True``, until global step
  ``steps``; the parent kills ranks from outside, until some rank is within ``quiet_steps``
  of the end (status ``finishing``): a rank killed as the others finish has nobody to join.
"""

import time

T_START = time.monotonic()  # before the imports: a restart's time to connect includes them

import asyncio  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import asynccoll  # noqa: E402
from asynccoll import EagerSGD, Solo  # noqa: E402
from asynccoll.comm import joining  # noqa: E402

RESTART = int(os.environ.get("ASYNCCOLL_RESTART") or 0)
OUT = Path(sys.argv[2])


def status(rank: int, state: str) -> None:
    """Tell the parent what this process is doing (atomically: write, then rename)."""
    tmp = OUT / f".status-{rank}-{os.getpid()}"
    tmp.write_text(f"{os.getpid()} {state}")
    os.replace(tmp, OUT / f"status-{rank}")


def report(rank: int, doc: dict[str, Any]) -> None:
    doc.update(rank=rank, restart=RESTART, pid=os.getpid(), t_start=T_START,
               maxrss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    (OUT / f"rank-{rank}-{RESTART}.json").write_text(json.dumps(doc))


def cpu_s() -> float:
    """CPU seconds this process used so far (every thread, user and system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def connect(cfg: dict[str, Any]) -> tuple[asynccoll.Communicator, dict[str, float]]:
    rank = int(os.environ["ASYNCCOLL_RANK"])
    status(rank, "joining" if RESTART else "starting")
    t0 = time.monotonic()
    comm = await asynccoll.connect(collective_timeout=cfg["timeout"])
    return comm, {"t_connect0": t0, "t_connect1": time.monotonic()}


# -- transfer ----------------------------------------------------------------------------------
class Sampler:
    """Where this process's threads are while it transfers (``"sample": true`` in the
    transfer's config): every 2 ms the innermost three Python frames of every thread other
    than this one's, counted; a frame in C code (a copy, a hash, a system call) is counted at
    the Python line that called it. No profiler hooks, so what it measures runs at full
    speed."""

    def __init__(self) -> None:
        import threading
        from collections import Counter

        self.counts: Counter[str] = Counter()
        self.n = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        while not self._stop.wait(0.002):
            self.n += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                where, f = [], frame
                while f is not None and len(where) < 3:
                    where.append(f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"
                                 f"({f.f_code.co_name})")
                    f = f.f_back
                self.counts[f"{names.get(ident, '?')[:14]} " + " < ".join(where)] += 1

    def stop(self) -> list[tuple[str, float]]:
        """The 25 most frequent stacks, with the share of samples they were seen in."""
        self._stop.set()
        self._thread.join()
        return [(k, round(v / max(1, self.n), 3)) for k, v in self.counts.most_common(25)]


def _timed(name: str, times: dict[str, float], key: str) -> None:
    """Wrap ``joining.NAME`` (``compare``: what ``admit`` and ``join`` end with once the stripes
    are through; ``admit``: what a training class's member calls at the join) so that its
    start and end are recorded as ``KEY0`` / ``KEY1``. ``admit`` and ``join`` look ``compare``
    up in their module, the training classes ``admit``: the wrapper is what they call."""
    fn = getattr(joining, name)

    async def timed(*args: Any, **kw: Any) -> Any:
        times[f"{key}0"] = time.monotonic()
        out = await fn(*args, **kw)
        times[f"{key}1"] = time.monotonic()
        return out

    setattr(joining, name, timed)


async def transfer(cfg: dict[str, Any]) -> None:
    if "ring_min" in cfg:  # the shared-memory path measured at every size (bench/join.py)
        os.environ["ASYNCCOLL_JOIN_RING_MIN"] = str(cfg["ring_min"])  # read by connect()
    comm, times = await connect(cfg)
    _timed("compare", times, "t_check")
    rank = comm.rank
    x = np.ones(16, np.float32)
    h = comm.partial_allreduce(Solo(), like=x, name="join-bench")
    n = cfg["bytes"] // 8
    t = time.monotonic()
    if RESTART:  # a restarted process has built its model: its arrays' pages are touched
        state = [np.full(n, 0, np.uint32), np.full(n, 0, np.uint32)]
    else:
        state = [np.arange(n, dtype=np.uint32), np.arange(n, 0, -1, dtype=np.uint32)]
    times["fill_s"] = time.monotonic() - t
    if RESTART:
        status(rank, "joining")
        sampler = Sampler() if cfg.get("sample") else None
        times["t_join0"], c0 = time.monotonic(), cpu_s()
        grown, first, _ = await joining.join(comm, h.name, state, cfg["timeout"])
        times["t_join1"], times["cpu_s"] = time.monotonic(), cpu_s() - c0
        if sampler is not None:
            times["profile"] = sampler.stop()
        members = list(grown.members)
        ranks = [members.index(m) if m in members else -1 for m in range(comm.size)]
        await comm.on_runtime(lambda: h.grow(grown, first, ranks))
    else:
        status(rank, "training")
        joiners = joining.Joiners(comm.job, h.name)
        now: asynccoll.Communicator = comm
        deadline = time.monotonic() + cfg["max_s"]
        for it in range(1_000_000):
            if rank == cfg["victim"] and it == cfg["kill_at"]:
                # die while the others wait in the handle's flush (a loss it survives), not
                # in the flags' synchronous allreduce, which would raise
                await asyncio.sleep(0.5)
                die()
            await h(x)
            await asyncio.sleep(cfg["step_s"])
            if (await h.flush()).lost and now is comm:
                now = await comm.shrink()
            tot = await now.allreduce(joiners.flags(now.members))
            admitted = joiners.agreed(tot, now.members)
            if admitted:
                sampler = Sampler() if cfg.get("sample") and rank == 0 else None
                times["t_admit0"], c0 = time.monotonic(), cpu_s()
                await joining.admit(h, now, admitted, state)
                times["t_admit1"], times["cpu_s"] = time.monotonic(), cpu_s() - c0
                if sampler is not None:
                    times["profile"] = sampler.stop()
                times["admitted"] = admitted
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: nobody joined within {cfg['max_s']} s")
    for _ in range(2):  # the grown handle works: two calls and a flush over every rank
        await h(x)
    res = await h.flush()
    times["world_size_after"] = res.world_size
    times["digest"] = joining.digest(state)
    status(rank, "finishing")
    report(rank, times)
    await comm.close()


# -- restart -----------------------------------------------------------------------------------
def _spans(spans: list[tuple[str, float, float]], owner: Any, attr: str, name: str) -> None:
    """Wrap ``owner.attr`` (a class's or a module's function, async or not) so that every
    call appends ``(name, start, end)`` to ``spans``: the parts of a sync event and of a join
    (``bench/join.py`` sums them per step)."""
    fn = getattr(owner, attr)
    if asyncio.iscoroutinefunction(fn):
        async def wrapped(*args: Any, **kw: Any) -> Any:
            t0 = time.monotonic()
            try:
                return await fn(*args, **kw)
            finally:
                spans.append((name, t0, time.monotonic()))
    else:
        def wrapped(*args: Any, **kw: Any) -> Any:  # type: ignore[misc]
            t0 = time.monotonic()
            try:
                return fn(*args, **kw)
            finally:
                spans.append((name, t0, time.monotonic()))
    setattr(owner, attr, wrapped)


def _phases(spans: list[tuple[str, float, float]]) -> None:
    """The sync event's and the join's parts, timed (:func:`_spans`): the handle's flush,
    the communicators' allreduce / broadcast / allgather, and inside ``admit``: the grown
    communicator made, the handle grown, this member's digest, a stripe sent to a joiner
    (``give``: from the joiner's ``GO`` on), the digests compared (``check``)."""
    from asynccoll.comm.communicator import Communicator
    from asynccoll.comm.partial import PartialAllreduce
    from asynccoll.comm.partial_member import MemberSide

    _spans(spans, PartialAllreduce, "flush", "flush")
    for op in ("allreduce", "broadcast", "allgather"):
        _spans(spans, Communicator, op, op)
    _spans(spans, Communicator, "rejoined_group", "make_comm")
    _spans(spans, MemberSide, "grow", "grow")
    for fn, name in (("admit_sent", "admit"), ("digest", "digest"), ("give", "give"),
                     ("compare", "check")):
        _spans(spans, joining, fn, name)
    _spans(spans, joining.DigestCheck, "settle", "settle")


async def restart(cfg: dict[str, Any]) -> None:
    comm, times = await connect(cfg)
    # which step holds the join (loss and join may share one): EagerSGD calls admit_sent
    _timed("admit_sent", times, "t_admit")
    spans: list[tuple[str, float, float]] = []
    _phases(spans)
    # the world to train at: the job's (a rank added to it by growth: ``world``)
    rank, P = comm.rank, cfg.get("world") or comm.size
    n = cfg["bytes"] // 8
    opt = EagerSGD(comm, np.zeros(n, np.float32), 0.1, Solo(), momentum=0.5,
                   sync_every=cfg.get("sync_every"), name="join-bench", timeout=cfg["timeout"])
    g = np.empty(n, np.float32)
    target = np.float32(rank + 1)
    steps: list[list[float]] = []  # [start, end, world size after, joined, synced, included]
    status(rank, "joining" if comm.joined else "training")
    lost_seen = comm.joined or comm.size < P
    after = -1  # steps since the world was whole again (-1: not yet)
    deadline = time.monotonic() + cfg["max_s"]
    while opt.step_count < cfg["steps"] or after < cfg["after"]:
        if rank == cfg["victim"] and not RESTART and opt.step_count == cfg["kill_at"]:
            die()
        t0 = time.monotonic()
        await asyncio.sleep(cfg["step_s"])  # the accelerator's time
        np.subtract(opt.params, target, out=g)
        g *= 0.5
        info = await opt.step(g)
        ws = opt.world_size
        steps.append([t0, time.monotonic(), ws, info.joined, info.synced, info.included])
        lost_seen = lost_seen or ws < P
        if after >= 0:
            after += 1
        elif lost_seen and ws == P:
            after = 0
            status(rank, "training")
        if time.monotonic() > deadline:
            break
    status(rank, "finishing")
    await opt.finish()
    times.update(steps=steps, step_count=opt.step_count, spans=spans,
                 digest=hashlib.sha256(opt.params.tobytes()).hexdigest()[:16])
    report(rank, times)
    await comm.close()


# -- churn -------------------------------------------------------------------------------------
async def churn(cfg: dict[str, Any]) -> None:
    # The demo's task, so the loss compares with bench/hyperplane.py's
    from asynccoll.demo import DemoConfig, _data, _straggler

    comm, times = await connect(cfg)
    # the world to train at: the job's (a rank added to it by growth: ``world``)
    rank, P = comm.rank, cfg.get("world") or comm.size
    demo = DemoConfig(ranks=P, dim=cfg["dim"], step_ms=cfg["step_ms"], lr=cfg["lr"])
    X, y, Xv, yv = _data(demo, rank)
    opt = EagerSGD(comm, np.zeros(demo.dim + 1), demo.lr, Solo(), accumulate=True,
                   name="churn", timeout=cfg["timeout"])
    w = opt.params
    c, nb, local = demo.step_ms / 1000.0, len(X) // demo.batch, 0
    curve: list[tuple[float, int, float]] = []
    status(rank, "joining" if comm.joined else "training")
    quiet = False
    while opt.step_count < cfg["steps"]:
        if not quiet and opt.step_count >= cfg["steps"] - cfg["quiet_steps"]:
            quiet = True  # no more kills: a restart needs members to join
            status(rank, "finishing")
        t0 = time.monotonic()
        b = slice(local % nb * demo.batch, (local % nb + 1) * demo.batch)
        grad = X[b].T @ (X[b] @ w - y[b]) / demo.batch
        pause = c - (time.monotonic() - t0)
        if _straggler(demo.seed, opt.step_count, P) == rank:
            pause += cfg["delay_ratio"] * c
        await asyncio.sleep(max(pause, 0.0))
        info = await opt.step(grad)
        local += 1
        if info.joined:  # said at once: this process may be killed before it reports
            times["t_joined"] = time.monotonic()
            times["joined_at_step"] = opt.step_count
            (OUT / f"joined-{rank}-{RESTART}.json").write_text(json.dumps(
                {"rank": rank, "restart": RESTART, "t": times["t_joined"],
                 "step": opt.step_count}))
            status(rank, "finishing" if quiet else "training")
        if local % 5 == 0 or info.joined:
            r = Xv @ w - yv
            curve.append((time.monotonic(), opt.step_count, float(r @ r) / len(r)))
    status(rank, "finishing")
    await opt.finish()
    r = Xv @ w - yv
    times.update(curve=curve, final_val_mse=float(r @ r) / len(r), step_count=opt.step_count,
                 local_steps=local, t_end=time.monotonic(),
                 digest=hashlib.sha256(w.tobytes()).hexdigest()[:16])
    report(rank, times)
    await comm.close()


if __name__ == "__main__":
    programs = {"transfer": transfer, "restart": restart, "churn": churn}
    asyncio.run(programs[sys.argv[1]](json.loads(sys.argv[3])))
