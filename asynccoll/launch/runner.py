"""Start, watch and stop the local ranks of a job (the engine of ``asynccoll run``).

One launcher runs per node. The launcher of node 0 hosts the job's store; every launcher starts
its ``nproc`` ranks with ``ASYNCCOLL_*`` variables and torch's (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: an unchanged
``torch.distributed.init_process_group("gloo")`` script runs under it; :func:`rank_environment`),
prefixes each line they print with ``[rank]``, and watches them:

* a rank that exits non-zero stops the others — ``SIGTERM`` to its process group, ``SIGKILL``
  after ``grace`` seconds — and the launcher exits with the failing rank's code (``128 + n`` for
  a rank killed by signal ``n``); the launchers of other nodes learn it through the store key
  ``asynccoll/launch/abort`` and stop their ranks too;
* with ``max_failures`` = N > 0 (``asynccoll run --max-failures N``), the first N ranks that
  fail do not stop the job: the launcher says which rank failed and how, and the others go on
  (their partial collectives continue without it, their synchronous ones raise
  ``PeerLostError`` and ``comm.shrink()`` gives the survivors a communicator; each rank sees
  ``ASYNCCOLL_MAX_FAILURES`` and :func:`~asynccoll.connect` sets ``Communicator.survive``
  from it). The job then exits 0 when every other rank exits 0. Failures are counted per
  node: each node's launcher allows N of its own ranks;
* with ``max_restarts`` = N > 0 (``asynccoll run --max-restarts N``), a rank that fails after
  another rank of the node exited 0 (the job is finishing: its training's collective finish
  is done) is neither restarted nor counted as a failure; one line says so. Before that, a
  rank that fails is
  started again, in a new process with the environment of the first plus ``ASYNCCOLL_RESTART=k``
  (its k-th restart), while the node has made fewer than N restarts; the other ranks go on
  meanwhile (they see ``ASYNCCOLL_MAX_FAILURES`` >= 1 so that their collectives survive the
  loss), and a restarted failure counts against no ``max_failures``. The job exits 0 when the
  latest process of every rank exits 0. Once the restarts are spent a failure is handled as
  above. Restarts are counted per node, in the store when there are several nodes, where a
  replacement launcher of a node whose launcher died continues the count (:mod:`.nodes`);
* the rank blamed is the one that failed *first*, not the first to exit: each rank records its
  uncaught exception in a file (:mod:`.errorfile`); a failure that merely follows another rank's
  loss (a ``PeerLostError`` naming it, or a collective timeout) is not blamed while a cause is
  known. The launcher prints the cause's traceback first and one line per follower;
* the launchers of all nodes meet in the store before any rank starts (within
  ``join_timeout``), and node 0 keeps the store up until the other nodes' ranks are done
  (at most ``exit_timeout`` after its own), or a node's launcher is gone and not replaced
  (:mod:`.nodes`: who may replace a launcher, and what node 0 does meanwhile); a launcher
  that loses the store (node 0's launcher died) says so and restarts nothing from then on;
* ``SIGINT`` (Ctrl-C) or ``SIGTERM`` to the launcher is passed on to every rank, escalating to
  ``SIGTERM`` then ``SIGKILL`` after ``grace`` seconds each; the launcher exits ``128 + signal``.
  From the signal on, what the ranks print is dropped (their tracebacks of the interrupt say
  nothing new) and the launcher prints one line per rank saying how it ended; ``verbose``
  (``--verbose``) passes everything through.
* more ranks than this host's cores get a one-line notice (they will share the cores).

Each rank runs in its own process group so that a terminal's Ctrl-C reaches the launcher only
and the launcher decides the order of shutdown; stopping a rank stops the processes it started.

**Shared memory.** Every segment a rank of the job makes is named with the job's public tag
(``ASYNCCOLL_JOB_TAG``: drawn by node 0's launcher, passed to the other nodes in the store).
When the job ends, however it ends (the ranks exit, a rank fails, the launcher gets
``SIGTERM``, ``SIGINT`` or ``SIGHUP``), the launcher unlinks whatever files of that tag are
left, once its ranks are stopped (:func:`asynccoll.comm.shm.unlink_job`; ``--verbose`` says
how much it found). A launcher killed with ``SIGKILL`` cannot: its ranks (its direct children,
told its pid in ``ASYNCCOLL_LAUNCHER_PID``) get ``SIGTERM`` when it dies and unlink the job's
files (:func:`asynccoll.comm.shm.install_cleanup`), and its reaper (:mod:`.reaper`, a small
process in a session of its own that outlives it) kills those still running after the grace
period (at most 5 s) and unlinks what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from ..comm.shm import SHM_DIR, new_job_tag, unlink_job
from . import errorfile, joined, nodes, unresponsive
from .env import free_port
from .store import StoreClient, StoreError, StoreServer

__all__ = ["LaunchConfig", "launch", "rank_environment"]

ABORT_KEY = "asynccoll/launch/abort"
#: where node 0's launcher publishes torch's MASTER_PORT for the other nodes
MASTER_KEY = "asynccoll/launch/master-port"
#: where node 0's launcher publishes the job's shared-memory tag for the other nodes
TAG_KEY = "asynccoll/launch/job-tag"
#: the variable that tells a restarted rank it is one, and which restart it is (1, 2, ...)
RESTART_ENV = "ASYNCCOLL_RESTART"
T = TypeVar("T")


@dataclass(frozen=True)
class LaunchConfig:
    """What one node's launcher does.

    ``argv``: the full command of a rank (e.g. ``[sys.executable, "-u", "train.py"]``).
    ``rdzv``: the store's ``(host, port)``; required with ``nnodes > 1``; on node 0 it is where
    the store binds (``None``: a free port on 127.0.0.1). ``host``: the address ranks of this
    node listen on (``ASYNCCOLL_HOST``), ``None`` to let them choose.
    """

    nproc: int
    argv: Sequence[str]
    secret: bytes = field(repr=False)
    nnodes: int = 1
    node_rank: int = 0
    rdzv: tuple[str, int] | None = None
    transport: str = "tcp"
    host: str | None = None
    grace: float = 5.0
    env: Mapping[str, str] = field(default_factory=dict)
    join_timeout: float = 300.0
    exit_timeout: float = 300.0
    max_failures: int = 0
    #: restarts of failed ranks this node may make (see the module doc); 0: none
    max_restarts: int = 0
    #: the port torch.distributed's ``env://`` store uses (``MASTER_PORT``); ``None``: node 0's
    #: launcher picks a free one below the ephemeral range and the others learn it in the store
    master_port: int | None = None
    verbose: bool = False
    #: the most nodes the job may grow to (``--nnodes MIN:MAX``; None: ``nnodes``): the job
    #: starts once nodes ``0..nnodes-1`` met; a launcher of node ``nnodes..max_nnodes-1``
    #: started later (same ``--rdzv`` and secret) adds its ranks to the running job
    #: (docs/launch.md, "Growing")
    max_nnodes: int | None = None

    @property
    def node_limit(self) -> int:
        """The nodes the job may have: ``max_nnodes``, else ``nnodes``."""
        return self.max_nnodes or self.nnodes

    @property
    def grows(self) -> bool:
        """Whether this node is one the job grows by (its rank is at or above ``nnodes``)."""
        return self.node_rank >= self.nnodes

    def __post_init__(self) -> None:
        if type(self.nproc) is not int or self.nproc < 1:
            raise ValueError(f"nproc must be an int >= 1, got {self.nproc!r}")
        if type(self.nnodes) is not int or self.nnodes < 1:
            raise ValueError(f"nnodes must be an int >= 1, got {self.nnodes!r}")
        if self.max_nnodes is not None and (type(self.max_nnodes) is not int
                                            or self.max_nnodes < self.nnodes):
            raise ValueError(f"max_nnodes must be an int >= nnodes ({self.nnodes}), got "
                             f"{self.max_nnodes!r}")
        if type(self.node_rank) is not int or not 0 <= self.node_rank < self.node_limit:
            raise ValueError(f"node_rank must be in 0..{self.node_limit - 1}, got "
                             f"{self.node_rank!r}")
        if self.node_limit > 1 and self.rdzv is None:
            raise ValueError("rdzv (the store's host:port on node 0) is required with nnodes > 1")
        if not self.argv:
            raise ValueError("argv must name the command to run")
        if self.grace < 0:
            raise ValueError(f"grace must be >= 0, got {self.grace}")
        if type(self.max_failures) is not int or not 0 <= self.max_failures < self.nproc:
            raise ValueError(f"max_failures must be an int in 0..{self.nproc - 1} (fewer than "
                             f"the ranks of a node), got {self.max_failures!r}")
        if type(self.max_restarts) is not int or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if self.join_timeout <= 0 or self.exit_timeout < 0:
            raise ValueError("join_timeout must be > 0 and exit_timeout >= 0, got "
                             f"{self.join_timeout} and {self.exit_timeout}")


def rank_environment(cfg: LaunchConfig, local_rank: int, store: tuple[str, int],
                     base: Mapping[str, str], errors: Path | None = None,
                     master: tuple[str, int] | None = None) -> dict[str, str]:
    """The environment of local rank ``local_rank``: ``base`` plus the job's variables
    (``errors``: the directory its error file goes to, see :mod:`.errorfile`; ``master``:
    torch's ``MASTER_ADDR`` and ``MASTER_PORT``, default the store's host and port + 1).
    A restart adds ``ASYNCCOLL_RESTART`` to it (:meth:`_Ranks.start`).

    ``ASYNCCOLL_MAX_FAILURES`` is ``max_failures``, and at least 1 with ``max_restarts``: the
    others must survive a rank's loss while it restarts."""
    env = dict(base)
    env.pop(RESTART_ENV, None)
    env.update(cfg.env)
    if omp_default(cfg, env):
        env["OMP_NUM_THREADS"] = "1"
    rank = cfg.node_rank * cfg.nproc + local_rank
    if errors is not None:
        env[errorfile.ENV] = str(errors / f"rank-{rank}.json")
    env.update({
        "ASYNCCOLL_RANK": str(rank),
        "ASYNCCOLL_WORLD_SIZE": str(cfg.nnodes * cfg.nproc),
        "ASYNCCOLL_LOCAL_RANK": str(local_rank),
        "ASYNCCOLL_LOCAL_WORLD_SIZE": str(cfg.nproc),
        "ASYNCCOLL_NODE_RANK": str(cfg.node_rank),
        "ASYNCCOLL_NNODES": str(cfg.nnodes),
        **({"ASYNCCOLL_MAX_WORLD_SIZE": str(cfg.node_limit * cfg.nproc)}
           if cfg.node_limit > cfg.nnodes else {}),
        "ASYNCCOLL_STORE": f"[{store[0]}]:{store[1]}" if ":" in store[0]
        else f"{store[0]}:{store[1]}",
        "ASYNCCOLL_STORE_HOSTED": "1",
        "ASYNCCOLL_SECRET": cfg.secret.decode("utf-8", "surrogateescape"),
        "ASYNCCOLL_TRANSPORT": cfg.transport,
        "PYTHONUNBUFFERED": "1",
        # torch.distributed's env:// reads these: an unchanged init_process_group script runs
        "RANK": str(rank),
        "WORLD_SIZE": str(cfg.nnodes * cfg.nproc),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
        "GROUP_RANK": str(cfg.node_rank),
        "MASTER_ADDR": (master or store)[0],
        "MASTER_PORT": str(master[1] if master else store[1] + 1),
    })
    if cfg.max_failures or cfg.max_restarts:
        env["ASYNCCOLL_MAX_FAILURES"] = str(max(cfg.max_failures, 1))
    env.pop("ASYNCCOLL_SECRET_FILE", None)
    if cfg.host:
        env["ASYNCCOLL_HOST"] = cfg.host
    return env


