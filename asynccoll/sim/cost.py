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

The model is LogGP-like without its gap term: the paper figures it is fitted to (small-message
latency, large-message bandwidth, per-call software overhead) are what users can find for their
machine; :func:`asynccoll.sim.calibrate.calibrate` measures them here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LinkClass", "Profile"]


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
                       figures=dict(d.get("figures", {})))
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
