"""Partial allreduce (solo, majority, two-choice, quorum, deadline) as one persistent schedule.

One rank's schedule, executed again and again by a persistent executor::

    internal start (nop) ──┬──────────────────────────> activation sends (binomial trees)
    [quorum: k of {start,  │                                 ^
      arrivals from all}]  ├─> activated (OR) ─> snapshot ─> allreduce(data [+ meta]) ─> final
    forced (self-message) ─┘        ^
                    activation receives (hypercube dimensions)

* **Activation** (:mod:`.activation`): the rank is activated by its internal start, by a forced
  activation (a message the runtime sends to itself, used by ``flush``), or by the first
  activation message; the messages follow the union of the binomial trees rooted at the
  initiators (P - 1 messages from one initiator), made complete for any P.
* **Fused activation.** When P is a power of two and the data allreduce first exchanges with a
  hypercube neighbour (recursive doubling: ``rank ^ 1``; Rabenseifner: ``rank ^ P/2``), that
  exchange carries the activation: the activation messages along that edge are left out, the
  first data receives are posted when the execution is armed, and the first of them to arrive
  activates the rank (OR with the other triggers, consumable, so a rank is still activated
  once). Every activated rank sends that data at once, so the edge still activates; from one
  initiator P/2 activation messages fewer per execution, and a rank reached along that edge
  is woken by one message instead of two. Other P and algorithms keep the broadcast as is.
* **Initiator set S(e)**: which ranks call :meth:`Executor.start` for execution ``e`` is decided
  by the runtime with :func:`initiators`, a pure function of ``(kind, e, P, seed)`` that every
  rank evaluates identically (stateless per execution, so ranks never need to agree on a
  generator's position): ``solo`` all ranks, ``majority`` one drawn rank, ``two_choice`` two
  distinct drawn ranks (the first to arrive starts it).
* **Quorum(k)**: every rank that arrives calls start, which here does *not* activate: it sends
  an ARRIVAL message to every other rank, and a k-of-P threshold no-op over ``{own start,
  arrivals from the others}`` activates the rank. Every rank receives every arrival and counts
  them itself, so reaching the quorum starts no activation broadcast (nobody needs telling; a
  forced activation by a flush still broadcasts). A coordinator that rotates per execution
  cannot be written as static data without P variants of every op (a persistent schedule has
  fixed peers), and sending arrivals to every potential coordinator costs the same P - 1
  messages per rank as this; so every rank is a coordinator, which also needs no extra hop
  from coordinator to activation. Cost: P - 1 empty messages per arriving rank per execution
  (O(P^2) per execution), fine for the tens of ranks partial collectives are meant for.
* **Deadline(k)**: the quorum's schedule exactly (k of P arrivals activate, quietly); the
  deadline is the runtime's: a waiting call arms a loop timer for :func:`next_deadline`
  seconds, and when it expires before the rank was activated the rank sets ``state[EXPIRED]``
  and forces the execution (the self-message of a flush), whose activation broadcast then
  reaches every rank. The first call of an execution arms the earliest timer, so an execution
  starts at the k-th arrival or a deadline after the first arrival, whichever comes first.
* **Snapshot** (kernel ``partial_snapshot``, in :data:`PARTIAL_KERNELS`): at activation, internal or
  external, the send buffer ``acc`` (fresh data, accumulated stale data, or nothing) is copied
  into the work buffer ``data`` and reset to the identity of ``op``; the small int64 ``state``
  slot counts the local contributions in ``acc`` (``state[COUNT]``), says whether a call is
  waiting with fresh data in it (``state[FRESH]``), whether this rank is flushing
  (``state[FLUSHING]``; not reset by the snapshot) and counts the snapshots taken
  (``state[SNAPSHOTS]``: execution ``e`` has been activated on this rank iff it is ``> e``).
  The kernel writes ``meta[rank] = count``, ``meta[P + rank] = fresh``, ``meta[2P]`` and
  ``meta[3P + 2]`` = the low and high byte of :func:`signature` (:func:`signature_sum` puts
  the sums back together; one byte per slot keeps the sum below 2**24 up to P = 65536) and
  ``meta[2P + 1] = state[FLUSHING]`` (so every rank learns how many ranks
  were flushing), ``meta[3P + 3] = state[PLANNED]`` (how many ranks asked for a flush at their
  next call: :meth:`asynccoll.comm.partial.PartialAllreduce.plan_flush`; not reset by the
  snapshot either) and ``meta[2P + 2 + rank]`` = the arrival stamp of the call waiting in it
  (``state[ARRIVED]``, set by the runtime; 0 when none was). The deadline kind uses the
  same slot (:func:`encode_stamp`): a waiting call's stamp plus :data:`ARRIVAL_MOD` when
  this rank's deadline expired before it was activated (``state[EXPIRED]``: so every rank
  learns whether the timer started the execution), and for a rank without a waiting call its
  latest *late* call (``state[LATE]``: how long after the first arrival of the execution it
  missed it came) as ``LATE_BASE + 2 * state[LATE]``; the signature is XORed with
  ``state[DSIG]`` (the deadline parameters' fingerprint, 0 for other kinds). Every value
  stays an integer below 2**25 that float32 holds exactly. ``meta`` (3P + 4 int64) is
  sum-allreduced with the data (appended to it
  when :func:`packs_meta` says the data's dtype holds it exactly, else separately), so every rank
  learns the same contributors and counts, and ranks that disagree on the collective find out.
* The data allreduce is :func:`~asynccoll.collectives.dense.build_allreduce` (algorithm chosen
  by size and P, or ``algorithm=``), in place on ``data``. On one host the runtime may build
  :func:`asynccoll.collectives.shm.build_shm_partial_allreduce` instead: the same front without the
  activation broadcast (``append_activation_front(broadcast=False)``), the data through
  shared memory, whose first message activates.

The ``final`` op waits for the allreduce(s) only, never for the internal start, the arrival
sends or the activation sends (a rank reached from outside forwards along lower dimensions only,
so some of its sends never fire): an execution activated from outside completes without them.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..buffers import dtype_to_wire, host_to_like
from ..sched import BUILTIN_KERNELS, Schedule, SlotSpec
from ._plan import check_op
from .activation import TAGS_USED, add_triggers, build_activation
from .dense import build_allreduce, first_partner, next_tag
from .select import choose_allreduce

__all__ = [
    "ARRIVAL_KINDS",
    "CallRule",
    "SHM_ATTACH",
    "activation",
    "call_rule",
    "late_mark",
    "ARRIVAL_MOD",
    "ARRIVED",
    "COUNT",
    "DEFAULT_DEADLINE",
    "DEFAULT_DEADLINE_WINDOW",
    "DEFAULT_MAD_FACTOR",
    "DSIG",
    "EXPIRED",
    "FLUSHING",
    "PLANNED",
    "FRESH",
    "KINDS",
    "LATE",
    "PARTIAL_KERNELS",
    "SNAPSHOTS",
    "STATE_LEN",
    "TAG_ACTIVATION",
    "TAG_ARRIVAL",
    "TAG_DATA",
    "TAG_FORCE",
    "append_activation_front",
    "DeadlineConfig",
    "arrival_spread",
    "arrival_stamp",
    "build_partial_allreduce",
    "check_deadline",
    "check_kind",
    "deadline_signature",
    "decode_arrivals",
    "LATE_BASE",
    "decode_expired",
    "decode_late",
    "encode_stamp",
    "first_stamp",
    "late_offset",
    "identity",
    "initiators",
    "meta_len",
    "next_deadline",
    "packs_meta",
    "signature_sum",
    "signature",
    "write_meta",
]

#: the kernel of a partial allreduce whose data goes through shared memory that maps the peers'
#: segments the first time (the handle's, :class:`asynccoll.comm.shm.PartialSegments`): named
#: here, where the schedules are built, and registered by the runtime
SHM_ATTACH = "partial_shm_attach"

#: the partial allreduce kinds, by the name of their initiator set.
KINDS: tuple[str, ...] = ("solo", "majority", "two_choice", "quorum", "deadline")

#: the kinds whose execution starts on k-of-P arrivals (every rank announces its arrival)
ARRIVAL_KINDS: tuple[str, ...] = ("quorum", "deadline")

#: indices of the ``state`` slot (int64).
COUNT, FRESH, SNAPSHOTS, FLUSHING, ARRIVED, LATE, EXPIRED, DSIG, PLANNED = range(9)
STATE_LEN = 9

#: tags: quorum arrivals, forced (self) activation, the activation broadcast (it uses
#: ``TAGS_USED`` tags from ``TAG_ACTIVATION``); the data allreduce from ``TAG_DATA``.
TAG_ARRIVAL, TAG_FORCE, TAG_ACTIVATION = 0, 1, 2
TAG_DATA = TAG_ACTIVATION + TAGS_USED


def check_kind(kind: str, world_size: int, quorum: int | None) -> int | None:
    """Validate ``kind`` and ``quorum``; return the quorum size (``None`` for kinds without).

    ``quorum`` is required for ``"quorum"`` and optional for ``"deadline"`` (default
    ``world_size``: every rank, or the deadline). Raises ``ValueError`` naming ``kind``
    (unknown) or ``quorum`` (missing for ``"quorum"``, given for a kind without one, or
    outside ``1..world_size``).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind not in ARRIVAL_KINDS:
        if quorum is not None:
            raise ValueError(f"quorum is only meaningful for kind='quorum' or 'deadline', "
                             f"got kind={kind!r}")
        return None
    if quorum is None and kind == "deadline":
        return world_size
    if quorum is None or isinstance(quorum, bool) or not isinstance(quorum, (int, np.integer)):
        raise ValueError(f"quorum must be an int in 1..{world_size} for kind={kind!r}, "
                         f"got {quorum!r}")
    if not 1 <= quorum <= world_size:
        raise ValueError(f"quorum must be in 1..{world_size}, got {quorum}")
    return int(quorum)


