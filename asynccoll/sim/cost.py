"""The simulator's cost model: link classes, per-op CPU cost, reduction throughput.

A :class:`Profile` prices everything a schedule does, in seconds of virtual time:

* a **message** of n bytes from rank a to rank b leaves a's network interface after
  ``n * beta`` (a rank's sends are serialised on its interface, which is how a rank that sends
  P - 1 arrival messages pays for them) and arrives ``alpha`` later; ``alpha`` and ``beta`` come
  from the link class, ``intra`` when a and b share a host (``ranks_per_host`` consecutive ranks
  per host), ``inter`` otherwise; a message to oneself costs no wire time;
* every **op** costs ``gamma`` seconds of the rank's CPU when it fires (a send's post, a
  receive's completion, a kernel's call; no-ops are free), and a compute op adds its output
  bytes divided by ``reduce_bps``;
* a **call** of a collective costs ``call_overhead`` to enter the runtime and leave it (the
  progress thread's hop), half on each side;
* a rank's CPU work is **serialised** (one op at a time);
* when more ranks share a host than it has ``cores`` (``bench/sim_validate.py``'s case: P = 4
  and 8 on this 2-core machine), two models, chosen by :meth:`Profile.placed`:

  - **the pool** (``pool``, the default where calibrated): the host's ``cores`` are a pool,
    and every piece of a rank's CPU work (an op, a message's receipt, the call overhead) runs
    on one of them once the rank's earlier work is done: on the core free latest before it
    could start, else on the first to free (:meth:`~asynccoll.sim.engine.SimWorld.charge`; in
    the order the simulator books work, which is its event order but for the completions it
    handles as they fire). A rank with nothing to do costs nothing, so staggered ranks find
    idle cores and ranks that all work at once queue. A message between two ranks of such a
    host is CPU work at its receiver, booked from its arrival: ``msg_cpu`` plus its bytes
    times the intra-host ``beta``, arriving after the intra-host ``alpha`` (0 as calibrated).
    ``msg_cpu`` and that ``beta`` are not the two-process figures: they are fitted, as the
    shared figures below, so that the simulated world of ``2 * cores`` ranks takes what the
    real one took per barrier and per large allreduce
    (:func:`asynccoll.sim.calibrate.fit_pool`): on this machine 133-151 µs of CPU per message,
    twice the two-process ``alpha``, which is what a wake-up on a time-shared core costs (our
    reading: the context switches and the caches they empty; a pool priced with the
    two-process figures predicted every benchmark 40-50 % too fast). The exit waves below come out
    of the pool by themselves. A message's bytes do not cost the same per byte at every size:
    between two processes here a 512 KiB message cost 0.18-0.23 ns per byte above the 4-byte
    call and a 1 MiB one 0.29-0.35 (our reading: a message that fits in the socket's buffer is
    taken in one wake-up, a larger one in several). ``byte_shape`` keeps the two-process cost per
    byte at the message sizes calibration measured, and a pooled message of n bytes costs
    ``msg_cpu + n * beta * byte_factor(n)`` (:meth:`Profile.byte_factor`: that cost relative to
    the largest size measured, at most 1; ``beta`` is fitted with it, so it is the figure of the
    largest messages; the shape is the pool's alone: a dedicated link keeps one ``beta``).
    Without the shape a 1 MiB allreduce at P = 4 (256 and 512 KiB messages) was predicted
    26-74 % too slow in 10 of 12 runs (docs/sim.md).
    A message also costs more at a receiver that has been **idle** a while: processes on two
    cores passing a token around a ring (2, 4 and 8 of them) paid 125-160 µs more per hop
    when every rank had idled 3 ms first than back to back, not only at the first hop: every
    rank the token reaches has idled (``bench/wake.py``: a raw asyncio ring paid a fifth to
    two thirds of what asynccoll paid, in two runs of three; our reading: idle virtual CPUs
    halt and caches go cold, and asynccoll's longer path per hop pays more for it). With the
    pool, a receipt at a rank whose last CPU work ended ``idle`` seconds before the message
    arrived (a message that waits for its receive to be posted: before it came) costs
    :meth:`Profile.wake_extra` more: :attr:`Profile.wake_cpu` (fitted on such a ring by
    calibration) times a ramp from :data:`WAKE_FROM` to :data:`WAKE_FULL`; so does a call,
    which wakes the rank's progress thread (:func:`~asynccoll.sim.run.simulate`'s calls; the
    compute phase before a call is idle time: right for a sleep or a GPU's kernels, not for a
    CPU-bound step). Back-to-back collectives (the pool's fits) idle less than
    :data:`WAKE_FROM` at P = 4 on this machine; ranks that wait for a straggler idle longer.
  - **the scale** (``"shared"``, and the only one for profiles without the pool's figures):
    every CPU cost, the intra-host ``alpha`` and ``beta`` (between processes of one host a
    message is CPU work: the kernel's and the runtime's, no wire) and the call overhead are
    multiplied by ``ranks_per_host / cores``. Coarse: it assumes every rank works at once.
    With the time-shared figures below it predicted the dense allreduce well and staggered
    arrivals (``bench/skew.py``) too slow.
* **time-shared cores** (``shared``, a :class:`SharedCores`): when the ranks outnumber the
  cores, every wake-up is a context switch (not an idle core's), and what a message costs is
  not the two-process figure times the scale: on this 2-core machine, quiet, a P = 4
  allreduce took 1.5-1.8x what the scaled two-process figures price. So when
  ``ranks_per_host > cores``, :meth:`Profile.placed` prices the intra-host link with the
  ``alpha`` and ``beta`` that ``asynccoll sim calibrate`` fitted in a world of ``2 * cores``
  ranks (the simulated barrier and large allreduce take what the real ones took there; the
  scale still multiplies them). And ranks time-sharing cores **leave a collective in waves**:
  its last messages make every rank runnable at once, but only ``cores`` of them run at a
  time, each until it blocks again; the ``k``-th wave leaves ``k * exit_gap`` after the first
  (:meth:`Profile.exit_offsets`), where the scaled model has them all leave together. A
  benchmark that times each call from its rank's exit of a barrier sees the first rank out
  wait for the last one inside the call: on this machine 20-45 % of a dense allreduce's
  measured time at P = 4 and 8. ``exit_gap`` is measured in the same world (the median
  spread of its ranks' exits from a barrier: one gap at ``2 * cores`` ranks).

The model is LogGP-like without its gap term: the paper figures it is fitted to (small-message
latency, large-message bandwidth, per-call software overhead) are what users can find for their
machine; :func:`asynccoll.sim.calibrate.calibrate` measures them here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["WAKE_FROM", "WAKE_FULL", "LinkClass", "Profile", "SharedCores"]

#: with the pool, a receiver idle for longer than this many seconds pays part of the wake-up
#: figure (:attr:`Profile.wake_cpu`), and from :data:`WAKE_FULL` all of it. Where the ramp lies
#: was read off this machine: two processes on two cores passing a token back and forth took
#: the same per hop after 0.3 and 1 ms of idling as back to back, four 22 % and 68 % longer
#: (each of them waits three hops, about 0.4 ms, even back to back), and 2, 4 and 8 processes
#: 125-160 µs more per hop after 3 ms (docs/sim.md, "Waking an idle rank")
WAKE_FROM = 0.5e-3
WAKE_FULL = 3e-3


@dataclass(frozen=True)
class LinkClass:
    """One class of links: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")


