"""The profiles that ship with the simulator, each with the figures behind it and their source.

* ``aries``: a Cray XC-class machine with the Aries interconnect (the machine eager-SGD's
  microbenchmark ran on, one process per node). Source: the vendor white paper *Cray XC Series
  Network* (WP-Aries01-1112, 2012), which gives about 1.3 µs MPI point-to-point latency between
  nodes and a peak injection bandwidth of 10.2 GB/s per node and direction (we price
  9.5 GB/s: the sustained MPI bandwidth is a little below the peak). Within a node (shared
  memory): 0.4 µs and 12 GB/s, typical MPI shared-memory figures on Xeon nodes of that
  generation (an assumption; eager-SGD ran one rank per node, so it does not enter Fig. 9).
  Per-op CPU cost 1 µs and reduction at 5 GB/s: typical of an MPI library's per-call overhead
  and of one Xeon core summing float32 arrays (assumptions, stated as such).
* ``ib_hdr``: an InfiniBand HDR (200 Gb/s) cluster. Source: the *ConnectX-6 VPI* adapter
  product brief (HDR 200 Gb/s = 25 GB/s per port and direction, "sub 600 ns" latency) and the
  MPI point-to-point latency the MPI micro-benchmarks report on such clusters, about 1.0 µs,
  which we price (the adapter figure excludes the MPI stack); 24 GB/s sustained. Within a node,
  0.3 µs and 20 GB/s; per-op CPU 0.5 µs; reduction 10 GB/s (assumptions, as above).

Both describe the network and an MPI-like software stack written in a compiled language; a
Python runtime's per-op cost is one to two orders of magnitude larger (``asynccoll sim
calibrate`` measures it), so use them to compare policies at scale, and a calibrated profile
to predict this runtime's absolute times.
"""

from __future__ import annotations

from .cost import LinkClass, Profile

__all__ = ["BUILTIN_PROFILES", "builtin_profile"]

ARIES = Profile(
    name="aries",
    intra=LinkClass(alpha=0.4e-6, beta=1 / 12e9),
    inter=LinkClass(alpha=1.3e-6, beta=1 / 9.5e9),
    gamma=1.0e-6,
    reduce_bps=5e9,
    ranks_per_host=1,
    cores=0,
    source="Cray XC Series Network white paper (WP-Aries01-1112): ~1.3 us MPI latency, "
           "10.2 GB/s peak injection per node and direction (9.5 GB/s priced); intra-node, "
           "per-op CPU and reduction figures are stated assumptions (see "
           "asynccoll/sim/profiles.py)",
    figures={"inter_latency_us": 1.3, "inter_bandwidth_GBps": 9.5,
             "peak_injection_GBps": 10.2, "intra_latency_us": 0.4,
             "intra_bandwidth_GBps": 12.0, "per_op_cpu_us": 1.0, "reduce_GBps": 5.0},
)

IB_HDR = Profile(
    name="ib_hdr",
    intra=LinkClass(alpha=0.3e-6, beta=1 / 20e9),
    inter=LinkClass(alpha=1.0e-6, beta=1 / 24e9),
    gamma=0.5e-6,
    reduce_bps=10e9,
    ranks_per_host=1,
    cores=0,
    source="ConnectX-6 VPI product brief (HDR 200 Gb/s = 25 GB/s per port and direction, "
           "sub-600 ns adapter latency); ~1.0 us MPI point-to-point latency as MPI "
           "micro-benchmarks report on HDR clusters; 24 GB/s priced; intra-node, per-op CPU "
           "and reduction figures are stated assumptions (see asynccoll/sim/profiles.py)",
    figures={"inter_latency_us": 1.0, "inter_bandwidth_GBps": 24.0,
             "link_rate_Gbps": 200, "intra_latency_us": 0.3, "intra_bandwidth_GBps": 20.0,
             "per_op_cpu_us": 0.5, "reduce_GBps": 10.0},
)

#: the shipped profiles by name
BUILTIN_PROFILES: dict[str, Profile] = {"aries": ARIES, "ib_hdr": IB_HDR}


def builtin_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile JSON file by path (``asynccoll sim calibrate``
    writes one). Raises ``ValueError`` naming the unknown profile and listing the shipped
    ones."""
    if name_or_path in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name_or_path]
    import os

    if os.path.exists(name_or_path):
        return Profile.load(name_or_path)
    raise ValueError(f"profile must be one of {sorted(BUILTIN_PROFILES)} or a profile JSON "
                     f"file, got {name_or_path!r}")