def identity(op: str, dtype: Any) -> Any:
    """The neutral element of ``op`` for ``dtype``: what an empty send buffer holds.

    ``sum`` 0, ``prod`` 1, ``min`` the largest value (``inf`` for floats), ``max`` the
    smallest; for ``bool`` the logical forms (OR: False, AND: True).
    """
    dt = np.dtype(dtype)
    check_op(op)
    if dt == np.bool_:
        return op in ("prod", "min")
    if op == "sum":
        return dt.type(0)
    if op == "prod":
        return dt.type(1)
    big: Any
    if dt.kind in "fc":
        big = np.inf if dt.kind == "f" else complex(np.inf, np.inf)
    else:
        big = np.iinfo(dt).max if op == "min" else np.iinfo(dt).min
        return dt.type(big)
    return dt.type(big if op == "min" else -big)


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """The splitmix64 finaliser: a fixed, platform-independent 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _draw(seed: int, execution: int, i: int) -> int:
    return _mix64(_mix64(_mix64(seed & _M64) ^ (execution & _M64)) ^ i)


class CallRule(NamedTuple):
    """What a call of a partial handle does (rules 1 and 2 of :mod:`asynccoll.comm.partial`),
    decided by :func:`call_rule`; the runtime and the simulator (:mod:`asynccoll.sim.handle`)
    both follow it, so a rule changed here changes in both."""

    #: rule 1: a result completed since the last one given: the call returns it at once
    answer_now: bool
    #: rule 1: how many results the one returned folds in (accumulating) or supersedes
    missed: int
    #: rule 2: the execution the call takes part in (rule 1: the one whose result it returns)
    execution: int
    #: the call's data cannot be in that execution: rule 1, or rule 2's corner case (the
    #: execution was activated here from outside before the data came)
    late: bool


def call_rule(kept: int, given: int, snapshots: int) -> CallRule:
    """The rule for a call on a rank whose latest kept result is execution ``kept``, whose
    last result given was execution ``given``, and which has taken ``snapshots`` snapshots."""
    if kept > given:
        return CallRule(True, kept - given, kept, True)
    cur = kept + 1
    return CallRule(False, 0, cur, snapshots > cur)


def activation(initiator: bool, flushing: bool) -> str | None:
    """How a call of rule 2 whose data is in its execution activates it: ``"force"`` while
    some rank is flushing (it will never call again, so S(e) may never come), ``"start"`` when
    this rank is an initiator (``initiator``: in S(e), or an arrival kind, whose start
    announces the arrival), else None (it waits for an external activation)."""
    if flushing:
        return "force"
    return "start" if initiator else None


def late_mark(current: int, stamp: int, first: int) -> int:
    """The deadline kind's ``LATE`` state after a call stamped ``stamp`` missed the execution
    whose first arrival was stamped ``first`` (0: none known: nothing to record): the
    latest, or largest, lateness wins."""
    return max(current, late_offset(stamp, first)) if first else current


def initiators(kind: str, execution: int, world_size: int, seed: int = 0) -> frozenset[int]:
    """The initiator set S(e): the ranks whose call starts execution ``execution``.

    A pure function of its arguments (every rank computes the same set without communicating,
    and without a generator whose position ranks would have to agree on): ``solo`` and
    ``quorum`` and ``deadline`` (where start means "announce arrival") all ranks;
    ``majority`` one rank and
    ``two_choice`` two distinct ranks (one when P = 1), drawn uniformly by a 64-bit hash of
    ``(seed, execution)``. Costs a few integer operations.
    """
    if kind in ("solo", *ARRIVAL_KINDS):
        return frozenset(range(world_size))
    a = _draw(seed, execution, 0) % world_size
    if kind == "majority":
        return frozenset((a,))
    if kind != "two_choice":
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if world_size == 1:
        return frozenset((0,))
    b = _draw(seed, execution, 1) % (world_size - 1)
    return frozenset((a, b + 1 if b >= a else b))


def meta_len(world_size: int) -> int:
    """Length of the meta vector: P counts, P fresh flags, the signature's low byte, the
    flushing count, P arrival stamps (:func:`arrival_stamp`, :func:`encode_stamp`; 0: no call
    was waiting), the signature's high byte, the count of ranks that planned a flush."""
    return 3 * world_size + 4


