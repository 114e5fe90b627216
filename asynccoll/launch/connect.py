"""``connect()``: join the job the environment (or the arguments) describe; return a Communicator.

This is the one place that turns a launcher's environment into a running
:class:`~asynccoll.Communicator`: it resolves the job (:func:`.env.resolve`), starts the progress
engine, runs the rendezvous and hands the connected transport to the Communicator, which never
reads the environment itself.
"""

from __future__ import annotations

import os

from ..comm import Communicator, ProgressEngine
from . import errorfile
from .env import resolve
from .rendezvous import rendezvous

__all__ = ["connect"]


async def connect(rank: int | None = None, world_size: int | None = None,
                  store: str | tuple[str, int] | None = None, transport: str | None = None,
                  *, progress: str = "thread", timeout: float = 60.0,
                  secret: bytes | str | None = None,
                  collective_timeout: float | None = None,
                  trace: str | None = None) -> Communicator:
    """Join the job and return this rank's :class:`Communicator`.

    Missing arguments come from the environment (``asynccoll run``, torchrun or SLURM variables;
    see :func:`asynccoll.launch.env.resolve`). ``transport``: ``tcp`` (default), ``ucx`` or
    ``inproc``. ``progress``: ``"thread"`` (a progress thread; uvloop there unless UCX) or
    ``"inline"`` (the caller's loop). ``timeout``: seconds for the rendezvous;
    ``collective_timeout``: the default timeout of every collective. ``trace``: a directory
    for this rank's execution trace (default: ``ASYNCCOLL_TRACE`` if set). Raises
    :class:`~asynccoll.ConfigError` naming a bad setting, ``RendezvousError`` /
    ``RendezvousTimeoutError`` when the ranks cannot assemble.
    """
    if progress not in ("thread", "inline"):
        raise ValueError(f"progress must be 'thread' or 'inline', got {progress!r}")
    spec = resolve(rank, world_size, store, secret=secret, transport=transport)
    if os.environ.get(errorfile.ENV):  # set by ``asynccoll run``, which blames the first failure
        errorfile.install(os.environ[errorfile.ENV], spec.rank)
    engine = (ProgressEngine.thread(use_uvloop=spec.transport != "ucx")
              if progress == "thread" else ProgressEngine.inline())
    try:
        t = await engine.run(rendezvous(spec, timeout=timeout))
    except BaseException:
        engine.close()
        raise
    if trace is None:
        trace = os.environ.get("ASYNCCOLL_TRACE") or None

    return Communicator(t, progress=engine, timeout=collective_timeout, trace=trace)
