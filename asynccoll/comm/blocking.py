"""``comm.blocking``: a Communicator's collectives as plain calls, for code without a loop.

It is also what :func:`asynccoll.init` returns: the synchronous communicator of a synchronous
training loop (``loss.backward(); opt.step()``), backed by the progress thread. The async API
(``await asynccoll.connect()``) stays as it is; both share one Communicator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Protocol, TypeVar

from ..collectives.policy import Accumulate, Policy, moved_arguments
from ..results import PartialResult
from .plan import MOVED
from .progress import ProgressEngine
from .route import DataPath

__all__ = ["BlockingCollectives", "BlockingPartial"]

T = TypeVar("T")
R = PartialResult


class _Collectives(Protocol):
    """The coroutines ``comm.blocking`` wraps: a Communicator's (named by shape, so that the
    communicator imports this module and not the other way round)."""

    async def allreduce(self, x: Any, op: str, algorithm: str | None, timeout: float | None,
                        *, out: Any) -> Any: ...
    async def broadcast(self, x: Any, root: int, timeout: float | None, *,
                        out: Any) -> Any: ...
    async def allgather(self, x: Any, timeout: float | None) -> Any: ...
    async def reduce_scatter(self, x: Any, op: str, timeout: float | None) -> Any: ...
    async def barrier(self, timeout: float | None) -> None: ...
    async def sparse_allreduce(self, x: Any, density: float | None, algorithm: str | None,
                               quantize: int | None, timeout: float | None, *,
                               delta: float | None, bucket: int, seed: int) -> Any: ...
    async def solo_allreduce(self, x: Any, timeout: float | None) -> R: ...
    async def majority_allreduce(self, x: Any, timeout: float | None) -> R: ...
    async def two_choice_allreduce(self, x: Any, timeout: float | None) -> R: ...
    async def quorum_allreduce(self, x: Any, k: int, timeout: float | None) -> R: ...
    def partial_allreduce(self, policy: Policy | str, like: Any, op: str,
                          accumulate: Accumulate | str, *, name: str | None,
                          timeout: float | None, survive: bool | None,
                          path: DataPath | None) -> Any: ...
    def hier_partial_allreduce(self, policy: Policy | str, like: Any, op: str,
                               accumulate: Accumulate | str, *, name: str | None,
                               timeout: float | None, survive: bool | None) -> Any: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...


class _Shortcut(Protocol):
    """The communicator's blocking shortcut call (``solo_allreduce`` and the others)."""

    def __call__(self, kind: str, x: Any, timeout: float | None,
                 quorum: int | None = None) -> R: ...


class _Handle(Protocol):
    """What :class:`BlockingPartial` needs of a partial allreduce handle."""

    def blocking(self, x: Any, timeout: float | None = None) -> PartialResult: ...
    def flush_blocking(self, timeout: float | None = None) -> PartialResult: ...


