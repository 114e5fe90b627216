"""Routes: the one place that chooses a data path (DESIGN §6).

A call's data goes over the **network** (a named algorithm of :mod:`asynccoll.collectives`),
through **shared memory** within one host (:mod:`asynccoll.collectives.shm`, segments in
:mod:`.shm`), **hierarchically** (shared memory within each host, the network among their
leaders), or, for a sparse allreduce or handle, through its **split allgather in shared
memory** (:mod:`asynccoll.collectives.sparse.shm`). A :class:`Router` decides which, from

* the host layout, a value (:class:`Layout`: each rank's host and the job's segment token),
  learned elsewhere (the communicator's first collective, at ``connect()``) and passed in;
* the call: its kind, size in bytes, whether the data is a NumPy array, the algorithm and
  ``shm=`` asked for;
* the environment switches, read once here (:class:`Switches`): ``ASYNCCOLL_SHM=0`` keeps every
  default off shared memory, ``ASYNCCOLL_CMA=0`` the single-copy allreduce (:mod:`.cma`),
  ``ASYNCCOLL_JOIN_RING_MIN`` sets the smallest stripe of a joiner's state that takes a ring.

A joiner's state (:mod:`.joining`) has its route too, one stripe per member: read in place by
the joiner, through a ring in shared memory, or over the connection (:func:`state_route`,
:mod:`.state_send`).

It runs no collective. When the chosen path cannot be set up (segments refused: a name taken,
too little free space, a foreign file), the caller falls back to the network on every rank
alike, never fatally: a synchronous collective agrees on it with a flag allreduce
(:class:`~.dense.ShmUnavailable`), a persistent handle with one exchange of flags among its
ranks before its first execution (:func:`agree_flags`), and in either case one warning names
why. Asked for by name (``algorithm="shm"``, ``shm=True``), a path that cannot be had raises.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..collectives.shm import SHM_MIN_BYTES, SHM_NAMES, host_groups
from ..collectives.sparse.shm import SHM_SPARSE_ALGORITHMS
from ..errors import CollectiveTimeoutError
from ..transport.base import Transport
from ..transport.frames import Kind
from ..transport.matching import ignore_outcome

__all__ = ["READ", "RING_MIN", "DataPath", "Layout", "Router", "Switches", "agree_flags",
           "exchange", "shm_flag", "state_route"]

#: the paths a plan names
NETWORK, SHM, HIER = "network", "shm", "hier"
#: a joiner's state read in place out of a member's memory (:mod:`.state_send`)
READ = "read"
#: the default smallest stripe of a joiner's state that goes through the shared-memory ring
#: (``Switches.ring_min``); a smaller one goes over the connection even on the joiner's host.
#: Measured on the 2-core machine of docs/benchmarks.md ("join"): the ring copies a byte for
#: what tcp costs, but its set-up (a segment made, then mapped and faulted in on both sides:
#: 0.2-0.3 s per 32 MiB ring under load) made it 2.3x slower than tcp at 64 MiB of state
#: (21 MiB stripes) and 1.5x at 256 MiB (85 MiB), and as fast at 1 GiB (341 MiB); on a host
#: with cores to spare it should pull ahead (every donor copies on its own core, no single
#: thread receives it all)
RING_MIN = 128 << 20
#: ``DataPath(shm=...)``'s forced shared-memory algorithms
_SHM_VARIANTS = tuple(n[4:] for n in SHM_NAMES if n != "shm")


@dataclass(frozen=True)
class Switches:
    """The environment's say in routes, read once (:meth:`from_env`)."""

    #: ``ASYNCCOLL_SHM`` (default on): whether a default may choose shared memory
    shm: bool = True
    #: ``ASYNCCOLL_CMA`` (default on): whether the single-copy allreduce may be tried
    cma: bool = True
    #: ``ASYNCCOLL_JOIN_RING_MIN`` (bytes, default :data:`RING_MIN`): the smallest stripe of a
    #: joiner's state that goes through a shared-memory ring (:func:`state_route`)
    ring_min: int = RING_MIN

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Switches:
        """The switches of ``env`` (default: this process's environment); for the two
        on/off switches anything but ``0`` is on. Raises ``ValueError`` naming
        ``ASYNCCOLL_JOIN_RING_MIN`` when it is not a byte count >= 0."""
        env = os.environ if env is None else env
        text = env.get("ASYNCCOLL_JOIN_RING_MIN", "").strip()
        try:
            ring_min = RING_MIN if not text else int(text)
        except ValueError:
            ring_min = -1
        if ring_min < 0:
            raise ValueError(f"ASYNCCOLL_JOIN_RING_MIN must be a byte count >= 0, got {text!r}")
        return cls(shm=env.get("ASYNCCOLL_SHM", "1").strip() != "0",
                   cma=env.get("ASYNCCOLL_CMA", "1").strip() != "0", ring_min=ring_min)