def omp_default(cfg: LaunchConfig, env: Mapping[str, str]) -> bool:
    """Whether the ranks get ``OMP_NUM_THREADS=1``: when it is unset and a node runs more
    than one rank, as torchrun does (each rank's BLAS/OpenMP pool would otherwise take every
    core: 4 ranks on 2 cores ran 1.6x slower)."""
    return cfg.nproc > 1 and "OMP_NUM_THREADS" not in env


async def _pump(stream: asyncio.StreamReader | None, prefix: bytes, out: BinaryIO,
                muted: asyncio.Event | None = None) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed; a last partial line too.
    Once ``muted`` is set, lines are read and dropped (the ranks never block on a full pipe)."""
    if stream is None:
        return
    tail = b""
    while True:
        chunk = await stream.read(1 << 16)
        if not chunk:
            break
        if muted is not None and muted.is_set():
            tail = b""
            continue
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        if lines:
            out.write(b"".join(prefix + line + b"\n" for line in lines))
            out.flush()
    if tail and not (muted is not None and muted.is_set()):
        out.write(prefix + tail + b"\n")
        out.flush()


def _ended(returncode: int | None) -> str:
    """How a rank ended, in words, for the line the launcher prints after a stop signal."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"stopped by {_signame(-returncode)}"
    return "exited with code 0" if returncode == 0 else f"exited with code {returncode}"


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _signame(sig: int) -> str:
    """``SIGKILL`` for 9; ``signal 40`` for a signal without a name (realtime ones)."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _say(err: BinaryIO, text: str) -> None:
    err.write(f"asynccoll run: {text}\n".encode())
    err.flush()


class _Ranks:
    """The local rank processes: their start, restart and shutdown."""

    def __init__(self, cfg: LaunchConfig, errors: Path, out: BinaryIO, err: BinaryIO,
                 muted: asyncio.Event) -> None:
        self.cfg = cfg
        self.errors = errors
        self.out, self.err, self.muted = out, err, muted
        #: each rank's latest process
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.pumps: list[asyncio.Task[None]] = []
        #: each rank's environment at its first start (a restart adds ASYNCCOLL_RESTART)
        self.env: dict[int, dict[str, str]] = {}
        #: how often each rank was started (the store's count, when there is a client)
        self.starts: dict[int, int] = {}
        #: restarts this node made (the store's count, when there is a client)
        self.restarts = 0
        self.client: StoreClient | None = None
        self.reaper: asyncio.subprocess.Process | None = None
        #: cleared when restarting is no longer possible (the store is gone)
        self.can_restart = cfg.max_restarts > 0
        #: once the store is gone: tells a new node 0 that it cannot take the job over
        self.orphan: asyncio.Task[None] | None = None
        #: ``watch_joined(rank, restart)``: says when a restarted process joined the job (True:
        #: it was not taken back, the job having ended first)
        self.watch_joined: Callable[[int, int], Coroutine[Any, Any, bool]] | None = None
        self.joins: dict[int, asyncio.Task[bool]] = {}  # by rank: its latest restart's

    async def ended_first(self, rank: int) -> bool:
        """Whether ``rank``'s latest restart reported that the job ended before it was taken
        back (its report is set before it exits; the watch that reads it gets a moment)."""
        task = self.joins.get(rank)
        if task is None:
            return False
        await asyncio.wait([task], timeout=2.0)
        return task.done() and not task.cancelled() and task.exception() is None \
            and task.result()

    async def start(self, rank: int) -> asyncio.subprocess.Process:
        """Start ``rank``'s process: its first, or a restart (``ASYNCCOLL_RESTART=k`` for the
        rank's k-th, after killing whatever its last process group left running)."""
        n = await nodes.rank_starts(self.client, rank, self.starts.get(rank, 0))
        self.starts[rank] = n
        env = self.env[rank] if n == 1 else {**self.env[rank], RESTART_ENV: str(n - 1)}
        old = self.procs.get(rank)
        if old is not None:  # its group outlives it while a child of it runs (pid not reused)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(old.pid, signal.SIGKILL)
        p = await asyncio.create_subprocess_exec(
            *self.cfg.argv, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        self.procs[rank] = p
        if (n > 1 or self.cfg.grows) and self.watch_joined is not None:  # (a new rank too)
            self.joins[rank] = asyncio.create_task(self.watch_joined(rank, n - 1))
        if self.reaper is not None and self.reaper.stdin is not None:
            self.reaper.stdin.write(f"{p.pid}\n".encode())
        prefix = f"[{rank}] ".encode()
        self.pumps.append(asyncio.create_task(_pump(p.stdout, prefix, self.out, self.muted)))
        self.pumps.append(asyncio.create_task(_pump(p.stderr, prefix, self.err, self.muted)))
        return p

    async def restart(self, rank: int, how: str) -> asyncio.subprocess.Process | None:
        """Restart ``rank``, which ``how`` (``"was killed by SIGKILL"``), if the node has
        restarts left; say so, with its traceback; None when it has none."""
        if not self.can_restart:
            return None
        spent = await nodes.spend_restart(self.cfg, self.client, self.restarts)
        if spent > self.cfg.max_restarts:
            return None
        self.restarts = spent
        _say(self.err, f"rank {rank} {how}; restarting it (restart {spent} of at most "
                       f"{self.cfg.max_restarts}, --max-restarts)")
        _traceback(self.errors, rank, self.err)
        errorfile.forget(self.errors, rank)
        p = await self.start(rank)
        _say(self.err, f"rank {rank} restarted as pid {p.pid}")
        return p

    def signal_all(self, sig: int) -> None:
        for p in self.procs.values():
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)  # the rank and whatever it started

    async def stop(self, first: int = signal.SIGTERM) -> None:
        """Signal every live rank with ``first``, escalating each ``grace`` seconds to KILL."""
        ladder = [first] + [s for s in (signal.SIGTERM, signal.SIGKILL) if s != first]
        for sig in ladder:
            alive = [p for p in self.procs.values() if p.returncode is None]
            if not alive:
                return
            self.signal_all(sig)
            if sig == signal.SIGKILL:
                await asyncio.gather(*(p.wait() for p in alive))
                return
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in alive],
                               timeout=self.cfg.grace)