@dataclass(frozen=True)
class SharedCores:
    """What a host's ranks cost when they outnumber its cores (module doc), measured in a world
    of ``world`` ranks on one host: ``alpha`` and ``beta`` of the intra-host link, per unit of
    ``ranks_per_host / cores`` as the scaled model uses them, and ``exit_gap``, the seconds
    between one wave of ranks leaving a collective and the next."""

    alpha: float
    beta: float
    exit_gap: float
    world: int = 0
    #: the pool's figures, fitted in the same world (module doc): CPU seconds per message and
    #: per byte at the receiver; 0: not measured (older profiles: the scaled model only)
    msg_cpu: float = 0.0
    byte_cpu: float = 0.0
    #: the pool's wake-up figure, fitted in the same world (:attr:`Profile.wake_cpu`); 0: not
    #: measured
    wake_cpu: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "exit_gap", "world", "msg_cpu", "byte_cpu", "wake_cpu"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")


@dataclass(frozen=True)
class Profile:
    """A machine as the simulator prices it (module doc). ``source`` says where the figures
    come from (a published figure, or the command and date of a calibration)."""

    name: str
    intra: LinkClass
    inter: LinkClass
    gamma: float
    reduce_bps: float
    ranks_per_host: int = 1
    cores: int = 0
    call_overhead: float = 0.0
    source: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    #: the time-shared cores' figures (module doc); None: the scaled ones alone
    shared: SharedCores | None = None
    #: price an oversubscribed host with a pool of ``cores`` (module doc) instead of the scale
    pool: bool = False
    #: with the pool: CPU seconds a message between two ranks of one host costs its receiver
    #: (the intra-host link's ``beta`` is then the receiver's CPU per byte, and ``alpha`` its
    #: delay)
    msg_cpu: float = 0.0
    #: the two-process cost per byte by message size, ``((bytes, seconds per byte), ...)`` with
    #: the sizes increasing, as calibration measured it; with the pool it shapes a message's
    #: per-byte cost (module doc, :meth:`byte_factor`), and the pool's per-byte figure
    #: (``SharedCores.byte_cpu``) is that of the shape's largest messages: fitted with this
    #: shape, it belongs to it (give a profile another shape and refit). Empty: one figure for
    #: every size
    byte_shape: tuple[tuple[int, float], ...] = ()
    #: with the pool: the extra CPU seconds a message costs a receiver that has been idle
    #: (no CPU work booked) for :data:`WAKE_FULL` seconds or more; from :data:`WAKE_FROM` to
    #: :data:`WAKE_FULL` it grows linearly from 0 (module doc, :meth:`wake_extra`)
    wake_cpu: float = 0.0

    def __post_init__(self) -> None:
        if not self.gamma >= 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma!r}")
        if not self.reduce_bps > 0:
            raise ValueError(f"reduce_bps must be > 0, got {self.reduce_bps!r}")
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {self.ranks_per_host!r}")
        if not self.call_overhead >= 0:
            raise ValueError(f"call_overhead must be >= 0, got {self.call_overhead!r}")
        if self.cores < 0:
            raise ValueError(f"cores must be >= 0 (0: one per rank), got {self.cores!r}")
        for name in ("msg_cpu", "wake_cpu"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        bad = ValueError("byte_shape must be (bytes, seconds per byte) pairs, the sizes "
                         f"positive and increasing, the costs finite and > 0; got "
                         f"{self.byte_shape!r}")
        try:
            shape = tuple((n, b) for n, b in self.byte_shape)
        except (TypeError, ValueError):
            raise bad from None
        sizes = [n for n, _ in shape]
        if any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in sizes) \
                or sizes != sorted(set(sizes)) \
                or any(isinstance(b, bool) or not isinstance(b, (int, float))
                       or not (math.isfinite(b) and b > 0) for _, b in shape):
            raise bad
        object.__setattr__(self, "byte_shape", shape)  # lists from JSON or a caller: tuples

    def byte_factor(self, nbytes: int) -> float:
        """The cost per byte of an ``nbytes`` message relative to that of the largest size in
        :attr:`byte_shape`: linear in log2 of the size between the sizes measured, the nearest
        one's outside them, and at most 1 (a smaller message's bytes measured dearer per byte
        than the largest ones' are the fixed costs' noise in a short measurement: one
        calibration of twelve here had 1.37 at 64 KiB and 1.01 at 512 KiB, where the others
        had 0.56-0.67 at 512 KiB); 1.0 without a shape."""
        pts = self.byte_shape
        if not pts:
            return 1.0
        x = math.log2(max(nbytes, 1))
        f = float(np.interp(x, [math.log2(n) for n, _ in pts], [b for _, b in pts])) / pts[-1][1]
        return min(f, 1.0)

    def wake_extra(self, idle: float) -> float:
        """What a message costs beyond its receipt, with the pool, at a receiver idle for
        ``idle`` seconds: :attr:`wake_cpu` times the ramp from :data:`WAKE_FROM` (0) to
        :data:`WAKE_FULL` (1)."""
        if idle <= WAKE_FROM:
            return 0.0
        return self.wake_cpu * min((idle - WAKE_FROM) / (WAKE_FULL - WAKE_FROM), 1.0)

    @property
    def cpu_scale(self) -> float:
        """The factor CPU costs are multiplied by: ranks per host over cores when more ranks
        than cores share a host, else 1."""
        if self.cores and self.ranks_per_host > self.cores and not self.pool:
            return self.ranks_per_host / self.cores
        return 1.0

    @property
    def pooled(self) -> bool:
        """CPU work queues for a pool of ``cores`` per host (``pool`` set, oversubscribed)."""
        return self.pool and self.oversubscribed

    @property
    def oversubscribed(self) -> bool:
        """More ranks per host than cores (``cores`` known)."""
        return bool(self.cores) and self.ranks_per_host > self.cores

    def placed(self, ranks_per_host: int, model: str = "pool") -> Profile:
        """This machine with ``ranks_per_host`` ranks on each host. When the ranks outnumber
        the cores and the time-shared figures (:attr:`shared`) were measured: ``model="pool"``
        (the default, where :attr:`shared` has the pool's figures) queues CPU work for a pool of
        ``cores`` per host and prices a message between two of its ranks as its receiver's CPU
        (module doc); ``"shared"`` scales every cost by ranks per core and prices the intra-host
        link with the fitted shared ``alpha`` and ``beta`` (and exit waves). Otherwise the
        dedicated link. Place the calibrated profile, not a placed one: an oversubscribed
        placement keeps only the figures of its model (``shared`` becomes None)."""
        if model not in ("pool", "shared"):
            raise ValueError(f"model must be 'pool' or 'shared', got {model!r}")
        p = self.with_(ranks_per_host=ranks_per_host)
        if p.oversubscribed and p.shared is not None:
            sh = p.shared
            if model == "pool" and sh.msg_cpu > 0:
                return p.with_(intra=LinkClass(0.0, sh.byte_cpu), shared=None, pool=True,
                               msg_cpu=sh.msg_cpu, wake_cpu=sh.wake_cpu)
            return p.with_(intra=LinkClass(sh.alpha, sh.beta), shared=None,
                           figures={**p.figures, "exit_gap_s": sh.exit_gap})
        return p

    @property
    def exit_gap(self) -> float:
        """Seconds between the waves of ranks leaving a collective: the shared figure, kept
        in ``figures`` by :meth:`placed`; 0 when the ranks do not outnumber the cores."""
        if not self.oversubscribed or self.pooled:
            return 0.0
        if self.shared is not None:
            return self.shared.exit_gap
        return float(self.figures.get("exit_gap_s", 0.0))

    def exit_offsets(self, steps: int, world_size: int,
                     rng: np.random.Generator) -> np.ndarray:
        """A ``(steps, world_size)`` array: for each step, when each rank leaves a collective
        after the first rank out (module doc). The ranks of a host (``ranks_per_host``
        consecutive ones) leave in a random order, ``cores`` at a time, the waves
        :attr:`exit_gap` apart; all zeros when the ranks do not outnumber the cores.
        Added to a simulation's compute times after each barrier, it reproduces the stagger
        the scaled model leaves out."""
        out = np.zeros((steps, world_size))
        gap = self.exit_gap
        if gap <= 0:
            return out
        rph = self.ranks_per_host
        for lo in range(0, world_size, rph):
            n = min(rph, world_size - lo)
            waves = (np.arange(n) // self.cores) * gap
            for s in range(steps):
                out[s, lo:lo + n] = waves[rng.permutation(n)]
        return out

    def with_(self, **changes: Any) -> Profile:
        """A copy with ``changes`` (``ranks_per_host=8``, say)."""
        d = {**self.__dict__, **changes}
        return Profile(**d)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_json` reads back."""
        d = asdict(self)
        d["format"] = "asynccoll.sim.profile/1"
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Profile:
        """The profile :meth:`to_json` wrote; ``ValueError`` naming a missing or bad field."""
        if d.get("format") != "asynccoll.sim.profile/1":
            raise ValueError(f"not a simulator profile (format {d.get('format')!r}, expected "
                             "'asynccoll.sim.profile/1')")
        try:
            return cls(name=str(d["name"]), intra=LinkClass(**d["intra"]),
                       inter=LinkClass(**d["inter"]), gamma=float(d["gamma"]),
                       reduce_bps=float(d["reduce_bps"]),
                       ranks_per_host=int(d.get("ranks_per_host", 1)),
                       cores=int(d.get("cores", 0)),
                       call_overhead=float(d.get("call_overhead", 0.0)),
                       source=str(d.get("source", "")),
                       figures=dict(d.get("figures", {})),
                       shared=SharedCores(**d["shared"]) if d.get("shared") else None,
                       pool=bool(d.get("pool", False)),
                       msg_cpu=float(d.get("msg_cpu", 0.0)),
                       wake_cpu=float(d.get("wake_cpu", 0.0)),
                       byte_shape=tuple(tuple(p) for p in d.get("byte_shape") or ()))
        except KeyError as exc:
            raise ValueError(f"profile lacks field {exc.args[0]!r}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read a profile :meth:`save` wrote; ``ValueError`` for another file."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))