class BlockingPartial:
    """A partial allreduce handle whose call and flush block: ``h(x)``, ``h.flush()``.

    ``handle``: the :class:`~asynccoll.PartialAllreduce` underneath (its ``await h(x)`` still
    works from a loop). Raises what the handle raises.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __call__(self, x: Any, timeout: float | None = None) -> PartialResult:
        """``await handle(x)``, blocking: contribute ``x``, return a PartialResult."""
        h: _Handle = self.handle
        return h.blocking(x, timeout)

    def flush(self, timeout: float | None = None) -> PartialResult:
        """``await handle.flush()``, blocking (collective)."""
        h: _Handle = self.handle
        return h.flush_blocking(timeout)

    def __repr__(self) -> str:
        return f"BlockingPartial({self.handle!r})"


class BlockingCollectives:
    """``comm.blocking``: the collectives as plain functions, for code without an event loop.

    Each runs on the progress thread and blocks until done; ``RuntimeError`` with
    ``progress="inline"`` (there is no other thread to run them). Made by the Communicator
    with its ``engine`` and its blocking ``close``. Arguments, results and errors are those of
    the Communicator's coroutines (torch tensors included). ``with asynccoll.init() as comm:``
    closes it on exit (at once, without goodbyes, on an exception).
    """

    def __init__(self, comm: _Collectives, engine: ProgressEngine,
                 close: Callable[[float | None], None], shortcut: _Shortcut) -> None:
        self._comm = comm
        self._engine = engine
        self._close = close
        self._shortcut = shortcut

    def _do(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._engine.run_blocking(coro)

    @property
    def comm(self) -> Any:
        """The :class:`~asynccoll.Communicator` these calls run on (its coroutines too)."""
        return self._comm

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._comm.rank

    @property
    def size(self) -> int:
        """The world size P."""
        return self._comm.size

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` (a coroutine of this communicator) on the progress thread and return
        at once with a ``concurrent.futures.Future`` of its result: for callbacks that must
        not block (a DDP communication hook). ``RuntimeError`` with ``progress="inline"``."""
        if self._engine.mode != "thread":
            coro.close()
            raise RuntimeError("submit needs progress='thread'")
        return asyncio.run_coroutine_threadsafe(coro, self._engine.loop)

    @moved_arguments(**MOVED)
    def partial_allreduce(self, policy: Policy | str, like: Any, op: str = "sum",
                          accumulate: Accumulate | str = Accumulate.LATEST, *,
                          name: str | None = None, timeout: float | None = None,
                          survive: bool | None = None,
                          path: DataPath | None = None) -> BlockingPartial:
        """:meth:`Communicator.partial_allreduce <asynccoll.Communicator.partial_allreduce>`
        (same arguments), whose calls block: ``h(x)``, ``h.flush()``."""
        return BlockingPartial(self._comm.partial_allreduce(
            policy, like, op, accumulate, name=name, timeout=timeout, survive=survive,
            path=path))

    @moved_arguments(**MOVED)
    def hier_partial_allreduce(self, policy: Policy | str, like: Any, op: str = "sum",
                               accumulate: Accumulate | str = Accumulate.LATEST, *,
                               name: str | None = None, timeout: float | None = None,
                               survive: bool | None = None) -> BlockingPartial:
        """:meth:`Communicator.hier_partial_allreduce
        <asynccoll.Communicator.hier_partial_allreduce>` (same arguments), whose calls
        block."""
        return BlockingPartial(self._comm.hier_partial_allreduce(
            policy, like, op, accumulate, name=name, timeout=timeout, survive=survive))

    def __enter__(self) -> BlockingCollectives:
        return self

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._close(None if tp is None else 0)

    def __repr__(self) -> str:
        return f"<blocking {self._comm!r}>"

    def allreduce(self, x: Any, op: str = "sum", algorithm: str | None = None,
                  timeout: float | None = None, *, out: Any = None) -> Any:
        return self._do(self._comm.allreduce(x, op, algorithm, timeout, out=out))

    def broadcast(self, x: Any, root: int = 0, timeout: float | None = None, *,
                  out: Any = None) -> Any:
        return self._do(self._comm.broadcast(x, root, timeout, out=out))

    def allgather(self, x: Any, timeout: float | None = None) -> Any:
        return self._do(self._comm.allgather(x, timeout))

    def reduce_scatter(self, x: Any, op: str = "sum", timeout: float | None = None) -> Any:
        return self._do(self._comm.reduce_scatter(x, op, timeout))

    def barrier(self, timeout: float | None = None) -> None:
        self._do(self._comm.barrier(timeout))

    def sparse_allreduce(self, x: Any, density: float | None = None,
                         algorithm: str | None = None, quantize: int | None = None,
                         timeout: float | None = None, *, delta: float | None = None,
                         bucket: int = 512, seed: int = 0) -> Any:
        return self._do(self._comm.sparse_allreduce(x, density, algorithm, quantize, timeout,
                                                    delta=delta, bucket=bucket, seed=seed))

    def solo_allreduce(self, x: Any, timeout: float | None = None) -> PartialResult:
        return self._shortcut("solo", x, timeout)

    def majority_allreduce(self, x: Any, timeout: float | None = None) -> PartialResult:
        return self._shortcut("majority", x, timeout)

    def two_choice_allreduce(self, x: Any, timeout: float | None = None) -> PartialResult:
        return self._shortcut("two_choice", x, timeout)

    def quorum_allreduce(self, x: Any, k: int, timeout: float | None = None) -> PartialResult:
        return self._shortcut("quorum", x, timeout, k)

    def close(self, timeout: float | None = None) -> None:
        """:meth:`Communicator.close` (collective; ``timeout`` as there) for code without an
        event loop."""
        self._close(timeout)