async def launch(cfg: LaunchConfig, *, stdout: BinaryIO | None = None,
                 stderr: BinaryIO | None = None) -> int:
    """Run this node's ranks to completion; return the exit code for the launcher.

    0 when every rank exits 0; else the code of the first rank that failed (see module doc).
    Every rank process is stopped before this returns, whatever happens.
    """
    out = stdout or sys.stdout.buffer
    err = stderr or sys.stderr.buffer
    loop = asyncio.get_running_loop()
    server: StoreServer | None = None
    client: StoreClient | None = None
    errdir = tempfile.TemporaryDirectory(prefix="asynccoll-errors-")
    muted = asyncio.Event()  # set after a stop signal unless verbose
    ranks = _Ranks(cfg, Path(errdir.name), out, err, muted)
    stop_sig: asyncio.Future[int] = loop.create_future()
    say = functools.partial(_say, err)

    def on_signal(sig: int) -> None:
        if not stop_sig.done():
            stop_sig.set_result(sig)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in handled:
        loop.add_signal_handler(sig, on_signal, sig)
    abort_task: asyncio.Task[bytes] | None = None
    silent: asyncio.Task[None] | None = None
    followed: dict[int, asyncio.Task[None]] = {}  # node 0: the other nodes, by node rank
    growing: dict[int, asyncio.Task[None]] = {}  # node 0: the nodes the job may grow by
    restart = 0
    tag: str | None = None
    reaper: asyncio.subprocess.Process | None = None
    try:
        if cfg.node_rank == 0:
            host, port = cfg.rdzv or ("127.0.0.1", 0)
            server = await StoreServer(host, port, cfg.secret).start()
            store = (host, server.port)
        else:
            assert cfg.rdzv is not None
            store = cfg.rdzv
        if cfg.node_limit > 1:
            met = await _unless_stopped(nodes.join(cfg, store, server, say), stop_sig)
            if met is None:
                got = stop_sig.result()
                _say(err, f"got {_signame(got)} while the nodes met; no rank started")
                return 128 + got
            client, restart = met
            ranks.client = client
            if restart:
                say(f"node {cfg.node_rank}'s launcher is gone: this one replaces it and "
                    f"restarts {nodes.node_ranks(cfg, cfg.node_rank)} (restart {restart} of "
                    f"at most {cfg.max_restarts}, --max-restarts)")
            abort_task = asyncio.create_task(client.get(ABORT_KEY, timeout=nodes.FOREVER))
            if cfg.grows and not restart:
                say(f"node {cfg.node_rank} joins the running job: it starts "
                    f"{nodes.node_ranks(cfg, cfg.node_rank)}, taken in at the members' next "
                    "sync event (--nnodes MIN:MAX)")
            if cfg.node_rank == 0:
                followed = {k: asyncio.create_task(nodes.follow(cfg, client, k, say))
                            for k in range(1, cfg.nnodes)}
                growing = {k: asyncio.create_task(nodes.follow_joining(cfg, client, k, say))
                           for k in range(cfg.nnodes, cfg.node_limit)}
        ranks.watch_joined = functools.partial(joined.watch, store, cfg.secret, say)
        master = await _master(cfg, store, client)
        tag = await _job_tag(cfg, client)
        reaper = ranks.reaper = await _start_reaper(cfg, tag)
        job = {"ASYNCCOLL_JOB_TAG": tag, "ASYNCCOLL_LAUNCHER_PID": str(os.getpid())}
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
        if cfg.nproc > cores:
            _say(err, f"{cfg.nproc} ranks on {cores} cores: ranks share cores, so steps are "
                      "slower and stall warnings may name ranks that only wait for a core")
        if omp_default(cfg, {**os.environ, **cfg.env}):
            _say(err, "OMP_NUM_THREADS is unset: setting it to 1 for every rank (as torchrun "
                      "does); set it yourself to give each rank more threads")
        for local in range(cfg.nproc):
            rank = cfg.node_rank * cfg.nproc + local
            ranks.env[rank] = {**rank_environment(cfg, local, store, os.environ, ranks.errors,
                                                  master), **job}
            p = await ranks.start(rank)
            if rank in ranks.starts and ranks.starts[rank] > 1:
                say(f"rank {rank} restarted as pid {p.pid}")
        watched = list(ranks.procs)
        if restart and client is not None:  # reports left by the lost launcher's ranks: stale
            watched = [r for r in watched
                       if not await client.check([f"{unresponsive.KEY}{r}"])]
        silent = asyncio.create_task(unresponsive.watch(
            store, cfg.secret, watched, functools.partial(_kill_silent, ranks, err)))
        code = await _watch(cfg, ranks, stop_sig, abort_task, client, err, muted)
        if client is not None and not stop_sig.done():
            # the nodes the job grew by are followed; those that never came are not waited for
            joined_nodes = await nodes.joined_nodes(client, list(growing))
            await _unless_stopped(nodes.check_out(
                cfg, client, {**followed, **{k: growing[k] for k in joined_nodes}}, say),
                stop_sig)
        return code
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        for task in (abort_task, silent, ranks.orphan, *followed.values(), *growing.values(),
                     *ranks.joins.values()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await ranks.stop(signal.SIGKILL)
        if tag is not None:
            _unlink_left(cfg, tag, err)
        if reaper is not None:
            await _stop_reaper(reaper)
        if ranks.pumps:
            await asyncio.wait(ranks.pumps, timeout=5.0)
        for t in ranks.pumps:
            t.cancel()
        if client is not None:
            await client.close()
        if server is not None:
            await server.close()
        errdir.cleanup()


async def _master(cfg: LaunchConfig, store: tuple[str, int], client: StoreClient | None,
                  ) -> tuple[str, int]:
    """torch's ``(MASTER_ADDR, MASTER_PORT)``: the store's host and a port node 0 picks (or
    ``cfg.master_port``), published in the store for the other nodes."""
    if cfg.node_rank == 0:
        port = cfg.master_port or free_port(store[0])
        if client is not None:
            await client.set(MASTER_KEY, str(port).encode())
        return store[0], port
    assert client is not None
    return store[0], int(await client.get(MASTER_KEY, timeout=cfg.join_timeout))


async def _job_tag(cfg: LaunchConfig, client: StoreClient | None) -> str:
    """The job's shared-memory tag: drawn by node 0, published in the store for the others
    (every node's ranks name their segments with it: ranks of two nodes may share a host)."""
    if cfg.node_rank == 0:
        tag = new_job_tag()
        if client is not None:
            await client.set(TAG_KEY, tag.encode())
        return tag
    assert client is not None
    return (await client.get(TAG_KEY, timeout=cfg.join_timeout)).decode()


async def _start_reaper(cfg: LaunchConfig, tag: str) -> asyncio.subprocess.Process:
    """Start the job's reaper (:mod:`.reaper`: should this launcher die, it ends the ranks and
    unlinks their segments), in a session of its own so that no signal to ours reaches it."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asynccoll.launch.reaper", tag,
        cfg.env.get("ASYNCCOLL_SHM_DIR") or SHM_DIR, str(min(cfg.grace, 5.0)),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        start_new_session=True)


async def _stop_reaper(reaper: asyncio.subprocess.Process) -> None:
    """Tell the reaper the launcher cleaned up itself, and let it go."""
    if reaper.stdin is not None:
        with contextlib.suppress(OSError):
            reaper.stdin.write(b"done\n")
            reaper.stdin.close()
    try:
        await asyncio.wait_for(reaper.wait(), 10.0)
    except TimeoutError:
        reaper.kill()
        await reaper.wait()


def _unlink_left(cfg: LaunchConfig, tag: str, err: BinaryIO) -> None:
    """Unlink the segments of the job ``tag`` its ranks left (in the directory they used)."""
    files, held = unlink_job(tag, cfg.env.get("ASYNCCOLL_SHM_DIR") or SHM_DIR)
    if files and cfg.verbose:
        _say(err, f"removed {files} shared-memory segments ({held} bytes) the ranks left")


async def _unless_stopped(coro: Coroutine[Any, Any, T], stop_sig: asyncio.Future[int]
                          ) -> T | None:
    """``await coro``, unless a stop signal comes first: then cancel it and return None."""
    task = asyncio.ensure_future(coro)
    both: set[asyncio.Future[Any]] = {task, stop_sig}
    await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _kill_silent(ranks: _Ranks, err: BinaryIO, rank: int, why: str) -> None:
    """A rank its peers dropped for silence (:mod:`.unresponsive`): stopped or hung, it would
    never exit; kill it and say so (its exit is then handled as any other)."""
    p = ranks.procs.get(rank)
    if p is None or p.returncode is not None:
        return
    _say(err, f"rank {rank} answered no liveness probe ({why}); killing it")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)


async def _watch(cfg: LaunchConfig, ranks: _Ranks, stop_sig: asyncio.Future[int],
                 abort_task: asyncio.Task[bytes] | None, client: StoreClient | None,
                 err: BinaryIO, muted: asyncio.Event | None = None) -> int:
    waits = {asyncio.ensure_future(p.wait()): r for r, p in ranks.procs.items()}
    extra: set[asyncio.Future[Any]] = {stop_sig}
    failed = 0
    finished: list[int] = []  # ranks whose latest process exited 0
    excused: dict[int, int] = {}  # ranks whose restart the job ended without: their codes
    if abort_task is not None:
        extra.add(abort_task)
    try:
        while waits:
            done, _ = await asyncio.wait({*waits, *extra}, return_when=asyncio.FIRST_COMPLETED)
            if stop_sig in done:
                sig = stop_sig.result()
                quiet = muted is not None and not cfg.verbose
                _say(err, f"got {_signame(sig)}; stopping all ranks"
                          + (" (their output from now on is dropped; --verbose shows it)"
                             if quiet else ""))
                if quiet:
                    assert muted is not None
                    muted.set()
                await ranks.stop(signal.SIGINT if sig == signal.SIGINT else signal.SIGTERM)
                if quiet:
                    for r, p in sorted(ranks.procs.items()):
                        _say(err, f"rank {r} {_ended(p.returncode)}")
                return 128 + sig
            if abort_task is not None and abort_task in done:
                extra.discard(abort_task)
                if abort_task.exception() is None:
                    reason = abort_task.result().decode(errors="replace")
                    _say(err, f"another node failed ({reason}); stopping this node's ranks")
                    await ranks.stop()
                    code = int(reason.rsplit(" ", 1)[-1]) if reason[-1:].isdigit() else 1
                    return code or 1
                _lost_store(cfg, ranks, err)
            for w in [w for w in done if w in waits]:
                rank = waits.pop(w)
                rc = ranks.procs[rank].returncode or 0
                code = _code(rc)
                how = f"was killed by {_signame(-rc)}" if rc < 0 else f"exited with code {code}"
                if not code:
                    finished.append(rank)
                elif await ranks.ended_first(rank):
                    # Its restart said the job ended before the members took it back (they
                    # closed while it waited): nothing failed, and nobody is left to join;
                    # unless no rank here finishes with 0 (checked at the end)
                    excused[rank] = code
                    _say(err, f"rank {rank} {how}: the job ended before its restart was taken "
                              "back; not counted as a failure")
                    continue
                elif cfg.max_restarts and finished:
                    # A rank exits 0 after its training's collective finish: the job is done,
                    # and a restart would find nobody to take it back. Its result stands.
                    _say(err, f"rank {rank} {how} after rank(s) {sorted(finished)} finished; "
                              "not restarted: the job is done without it")
                    _traceback(ranks.errors, rank, err)
                    continue
                if code and (again := await _restart(ranks, rank, how)) is not None:
                    waits[asyncio.ensure_future(again.wait())] = rank
                    continue
                if code and failed < cfg.max_failures:
                    failed += 1
                    _say(err, f"rank {rank} {how}; failure {failed} of at most "
                              f"{cfg.max_failures} (--max-failures): the other ranks go on")
                    _traceback(ranks.errors, rank, err)
                    continue
                if code:
                    rank, code = await _blame(ranks, rank, code, err)
                    if client is not None:
                        with contextlib.suppress(StoreError, TimeoutError):
                            await client.set(ABORT_KEY, f"rank {rank} exited with code {code}"
                                             .encode(), timeout=2.0)
                    await ranks.stop()
                    return code
        if excused and not finished:  # the job did not end here after all: nothing exited 0
            rank, code = min(excused.items())
            _say(err, f"no rank finished; rank {rank}'s exit code {code} is the job's")
            return code
        return 0
    finally:
        for w in waits:
            w.cancel()


async def _restart(ranks: _Ranks, rank: int, how: str) -> asyncio.subprocess.Process | None:
    """:meth:`_Ranks.restart`, or None when the store it counts in is gone meanwhile."""
    try:
        return await ranks.restart(rank, how)
    except (StoreError, OSError) as exc:
        _say(ranks.err, f"cannot restart rank {rank}: {exc}")
        ranks.can_restart = False
        return None


def _lost_store(cfg: LaunchConfig, ranks: _Ranks, err: BinaryIO) -> None:
    """This launcher lost its connection to the store: node 0's launcher, which hosts it, is
    gone. Nothing can join the job from now on (node 0 cannot be replaced); the ranks go on
    as long as they survive the loss. Say so, and tell a new node 0 (:func:`.nodes.
    tell_new_store`)."""
    ranks.can_restart = False
    if cfg.rdzv is None or ranks.orphan is not None:
        return
    _say(err, f"lost the job's store at {cfg.rdzv[0]}:{cfg.rdzv[1]} (node 0's launcher is "
              "gone): no rank is restarted from now on, and node 0 cannot be replaced "
              "(docs/launch.md, Restarts)")
    ranks.orphan = asyncio.create_task(nodes.tell_new_store(cfg))


def _traceback(errors: Path, rank: int, err: BinaryIO) -> None:
    """Print ``rank``'s recorded traceback, if it left one, each line prefixed."""
    rec = errorfile.read(errors).get(rank)
    if rec is not None:
        err.write(b"".join(f"[{rank}] {line}\n".encode()
                           for line in rec.traceback.rstrip("\n").split("\n")))
    err.flush()


#: how long the launcher waits, after a rank exits because it lost another, for the lost one
#: to exit and leave its own error record
SETTLE_S = 2.0


async def _blame(ranks: _Ranks, first: int, code: int, err: BinaryIO) -> tuple[int, int]:
    """The rank to blame for a failure first seen as ``first`` exiting with ``code``, and its
    code; prints which it is, its traceback, then one line per rank that failed after it."""
    recs = errorfile.read(ranks.errors)
    rec = recs.get(first)
    if rec is not None and rec.follow_on:
        # The first to exit only lost another rank: give the lost one (or every other rank,
        # when unnamed) a moment to exit and leave its record.
        peers = [rec.lost_peer] if rec.lost_peer in ranks.procs else \
            [r for r in ranks.procs if r != first]
        waits = [asyncio.ensure_future(ranks.procs[r].wait()) for r in peers
                 if ranks.procs[r].returncode is None]
        if waits:
            await asyncio.wait(waits, timeout=SETTLE_S,
                               return_when=asyncio.FIRST_COMPLETED if rec.lost_peer is None
                               else asyncio.ALL_COMPLETED)
            for t in waits:
                t.cancel()
        recs = errorfile.read(ranks.errors)
    causes = sorted((r for r in recs.values() if not r.follow_on), key=lambda r: r.time)
    killed = [r for r, p in ranks.procs.items() if p.returncode is not None
              and p.returncode < 0 and r not in recs]
    if causes:
        root = causes[0].rank
    elif killed:
        root = killed[0] if first not in killed else first
    elif rec is not None and rec.lost_peer in ranks.procs:
        root = rec.lost_peer
    else:
        root = first
    p = ranks.procs[root]
    root_code = _code(p.returncode) if p.returncode else code
    _say(err, f"rank {root} exited with code {root_code}; stopping the other ranks")
    cause = recs.get(root)
    if cause is not None:
        err.write(b"".join(f"[{root}] {line}\n".encode()
                           for line in cause.traceback.rstrip("\n").split("\n")))
    elif p.returncode is not None and p.returncode < 0:
        _say(err, f"rank {root} was killed by {_signame(-p.returncode)}")
    for r, other in sorted(recs.items()):
        if r != root:
            _say(err, f"rank {r} failed after it: {other.type}: {other.message}")
    err.flush()
    return root, root_code