@dataclass(frozen=True)
class Layout:
    """Where the ranks are: ``hashes[r]`` is rank r's host (equal on one host), ``token`` the
    job's segment token (equal on every rank)."""

    hashes: tuple[int, ...]
    token: int

    @property
    def groups(self) -> list[list[int]]:
        """The ranks of each host, hosts in the order of their lowest rank (its leader)."""
        return host_groups(self.hashes)

    @property
    def one_host(self) -> bool:
        """Whether every rank is on one host."""
        return len(set(self.hashes)) == 1

    def of_group(self, members: list[int], key: str) -> Layout:
        """The layout of the group ``key`` of ``members`` (ranks of this layout). Its token is
        this one hashed with ``key``: a group's schedule ids count from 1 again and its ranks
        from 0, so its segments need names of their own."""
        d = hashlib.blake2b(f"{self.token}/{key}".encode(), digest_size=8).digest()
        return Layout(tuple(self.hashes[m] for m in members),
                      int.from_bytes(d, "little") >> 1)


def shm_flag(shm: Any) -> bool | None:
    """A handle's ``shm=``: a bool or None only (``shm="no"`` is truthy, ``shm=0`` falsy:
    "automatic", not "never": either would silently mean something else than written);
    ``np.bool_`` made a bool (``np.False_ is False`` is false)."""
    if shm is not None and not isinstance(shm, (bool, np.bool_)):
        raise ValueError(f"shm must be True, False or None, got {shm!r}")
    return None if shm is None else bool(shm)


@dataclass(frozen=True)
class DataPath:
    """The documented override of a partial handle's route (``comm.partial_allreduce(...,
    path=DataPath(...))``); by default the :class:`Router` decides.

    ``shm``: ``None`` (the default): the router's choice (shared memory when every rank is on
    this host, ``like`` is a NumPy array of at least 128 KiB and no ``algorithm`` is named,
    unless ``ASYNCCOLL_SHM=0``; for sparse handles with a split algorithm at any size);
    ``True``: through shared memory (``ValueError`` where it cannot be); ``False``: over the
    network; ``"one_shot"`` or ``"two_shot"``: through shared memory with that algorithm
    forced. ``algorithm``: a network algorithm only: for dense data one of the dense
    allreduce's (``recursive_doubling``, ``ring``, ``rabenseifner``, ...), for sparse handles
    one of SparCML's (``ssar_recursive_double``, ``ssar_split_allgather``,
    ``dsar_split_allgather``); ``None``: chosen by size and P. ``density`` (the expected
    per-rank fraction of nonzeros, to choose the sparse algorithm) and ``delta`` (the switch
    point to dense): sparse handles only. The hierarchical handle is not a path of this one
    (its calls return through each host's leader): ``comm.hier_partial_allreduce``.

    Raises ``ValueError`` naming ``shm`` or ``algorithm`` at construction (a shared-memory or
    ``"hier"`` name given as ``algorithm``, with the spelling to use instead).
    """

    algorithm: str | None = None
    shm: bool | str | None = None
    density: float | None = None
    delta: float | None = None

    def __post_init__(self) -> None:
        a = self.algorithm
        if a is not None and not isinstance(a, str):
            raise ValueError(f"algorithm must be a str or None, got {a!r}")
        if a == HIER:
            raise ValueError("algorithm='hier' is not a network algorithm: the hierarchical "
                             "handle is comm.hier_partial_allreduce(policy, like, ...)")
        if a in SHM_NAMES:
            if self.shm is False:
                raise ValueError(f"algorithm={a!r} goes through shared memory, but shm=False")
            v = "True" if a == "shm" else repr(a[4:])
            raise ValueError(f"algorithm={a!r} is not a network algorithm: give "
                             f"DataPath(shm={v})")
        if isinstance(self.shm, str):
            if self.shm not in _SHM_VARIANTS:
                raise ValueError(f"shm must be True, False or None, or one of "
                                 f"{_SHM_VARIANTS} (a forced algorithm), got {self.shm!r}")
            if a is not None:
                raise ValueError(f"shm={self.shm!r} goes through shared memory, but "
                                 f"algorithm={a!r} names a network one")
        else:
            object.__setattr__(self, "shm", shm_flag(self.shm))

    def router_args(self) -> tuple[str | None, bool | None]:
        """``(algorithm, shm)`` as :meth:`Router.dense_partial` takes them (a forced
        shared-memory algorithm is its ``shm_`` name there)."""
        if isinstance(self.shm, str):
            return f"shm_{self.shm}", None
        return self.algorithm, self.shm


