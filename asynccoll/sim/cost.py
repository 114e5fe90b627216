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
* a rank's CPU work is **serialised** (one op at a time), and when more ranks share a host than
  it has ``cores``, every CPU cost, the intra-host ``alpha`` and ``beta`` (between processes
  of one host a message is CPU work: the kernel's and the runtime's, no wire) and the call
  overhead are multiplied by ``ranks_per_host / cores``. Coarse: it assumes every rank works
  at once. (A pool of cores per host, where waiting ranks cost nothing, predicted this
  machine's benchmarks worse; see ``docs/sim.md``.)
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
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["LinkClass", "Profile", "SharedCores"]


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

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "exit_gap", "world"):
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

    @property
    def cpu_scale(self) -> float:
        """The factor CPU costs are multiplied by: ranks per host over cores when more ranks
        than cores share a host, else 1."""
        if self.cores and self.ranks_per_host > self.cores:
            return self.ranks_per_host / self.cores
        return 1.0

    @property
    def oversubscribed(self) -> bool:
        """More ranks per host than cores (``cores`` known)."""
        return bool(self.cores) and self.ranks_per_host > self.cores

    def placed(self, ranks_per_host: int) -> Profile:
        """This machine with ``ranks_per_host`` ranks on each host: a copy whose intra-host
        link is the time-shared cores' (:attr:`shared`, module doc) when the ranks outnumber
        the cores, the dedicated one otherwise. Place the calibrated
        profile, not a placed one: an oversubscribed placement keeps only the shared figures
        (``shared`` becomes None)."""
        p = self.with_(ranks_per_host=ranks_per_host)
        if p.oversubscribed and p.shared is not None:
            sh = p.shared
            return p.with_(intra=LinkClass(sh.alpha, sh.beta), shared=None,
                           figures={**p.figures, "exit_gap_s": sh.exit_gap})
        return p

    @property
    def exit_gap(self) -> float:
        """Seconds between the waves of ranks leaving a collective: the shared figure, kept
        in ``figures`` by :meth:`placed`; 0 when the ranks do not outnumber the cores."""
        if not self.oversubscribed:
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
                       shared=SharedCores(**d["shared"]) if d.get("shared") else None)
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
