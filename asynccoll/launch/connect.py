"""``connect()``: join the job the environment (or the arguments) describe; return a Communicator.

This is the one place that turns a launcher's environment into a running
:class:`~asynccoll.Communicator`: it resolves the job (:func:`.env.resolve`), starts the progress
engine, runs the rendezvous and hands the connected transport to the Communicator, which never
reads the environment itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from ..comm import Communicator, ProgressEngine
from ..comm.shm import install_cleanup
from ..comm.stall import DEFAULT_STALL_WARN
from ..transport.base import Transport
from . import errorfile, joined
from .env import ConfigError, JobSpec, resolve, say_if_alone
from .rendezvous import rendezvous
from .unresponsive import Reporter

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT", "DEFAULT_LIVENESS", "collective_timeout_from",
           "connect", "liveness_from"]

#: seconds a collective of a communicator made by :func:`connect` waits by default before it
#: raises :class:`~asynccoll.CollectiveTimeoutError`. No healthy job waits this long for one
#: collective (the slowest step of a large model is seconds); a stopped or hung rank is reported
#: in minutes instead of never. ``torch.distributed`` defaults to 10 to 30 minutes; we take less,
#: because a partial collective never needs to wait for a straggler that long.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
#: seconds a rank may send nothing, not even a liveness probe, before the others drop it as lost
#: (``ASYNCCOLL_LIVENESS``; :mod:`asynccoll.transport.liveness`). A tenth of the collective
#: timeout, so that a stopped or hung rank costs the job half a minute instead of five; three
#: times the stall warning, so that the warning names the rank first; and long enough that a
#: healthy rank on a loaded machine is never dropped: its progress thread probes every 6 s, so a
#: loss needs five probes in a row to go missing, and a multi-second garbage-collection pause or
#: scheduling hiccup costs one at most. Jobs that want to fail over fast set it lower (5 s is
#: common for fault-tolerant training; the tests use it).
DEFAULT_LIVENESS = 30.0


def _seconds_from(environ: Mapping[str, str], var: str, default: float) -> float | None:
    """Seconds from ``environ[var]`` (``none``/``inf``: None, no limit), else ``default``.
    Raises ConfigError naming ``var`` for anything but seconds > 0."""
    raw = environ.get(var, "").strip()
    if not raw:
        return default
    if raw.lower() in ("none", "inf", "infinity"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(var, f"must be seconds > 0 or 'none', got {raw!r}")
    return value


def collective_timeout_from(environ: Mapping[str, str], given: float | None) -> float | None:
    """The default collective timeout: ``given`` if not None, else ``ASYNCCOLL_TIMEOUT``
    (seconds; ``inf``/``none`` for no timeout), else :data:`DEFAULT_COLLECTIVE_TIMEOUT`.
    ``math.inf`` means no timeout (returned as None). Raises ConfigError naming the variable."""
    if given is None:
        return _seconds_from(environ, "ASYNCCOLL_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT)
    if isinstance(given, bool) or not isinstance(given, (int, float)) or not given > 0:
        raise ValueError(f"collective_timeout must be seconds > 0, math.inf or None, got "
                         f"{given!r}")
    return None if math.isinf(given) else float(given)


def liveness_from(environ: Mapping[str, str]) -> float | None:
    """The liveness time: ``ASYNCCOLL_LIVENESS`` seconds (``none``/``inf``: never drop a
    silent rank), else :data:`DEFAULT_LIVENESS`. Raises ConfigError naming the variable."""
    return _seconds_from(environ, "ASYNCCOLL_LIVENESS", DEFAULT_LIVENESS)


async def _join(spec: JobSpec, timeout: float, liveness: float | None) -> Transport:
    """The rendezvous, then (on the transport's loop) liveness and the launcher's reports."""
    t = await rendezvous(spec, timeout=timeout)
    if liveness is not None and spec.world_size > 1 and spec.transport != "inproc":
        if os.environ.get("ASYNCCOLL_STORE_HOSTED") == "1" and spec.store is not None:
            t.on_peer_lost(Reporter(spec.store, spec.secret, spec.rank))
        t.start_liveness(liveness)
    return t


async def connect(rank: int | None = None, world_size: int | None = None,
                  store: str | tuple[str, int] | None = None, transport: str | None = None,
                  *, progress: str = "thread", timeout: float = 60.0,
                  secret: bytes | str | None = None,
                  collective_timeout: float | None = None,
                  trace: str | None = None, survive: bool | None = None) -> Communicator:
    """Join the job and return this rank's :class:`Communicator`.

    Missing arguments come from the environment (``asynccoll run``, torchrun or SLURM variables;
    see :func:`asynccoll.launch.env.resolve`). ``transport``: ``tcp`` (default), ``ucx`` or
    ``inproc``. ``progress``: ``"thread"`` (a progress thread; uvloop there unless UCX) or
    ``"inline"`` (the caller's loop). ``timeout``: seconds for the rendezvous;
    ``collective_timeout``: the default timeout of every collective in seconds (default:
    ``ASYNCCOLL_TIMEOUT``, else :data:`DEFAULT_COLLECTIVE_TIMEOUT` = 300 s; ``math.inf`` or
    ``ASYNCCOLL_TIMEOUT=none`` waits forever); a collective that waits longer than
    ``ASYNCCOLL_STALL_WARN`` seconds (default 10) logs a warning naming what it waits for, then
    again at doubling intervals. A rank from which nothing arrives for ``ASYNCCOLL_LIVENESS``
    seconds (default :data:`DEFAULT_LIVENESS` = 30; ``none`` turns it off) is lost, as if its
    connection broke; under ``asynccoll run`` its launcher kills it. ``trace``: a directory
    for this rank's execution trace (default: ``ASYNCCOLL_TRACE`` if set). ``survive``: whether
    partial collectives go on without a lost rank (:attr:`Communicator.survive`; default: when
    ``ASYNCCOLL_MAX_FAILURES``, set by ``asynccoll run --max-failures N``, is above 0). Called
    in the main thread of a process whose ``SIGTERM`` has its default disposition, it installs
    a handler that unlinks this rank's shared-memory segments before the process dies of the
    signal (and, under ``asynccoll run``, makes the rank die with its launcher:
    :func:`asynccoll.comm.shm.install_cleanup`). Raises
    :class:`~asynccoll.ConfigError` naming a bad setting, ``RendezvousError`` /
    ``RendezvousTimeoutError`` when the ranks cannot assemble.
    """
    if progress not in ("thread", "inline"):
        raise ValueError(f"progress must be 'thread' or 'inline', got {progress!r}")
    spec = resolve(rank, world_size, store, secret=secret, transport=transport)
    say_if_alone(spec)
    ctimeout = collective_timeout_from(os.environ, collective_timeout)
    stall = _seconds_from(os.environ, "ASYNCCOLL_STALL_WARN", DEFAULT_STALL_WARN)
    liveness = liveness_from(os.environ)
    if survive is False and spec.capacity > spec.world_size:
        raise ConfigError("survive", "a job that may grow (ASYNCCOLL_MAX_WORLD_SIZE, asynccoll "
                                     "run --nnodes MIN:MAX) takes new ranks in through its "
                                     "partial collectives' survival: survive=False cannot join it")
    if survive is None:
        try:
            survive = int(os.environ.get("ASYNCCOLL_MAX_FAILURES") or 0) > 0
        except ValueError:
            raise ConfigError("ASYNCCOLL_MAX_FAILURES", "must be an int") from None
        # a job that may grow takes new ranks in as it takes restarted ones back: through
        # the partial handles' survival (docs/groups.md, "Growing")
        survive = survive or spec.capacity > spec.world_size
    if os.environ.get(errorfile.ENV):  # set by ``asynccoll run``, which blames the first failure
        errorfile.install(os.environ[errorfile.ENV], spec.rank)
    # A SIGTERM unlinks this rank's shared-memory segments first; under ``asynccoll run`` the
    # rank also dies with its launcher (asynccoll.comm.shm.install_cleanup).
    launcher = os.environ.get("ASYNCCOLL_LAUNCHER_PID", "")
    install_cleanup(int(launcher) if launcher.isdigit() else None)
    engine = (ProgressEngine.thread(use_uvloop=spec.transport != "ucx")
              if progress == "thread" else ProgressEngine.inline())
    try:
        t = await engine.run(_join(spec, timeout, liveness))
    except BaseException:
        engine.close()
        raise
    if trace is None:
        trace = os.environ.get("ASYNCCOLL_TRACE") or None
    # A job whose partial collectives survive a loss takes restarted ranks back.
    engine.call(lambda: setattr(t, "admit_rejoins", bool(survive)))
    comm = Communicator(t, progress=engine, timeout=ctimeout, trace=trace, stall_warn=stall,
                        survive=survive)
    if spec.restart or spec.grows:
        # Taking a lost rank's place: the members are busy with their own collectives; the
        # training classes ask to be taken back (asynccoll.comm.joining). No clock exchange
        # (arrival stamps here are this host's clock) and no host layout (network paths).
        comm.joined = True
        if os.environ.get("ASYNCCOLL_STORE_HOSTED") == "1" and spec.store is not None:
            comm.joined_report = joined.Reporter(spec.store, spec.secret, spec.rank,
                                                 spec.restart)
        return comm
    job = comm
    if spec.capacity > spec.world_size:
        # A job that may grow: the job's communicator spans every rank id, the vacant ones
        # lost from the start (no process holds them); the caller trains on the first world's
        # ranks, a group of it made without a collective (its ranks are the job's), which
        # closes the job's communicator with it. The handles grow onto the job's ranks that
        # join (asynccoll.comm.joining), as they take restarted ranks back.
        comm = job.first_world(spec.world_size)
    try:
        await comm.sync_clocks()  # so that arrival times compare across hosts
    except BaseException:
        await comm.close(timeout=0)
        await job.close(timeout=0)
        raise
    job.clock_offset = comm.clock_offset
    return comm