class Router:
    """The route decisions of one communicator (module doc): ``size`` ranks, ``switches``.

    Stateless but for one flag: once a default's shared-memory setup failed on every rank
    alike (:meth:`refuse_shm`), the synchronous allreduce's default stops choosing it.
    """

    def __init__(self, size: int, switches: Switches) -> None:
        self.size = size
        self.switches = switches
        self._shm_default = switches.shm

    def refuse_shm(self) -> None:
        """Every rank learned together that the default's segments cannot be had: from now
        on the default allreduce goes over the network."""
        self._shm_default = False

    @property
    def cma(self) -> bool:
        """Whether the single-copy allreduce may be tried (``ASYNCCOLL_CMA``)."""
        return self.switches.cma

    # -- the synchronous allreduce -----------------------------------------------------------
    def needs_layout(self, nbytes: int, numpy: bool, algorithm: str | None) -> bool:
        """Whether the allreduce's route depends on the host layout (learning it is a
        collective, so a small or named-network call does not ask)."""
        if algorithm is not None:
            return algorithm in SHM_NAMES or algorithm == HIER
        return self._shm_default and self.size > 1 and numpy and nbytes >= SHM_MIN_BYTES

    def allreduce(self, layout: Layout | None, nbytes: int, numpy: bool,
                  algorithm: str | None) -> str:
        """:data:`SHM`, :data:`HIER` or :data:`NETWORK` for an allreduce of ``nbytes``
        (``numpy``: the data is a NumPy array; ``layout`` known when :meth:`needs_layout`
        said so). Asked for by name, shared memory or the hierarchy is always the answer
        (where it cannot be, the setup raises naming why)."""
        if algorithm is not None:
            return SHM if algorithm in SHM_NAMES else HIER if algorithm == HIER else NETWORK
        if layout is None or not self.needs_layout(nbytes, numpy, algorithm):
            return NETWORK
        if layout.one_host:
            return SHM
        return HIER if max(len(g) for g in layout.groups) > 1 else NETWORK

    # -- persistent handles ------------------------------------------------------------------
    def dense_partial(self, layout: Layout | None, like: Any, algorithm: str | None,
                      shm: bool | None) -> tuple[int | None, str | None]:
        """How a new dense partial handle moves its data: ``(token, algorithm)``, ``token``
        the job's segment token when through shared memory (else None: the network) and
        ``algorithm`` the one to build with. The same answer on every rank that has the
        same layout: the free space of the segment directory is not asked here (it differs
        between ranks as they create); a failed creation is agreed by the handle.

        ``shm=None``: through shared memory when every rank is on this host, ``like`` is a
        NumPy array of at least :data:`~asynccoll.collectives.shm.SHM_MIN_BYTES`,
        ``algorithm`` is None and the default is on (``ASYNCCOLL_SHM``); ``algorithm`` one of
        :data:`~asynccoll.collectives.shm.SHM_NAMES` or ``shm=True`` asks for it (every rank on
        one host, NumPy data); ``shm=False`` refuses it. Raises ``ValueError`` naming ``shm``
        or ``algorithm`` when asked for where it cannot be, for an ``shm`` that is not a bool
        or None, and for ``shm=True`` with a network ``algorithm``; ``TypeError`` for data
        that is not a NumPy array."""
        shm = shm_flag(shm)
        asked = algorithm is not None and algorithm in SHM_NAMES
        if shm is False:
            if asked:
                raise ValueError(f"algorithm={algorithm!r} goes through shared memory, but "
                                 "shm=False")
            return None, algorithm
        if not (asked or shm):
            if algorithm is not None or not self.switches.shm or self.size < 2 \
                    or type(like) is not np.ndarray or like.nbytes < SHM_MIN_BYTES \
                    or layout is None or not layout.one_host:
                return None, algorithm
            return layout.token, "shm"
        if shm and algorithm is not None and not asked:
            # else the network algorithm (even a misspelt one) would be dropped in silence
            raise ValueError(f"shm=True goes through shared memory, but algorithm={algorithm!r} "
                             f"names a network one (give one of {SHM_NAMES} or None)")
        if not isinstance(like, np.ndarray):
            raise TypeError("a partial allreduce through shared memory needs NumPy data "
                            f"(shared memory is host memory), got {type(like).__name__}")
        return self._one_host_token(layout, f"shm=True (or algorithm={algorithm!r})"), \
            algorithm if asked else "shm"

    def sparse_partial(self, layout: Layout | None, algorithm: str, asked: str | None,
                       shm: bool | None) -> tuple[str, int | None]:
        """How a new sparse handle (partial or synchronous) moves its data: ``(algorithm,
        token)``, the token the job's segment token when through shared memory (its split
        allgather), else None (the network); no collective, as :meth:`dense_partial`.
        ``algorithm``: the one given (``asked``) or else the chooser's; with ``shm=True`` and
        none given, a split allgather whatever the chooser's preference for the network's
        recursive doubling. ``shm=None``: through shared memory when every rank is on this
        host (known beforehand), the algorithm is one of the split ones and the default is on
        (``ASYNCCOLL_SHM``); ``shm=True`` asks for it (``ValueError`` naming ``shm`` where it
        cannot be); ``shm=False`` refuses it."""
        shm = shm_flag(shm)
        if shm is True and asked is None and algorithm not in SHM_SPARSE_ALGORITHMS:
            algorithm = "ssar_split_allgather"
        if shm is False:
            return algorithm, None
        split = algorithm in SHM_SPARSE_ALGORITHMS
        if shm is None:
            if not split or not self.switches.shm or self.size < 2 or layout is None \
                    or not layout.one_host:
                return algorithm, None
            return algorithm, layout.token
        if not split:
            raise ValueError(f"shm=True: a sparse handle's data goes through shared memory with "
                             f"the split algorithms {SHM_SPARSE_ALGORITHMS} only, not "
                             f"{algorithm!r}")
        return algorithm, self._one_host_token(layout, "shm=True")

    def sparse_allreduce(self, algorithm: str, quantize: int | None) -> bool:
        """Whether a sparse allreduce's first call tries shared memory: the split algorithms
        without quantisation (whose point is fewer bytes on a network), more than one rank,
        not turned off; whether every rank is on this host is learned at that call."""
        return (self.switches.shm and quantize is None and self.size > 1
                and algorithm in SHM_SPARSE_ALGORITHMS)

    def _one_host_token(self, layout: Layout | None, asked: str) -> int:
        """The job's segment token for a handle that asked for shared memory (``asked`` says
        how); ``ValueError`` unless every rank is known to be on this host."""
        if layout is None and self.size == 1:
            from .shm import new_token
            return new_token()
        if layout is None or not layout.one_host:
            why = ("the host layout is not known yet (connect() learns it; else call "
                   "'await comm.sync_clocks()' first)" if layout is None
                   else "the ranks are on several hosts")
            raise ValueError(f"{asked} needs every rank on one host: {why}")
        return layout.token