def signature_sum(meta: Any, world_size: int) -> int:
    """The sum over the ranks of the signatures they wrote (:func:`write_meta`) in an
    allreduced meta vector: ``world_size`` times one's own when the ranks agree."""
    return int(meta[2 * world_size]) + 256 * int(meta[3 * world_size + 2])


#: arrival stamps are microseconds modulo this (8.4 s): small integers that float32 data,
#: which may carry the meta vector, holds exactly; differences are read modulo it
ARRIVAL_MOD = 1 << 23

#: a stamp slot above this holds a late call's offset (:func:`encode_stamp`), in steps of two
#: (float32 holds the even integers up to 2**25 exactly)
LATE_BASE = 1 << 24


def arrival_stamp(now: float) -> int:
    """The stamp of a call that arrives at ``now`` (``time.time()``): 1 .. ARRIVAL_MOD."""
    return int(now * 1e6) % ARRIVAL_MOD + 1


def encode_stamp(fresh: bool, arrived: int, expired: bool, late: int) -> int:
    """What a rank's snapshot writes in its stamp slot of the meta vector.

    With a waiting call (``fresh``): its stamp ``arrived`` (1 .. ARRIVAL_MOD), plus
    :data:`ARRIVAL_MOD` when this rank's deadline expired before it was activated. Without
    one: ``LATE_BASE + 2 * late`` for a late call's :func:`late_offset` ``late`` (> 0), else
    0. Every value is an integer below 2**25 that float32 holds exactly.
    """
    if fresh:
        return int(arrived) + (ARRIVAL_MOD if expired else 0)
    return LATE_BASE + 2 * int(late) if late > 0 else 0


