"""``comm.blocking``: a Communicator's collectives as plain calls, for code without a loop."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from ..results import PartialResult
from .progress import ProgressEngine

__all__ = ["BlockingCollectives"]

T = TypeVar("T")
R = PartialResult


class _Collectives(Protocol):
    """The coroutines ``comm.blocking`` wraps: a Communicator's (named by shape, so that the
    communicator imports this module and not the other way round)."""

    async def allreduce(self, x: Any, op: str, algorithm: str | None, timeout: float | None,
                        *, out: Any) -> Any: ...
    async def broadcast(self, x: Any, root: int, timeout: float | None) -> Any: ...
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


class BlockingCollectives:
    """``comm.blocking``: the collectives as plain functions, for code without an event loop.

    Each runs on the progress thread and blocks until done; ``RuntimeError`` with
    ``progress="inline"`` (there is no other thread to run them). Made by the Communicator
    with its ``engine`` and its blocking ``close``.
    """

    def __init__(self, comm: _Collectives, engine: ProgressEngine,
                 close: Callable[[float | None], None]) -> None:
        self._comm = comm
        self._engine = engine
        self._close = close

    def _do(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._engine.run_blocking(coro)

    def allreduce(self, x: Any, op: str = "sum", algorithm: str | None = None,
                  timeout: float | None = None, *, out: Any = None) -> Any:
        return self._do(self._comm.allreduce(x, op, algorithm, timeout, out=out))

    def broadcast(self, x: Any, root: int = 0, timeout: float | None = None) -> Any:
        return self._do(self._comm.broadcast(x, root, timeout))

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
        return self._do(self._comm.solo_allreduce(x, timeout))

    def majority_allreduce(self, x: Any, timeout: float | None = None) -> PartialResult:
        return self._do(self._comm.majority_allreduce(x, timeout))

    def two_choice_allreduce(self, x: Any, timeout: float | None = None) -> PartialResult:
        return self._do(self._comm.two_choice_allreduce(x, timeout))

    def quorum_allreduce(self, x: Any, k: int, timeout: float | None = None) -> PartialResult:
        return self._do(self._comm.quorum_allreduce(x, k, timeout))

    def close(self, timeout: float | None = None) -> None:
        """:meth:`Communicator.close` (collective; ``timeout`` as there) for code without an
        event loop."""
        self._close(timeout)