def state_route(switches: Switches, here: int, joiner: int, nbytes: int, asked: bool,
                read: bool = False) -> str:
    """How a member sends its stripe of ``nbytes`` bytes of a joiner's state (:mod:`.joining`,
    the paths: :mod:`.state_send`). On the joiner's host (its host ``joiner`` is this member's
    ``here``, :func:`~.shm.host_hash`), when the joiner asked for shared memory (``asked``: its
    own ``switches.shm``, sent with its ``GO``) and this member's ``switches.shm`` is on, and
    the stripe is not empty: :data:`READ` (the joiner reads it in place) when the joiner may
    (``read``: its ``ASYNCCOLL_CMA``, with its ``GO``) and this member's ``switches.cma`` is
    on; else :data:`SHM` (a ring, :mod:`.state_ring`) when the stripe has ``switches.ring_min``
    bytes at least. Else :data:`NETWORK`. Only the member decides, so it says which in its
    first frame to the joiner; a read the joiner's kernel refuses, or a ring that cannot be
    made, then takes the next path after all (one warning)."""
    if not (asked and switches.shm and here == joiner and nbytes > 0):
        return NETWORK
    if read and switches.cma:
        return READ
    return SHM if nbytes >= switches.ring_min else NETWORK


def exchange(transport: Transport, sched_id: int, key: int, payload: Any,
             skip: Sequence[int] = ()) -> dict[int, asyncio.Future[Any]]:
    """Send ``payload`` (a few bytes) to every other rank of ``transport`` but ``skip``, keyed
    ``(sched_id, key, 0)``, each straight (no rank forwards another's), and post a receive for
    each of theirs; returns the receives by rank (on the runtime's loop). A lost peer's
    receive fails with :class:`~asynccoll.PeerLostError`."""
    me, P = transport.rank, transport.world_size
    futs = {r: transport.post_recv(r, sched_id, key, 0) for r in range(P)
            if r != me and r not in skip}
    for r in futs:
        transport.post_frame(r, int(Kind.DATA), sched_id, key, 0, payload
                             ).add_done_callback(ignore_outcome)
    return futs