def _arrived(stamps: Any) -> np.ndarray:
    s = np.asarray(stamps).astype(np.int64)
    return np.where(s > ARRIVAL_MOD, s - ARRIVAL_MOD, s) * (s <= LATE_BASE)


def decode_expired(stamps: Any) -> frozenset[int]:
    """The ranks whose deadline expired before they were activated, from the allreduced
    stamp slots (:func:`encode_stamp`)."""
    s = np.asarray(stamps)
    return frozenset(np.flatnonzero((s > ARRIVAL_MOD) & (s <= LATE_BASE)).tolist())


def decode_late(stamps: Any) -> dict[int, float]:
    """Rank -> seconds a late call came after the first arrival of the execution it missed,
    from the allreduced stamp slots (:func:`encode_stamp`)."""
    s = np.asarray(stamps).astype(np.int64)
    got = np.flatnonzero(s > LATE_BASE)
    return {int(r): float(((int(s[r]) - LATE_BASE) // 2 - 1) * 2) / 1e6 for r in got.tolist()}


def decode_arrivals(stamps: Any) -> dict[int, float]:
    """Rank -> seconds after the first arrival, for the ``stamps`` (P of them, as allreduced)
    that hold a waiting call's arrival (:func:`encode_stamp`): differences are taken modulo
    :data:`ARRIVAL_MOD`, so calls within about 4 s of one another are ordered right."""
    stamps = _arrived(stamps)
    got = np.flatnonzero(stamps)
    if not got.size:
        return {}
    half = ARRIVAL_MOD // 2
    rel = (stamps[got] - int(stamps[got[0]]) + half) % ARRIVAL_MOD - half
    rel -= rel.min()
    return {int(r): float(t) / 1e6 for r, t in zip(got.tolist(), rel.tolist(), strict=True)}


def first_stamp(stamps: Any) -> int:
    """The arrival stamp of the first waiting call among the allreduced ``stamps`` (0: none),
    what :func:`late_offset` measures late calls from."""
    rel = decode_arrivals(stamps)
    if not rel:
        return 0
    r0 = min(rel, key=lambda r: (rel[r], r))
    return int(_arrived(stamps)[r0])


def late_offset(stamp: int, first: int) -> int:
    """``state[LATE]`` for a call stamped ``stamp`` that missed an execution whose first
    arrival was stamped ``first`` (:func:`arrival_stamp` both): half the microseconds after
    it, plus 1 (0 is "none"), the difference read modulo :data:`ARRIVAL_MOD`."""
    return ((stamp - first) % ARRIVAL_MOD) // 2 + 1


def arrival_spread(meta: Any, world_size: int, quorum: int) -> float | None:
    """The arrival spread of one completed execution, from its allreduced ``meta``: seconds
    from the first arrival to the ``quorum``-th (k-th) one (the last one known when fewer are).

    The arrivals known are the waiting calls' (the arrival stamps: :func:`decode_arrivals`)
    and the late calls reported in this execution (the late slots: calls that missed an
    earlier execution, usually the previous one, by that many seconds after its first
    arrival; :func:`decode_late`). Late calls make the spread exceed a deadline that cut them
    off, so the deadline can grow. ``None`` when the meta holds no arrival. A pure function
    of the allreduced meta: every rank gets the same value.
    """
    stamps = meta[2 * world_size + 2:3 * world_size + 2]
    offsets = [*decode_arrivals(stamps).values(), *decode_late(stamps).values()]
    if not offsets:
        return None
    offsets.sort()
    return offsets[min(quorum, len(offsets)) - 1]


def next_deadline(spreads: Sequence[float], m: float, lo: float, hi: float) -> float:
    """The deadline of the next execution: ``median + m * MAD`` of ``spreads``, within
    ``[lo, hi]``.

    ``spreads``: the arrival spreads (seconds from an execution's first arrival to its k-th,
    :func:`arrival_spread`) of a window of recent executions, oldest first; ``m``: how many
    median absolute deviations (unscaled: ``median(|s - median(s)|)``) above the median to
    wait; ``lo <= hi``: the bounds, in seconds. With no spreads yet, ``hi`` (the most
    patient deadline). A pure function of its arguments, so every rank (and the simulator)
    that holds the same spreads computes the same deadline. Raises ``ValueError`` naming
    ``m`` (negative or NaN) or ``lo``/``hi`` (unless ``0 <= lo <= hi``). Costs O(n log n) for
    n spreads.

    >>> next_deadline([0.010, 0.012, 0.011, 0.050], 2.0, 0.001, 1.0)
    0.0135
    >>> next_deadline([], 3.0, 0.001, 1.0)
    1.0
    """
    if not m >= 0:
        raise ValueError(f"m must be >= 0, got {m!r}")
    if not 0 <= lo <= hi:
        raise ValueError(f"lo and hi must satisfy 0 <= lo <= hi, got lo={lo!r}, hi={hi!r}")
    if not spreads:
        return float(hi)
    med = statistics.median(spreads)
    mad = statistics.median(abs(x - med) for x in spreads)
    return float(min(max(med + m * mad, lo), hi))


#: ``deadline=(lo, hi)`` seconds, ``mad_factor`` m and the window of executions by default
DEFAULT_DEADLINE: tuple[float, float] = (0.001, 1.0)
DEFAULT_MAD_FACTOR = 3.0
DEFAULT_DEADLINE_WINDOW = 16


class DeadlineConfig(NamedTuple):
    """The validated parameters of a ``deadline`` partial allreduce (:func:`check_deadline`):
    the bounds ``lo <= hi`` in seconds, the MAD factor ``m``, the ``window`` of executions
    whose spreads feed :func:`next_deadline`."""

    lo: float
    hi: float
    m: float
    window: int


def check_deadline(kind: str, deadline: float | tuple[float, float] | None,
                   mad_factor: float | None, deadline_window: int | None) -> DeadlineConfig | None:
    """Validate the deadline parameters for ``kind``; ``None`` unless ``kind == "deadline"``.

    ``deadline``: ``(lo, hi)`` seconds with ``0 <= lo <= hi`` (the adaptive deadline's bounds)
    or one number (a fixed deadline, ``lo == hi``); default :data:`DEFAULT_DEADLINE`.
    ``mad_factor``: ``m >= 0`` (default :data:`DEFAULT_MAD_FACTOR`); ``deadline_window``: an
    int >= 1 (default :data:`DEFAULT_DEADLINE_WINDOW`). Raises ``ValueError`` naming
    ``deadline``, ``mad_factor`` or ``deadline_window``, also when one is given for another
    kind.
    """
    if kind != "deadline":
        for arg, v in (("deadline", deadline), ("mad_factor", mad_factor),
                       ("deadline_window", deadline_window)):
            if v is not None:
                raise ValueError(f"{arg} is only meaningful for kind='deadline', "
                                 f"got kind={kind!r}")
        return None
    d = DEFAULT_DEADLINE if deadline is None else deadline
    pair: tuple[Any, ...] = tuple(d) if isinstance(d, (tuple, list)) else (d, d)
    if len(pair) != 2 or not all(_is_real(x) for x in pair):
        raise ValueError(f"deadline must be seconds or a pair (lo, hi) of seconds, got "
                         f"{deadline!r}")
    lo, hi = float(pair[0]), float(pair[1])
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo < 0 or lo > hi:
        raise ValueError(f"deadline must be (lo, hi) with 0 <= lo <= hi, finite, got "
                         f"{deadline!r}")
    m = DEFAULT_MAD_FACTOR if mad_factor is None else mad_factor
    if not _is_real(m) or not math.isfinite(float(m)) or float(m) < 0:
        raise ValueError(f"mad_factor must be a finite number >= 0, got {mad_factor!r}")
    w = DEFAULT_DEADLINE_WINDOW if deadline_window is None else deadline_window
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
        raise ValueError(f"deadline_window must be an int >= 1, got {deadline_window!r}")
    return DeadlineConfig(lo, hi, float(m), int(w))


def _is_real(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating))


def deadline_signature(config: DeadlineConfig | None) -> int:
    """A 16-bit fingerprint of the deadline parameters (0 for ``None``): each rank's snapshot
    XORs it into the signature it adds to the meta vector, so ranks that disagree on them
    find out."""
    if config is None:
        return 0
    text = f"{config.lo!r}|{config.hi!r}|{config.m!r}|{config.window}"
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return (int.from_bytes(digest, "little") & 0xFFFF) or 1


def packs_meta(dtype: Any, op: str, world_size: int) -> bool:
    """Whether the meta vector rides at the end of the data allreduce (one allreduce, not two).

    Only for sums of dtypes that hold the meta's small integers and their sums exactly: 32- and
    64-bit integers, float64 and complex128, and float32/complex64 (exact to 2**24) up to
    P = 65536: every slot but the signature's two and the flushing count has one rank's value
    (below 2**25, even above 2**24), and those sum at most P * 255. Packed, a partial allreduce
    is one allreduce instead of two (at P = 1024 and small sizes: 10 rounds of recursive
    doubling, not 20).
    """
    dt = np.dtype(dtype)
    if op != "sum" or dt.itemsize < 4 or dt.kind not in "iufc":
        return False
    return dt.kind in "iu" or dt.itemsize >= (16 if dt.kind == "c" else 8) \
        or world_size <= 1 << 16


def signature(kind: str, op: str, quorum: int | None, count: int, dtype: Any,
              algorithm: str | None) -> int:
    """A 16-bit fingerprint of a partial allreduce's definition.

    Each rank adds its own to the meta allreduce; a sum other than P times one's own shows that
    the ranks disagree on the collective (kind, op, quorum, ...) behind one schedule id.
    """
    text = f"{kind}|{op}|{quorum}|{count}|{np.dtype(dtype).str}|{algorithm}"
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0xFFFF


def append_activation_front(s: Schedule, quorum: int | None, fused: int | None = None, *,
                            broadcast: bool = True) -> int:
    """Append what activates an execution (module doc) to ``s``; return the ``activated`` op.

    The internal start (op 0 when ``s`` is empty: the runtime's :meth:`Executor.start`), the
    forced activation (a self-message on :data:`TAG_FORCE`), the quorum's arrivals when
    ``quorum`` is given (:data:`TAG_ARRIVAL`), and the activation broadcast from
    :data:`TAG_ACTIVATION`; the data collective starts from :data:`TAG_DATA`. Shared by the
    dense and the sparse partial allreduce. ``fused``: the partner whose first data message
    activates this rank instead of an activation message (see
    :func:`~asynccoll.collectives.activation.build_activation`). ``broadcast=False`` leaves the
    activation broadcast out: ``activated`` is then the OR of the internal start (or the
    quorum) and the forced activation, and the caller must add the receives that activate a
    rank reached from outside (:func:`~asynccoll.collectives.activation.add_triggers`; the
    shared-memory data phase's "written" messages, which every activated rank sends to every
    other rank).
    """
    rank, world_size = s.rank, s.world_size
    start = s.nop(label="internal start")
    forced = s.recv(rank, None, TAG_FORCE, msg="activation", label="forced activation")
    triggers = [forced]
    if quorum is None:
        triggers.append(start)
    else:
        others = [q for q in range(world_size) if q != rank]
        arrivals = [s.recv(q, None, TAG_ARRIVAL, msg="activation", label="arrival in")
                    for q in others]
        for q in others:
            s.send(q, None, TAG_ARRIVAL, deps=start, msg="activation", label="arrival out")
        # every rank counts the arrivals itself, so reaching the quorum activates this rank
        # without an activation broadcast (which only a forced activation still starts)
        reached = s.nop(deps=[start, *arrivals], k=quorum,
                        label=f"quorum {quorum} of {world_size}")
        if not broadcast:
            return s.nop(deps=[*triggers, reached], k=1, label="activated")
        return build_activation(s, triggers, tag=TAG_ACTIVATION, fused=fused,
                                quiet=[reached]).activated
    if not broadcast:
        return s.nop(deps=triggers, k=1, label="activated")
    return build_activation(s, triggers, tag=TAG_ACTIVATION, fused=fused).activated


def write_meta(meta: Any, state: Any, params: Mapping[str, Any]) -> None:
    """Fill ``meta`` from ``state`` at a snapshot (module doc) and reset the per-execution
    state: ``params`` holds ``rank``, ``world_size`` and ``sig``."""
    rank, p = params["rank"], params["world_size"]
    meta.fill(0)
    meta[rank] = state[COUNT]
    meta[p + rank] = state[FRESH]
    sig = params["sig"] ^ int(state[DSIG])
    meta[2 * p] = sig & 0xFF
    meta[3 * p + 2] = sig >> 8
    meta[2 * p + 1] = state[FLUSHING]
    meta[3 * p + 3] = state[PLANNED]
    meta[2 * p + 2 + rank] = encode_stamp(bool(state[FRESH]), state[ARRIVED],
                                          bool(state[EXPIRED]), state[LATE])
    state[COUNT] = 0
    state[FRESH] = 0
    state[LATE] = 0
    state[EXPIRED] = 0
    state[SNAPSHOTS] += 1


def build_partial_allreduce(rank: int, world_size: int, count: int, dtype: Any, *,
                            kind: str = "solo", op: str = "sum", quorum: int | None = None,
                            algorithm: str | None = None) -> Schedule:
    """The committed persistent schedule of one rank of a partial allreduce (module doc).

    Slots to bind: ``acc`` (``count`` elements of ``dtype``: the send buffer), ``data`` (the
    work buffer: ``count`` elements, plus :func:`meta_len` when :func:`packs_meta`; the result
    is its first ``count``), ``meta`` (:func:`meta_len` int64), ``state``
    (:data:`STATE_LEN` int64, zero at first), and the dense builders' scratch slots
    (:func:`~asynccoll.collectives.dense.scratch_buffers`). Raises ``ValueError`` naming a bad
    ``kind``, ``quorum``, ``op``, ``algorithm``, ``count`` or ``dtype``.
    """
    k = check_kind(kind, world_size, quorum)
    check_op(op)
    dt = np.dtype(dtype)
    s = Schedule(rank, world_size, name=f"partial_allreduce.{kind}")
    wire = dtype_to_wire(dt)
    packed = packs_meta(dt, op, world_size)
    m = meta_len(world_size)
    s.declare("acc", SlotSpec(count, wire))
    s.declare("data", SlotSpec(count + (m if packed else 0), wire))
    s.declare("meta", SlotSpec(m, "<i8"))
    s.declare("state", SlotSpec(STATE_LEN, "<i8"))
    n = count + (m if packed else 0)
    algo = algorithm or choose_allreduce(world_size, n * dt.itemsize)
    fused = first_partner(rank, world_size, n, algo)
    activated = append_activation_front(s, k, fused)
    sig = signature(kind, op, quorum, count, dt, algorithm)
    snap = s.compute("partial_snapshot", ["acc", "data", "meta", "state"], deps=activated,
                     label="snapshot", rank=rank, world_size=world_size, op=op, sig=sig,
                     packed=packed, count=count)
    first = len(s.ops)
    done = [build_allreduce(s, n, dt, op, algo, slot="data", tag_base=TAG_DATA, after=[snap],
                            source_first_recvs=fused is not None)]
    if fused is not None:  # the partner's first data message activates this rank
        data_in = [i for i in range(first, len(s.ops))
                   if s.ops[i].kind == "recv" and not s.ops[i].deps]
        # without them the dropped activation edge would leave this rank unreachable
        assert data_in, (rank, fused)
        assert all(s.ops[i].peer == fused for i in data_in), (rank, fused)
        add_triggers(s, activated, data_in)
    return commit_partial(s, done, snap, {"kind": kind, "op": op, "quorum": k,
                                          "count": count, "dtype": wire, "packed": packed},
                          PARTIAL_KERNELS)


def commit_partial(s: Schedule, done: list[int], snap: int, meta: dict[str, Any],
                   kernels: Iterable[str]) -> Schedule:
    """The tail every partial allreduce builder shares: the meta vector's own allreduce after
    the snapshot ``snap`` unless it rides packed in the data, the final op after ``done``, the
    ``partial`` description ``meta`` (``packed``, the meta length from ``s``'s "meta" slot),
    and the commit with ``kernels`` (what :meth:`Schedule.commit` takes)."""
    if not meta["packed"]:
        m = s.slots["meta"].count
        assert m is not None
        done.append(build_allreduce(s, m, np.int64, "sum", None, slot="meta",
                                    scratch_prefix="meta_", tag_base=next_tag(s),
                                    after=[snap]))
    s.final = s.nop(deps=done, label="final")
    s.meta["partial"] = meta
    return s.commit(kernels)


def _snapshot(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
              msgs: Sequence[Any]) -> None:
    """Move the send buffer into the work buffer and reset it; record who contributes what.

    It writes its inputs (``acc``, ``data``, ``meta``, ``state``) and has no output, so the
    executor never offloads it to a thread; the runtime adds calls' data to ``acc`` under a
    lock that a partial handle also holds around this kernel (:mod:`asynccoll.comm.partial`).
    Cost: one copy and one fill of ``count`` elements.
    """
    acc, data, meta, state = inputs
    n = params["count"]
    data[:n] = acc
    acc.fill(identity(params["op"], acc.dtype))
    write_meta(meta, state, params)
    if params["packed"]:
        # small integers: exact in the data's dtype (see packs_meta); the meta vector lives on
        # the host, the data on the device where it is a CuPy array
        data[n:] = host_to_like(meta, data)


#: the kernels a partial allreduce schedule names: the built-ins and ``partial_snapshot``
#: (frozen; pass it, or a registry that extends it, to the executor)
PARTIAL_KERNELS = BUILTIN_KERNELS.extended({"partial_snapshot": _snapshot}).freeze()