async def agree_flags(transport: Transport, sched_id: int, ok: bool,
                      timeout: float | None, what: str) -> list[int]:
    """Tell every other rank of ``transport`` whether this one could set its path up (``ok``)
    and learn theirs: the ranks that could not, the same list on every rank. One 1-byte
    message to and from each peer, with ``sched_id`` (the caller's own id space: nothing else
    may use it). Raises :class:`~asynccoll.PeerLostError` when a peer is lost meanwhile,
    :class:`~asynccoll.CollectiveTimeoutError` (naming ``what`` and the silent ranks) after
    ``timeout`` seconds."""
    me = transport.rank
    futs = exchange(transport, sched_id, 0, np.array([1 if ok else 0], np.uint8).data.cast("B"))
    failed = [] if ok else [me]
    try:
        done = await asyncio.wait_for(
            asyncio.gather(*futs.values(), return_exceptions=True), timeout)
    except asyncio.TimeoutError:
        silent = sorted(r for r, f in futs.items() if not f.done())
        raise CollectiveTimeoutError(
            f"rank {me}: {what}: ranks {silent} did not say within {timeout} s whether they "
            "could set up its shared memory (every rank must create the handle alike, in the "
            "same order among its handles)") from None
    finally:
        for f in futs.values():
            if not f.done():
                f.cancel()
    for r, msg in zip(futs, done, strict=True):
        if isinstance(msg, BaseException):
            raise msg
        if bytes(msg.payload[:1]) != b"\x01":
            failed.append(r)
    return sorted(failed)
