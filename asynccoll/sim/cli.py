"""``asynccoll sim``: calibrate, replay a trace, run one policy, list profiles.

    asynccoll sim calibrate [--out PROFILE.json] [--transports tcp,ucx]
    asynccoll sim replay TRACE_DIR --policies sync,solo,majority,two_choice,quorum:K,backup:B,
                         deadline [--scale-to P] [--steps N] [--profile NAME|FILE]
                         [--recommend --max-staleness S] [--plot FILE.png] [--json FILE]
                         [--ranks-per-host N]
    asynccoll sim run --policy solo -P 1024 --steps 100 --compute lognormal:median=0.01,sigma=0.5
                      [--profile aries] [--nbytes 4] [--ranks-per-host N]
    asynccoll sim profiles

``--ranks-per-host N`` places the profile (:meth:`~asynccoll.sim.cost.Profile.placed`): N ranks
share each host, and where they outnumber a calibrated profile's cores, the cores are a pool
(:mod:`asynccoll.sim.cost`); without it every rank has a host of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ..collectives.policy import POLICY_SYNTAX
from .arrivals import model_syntax
from .replay import DEFAULT_TIE

if TYPE_CHECKING:
    from .cost import Profile

__all__ = ["configure", "run"]

_PROFILE_HELP = ("network and CPU costs: a shipped profile (aries, ib_hdr; `asynccoll sim "
                 "profiles` lists them) or a JSON file `asynccoll sim calibrate` wrote "
                 "(default: %(default)s)")
_RPH_HELP = ("place this many ranks on each host (Profile.placed: where they outnumber a "
             "calibrated profile's cores, its pool of cores)")


def configure(p: argparse.ArgumentParser) -> None:
    """Add the ``sim`` subcommands to ``p``."""
    sub = p.add_subparsers(dest="sim_command", required=True)
    c = sub.add_parser("calibrate", help="measure alpha, beta, gamma here; write a profile")
    c.add_argument("--out", default="sim-profile.json",
                   help="profile file (with several transports: one file per transport, "
                        "suffixed with its name)")
    c.add_argument("--transports", default=None,
                   help="comma-separated transports to measure: tcp, ucx (default: tcp, and "
                        "ucx when ucxx imports)")
    r = sub.add_parser("replay", help="replay a trace's compute times through policies")
    r.add_argument("trace_dir", help="the directory a traced run wrote (ASYNCCOLL_TRACE=DIR)")
    r.add_argument("--policies", default="sync,solo,majority,two_choice,deadline",
                   help=f"comma-separated policies to compare: {POLICY_SYNTAX} "
                        "(default: %(default)s)")
    r.add_argument("--scale-to", type=int, default=None, metavar="P",
                   help="simulate this many ranks, each replaying a recorded one "
                        "(default: the recorded world size)")
    r.add_argument("--steps", type=int, default=None,
                   help="steps to simulate (default: as many as were recorded)")
    r.add_argument("--profile", default="aries", metavar="NAME|FILE",
                   help=_PROFILE_HELP)
    r.add_argument("--collective", default=None,
                   help="which traced collective: its name (solo_allreduce, allreduce, ...) or "
                        "sched_id (default: the one with the most executions)")
    r.add_argument("--nbytes", type=int, default=None,
                   help="bytes per call (default: the traced collective's)")
    r.add_argument("--recommend", action="store_true",
                   help="name the policy with the most steps/s whose staleness stays within "
                        "--max-staleness; policies within --tie of the best tie, and of those "
                        "the one that includes the most fresh data (then: the least "
                        "staleness) is recommended and the tie is said")
    r.add_argument("--max-staleness", type=int, default=1, metavar="S",
                   help="with --recommend: the 99th-percentile staleness allowed, in "
                        "executions (default: %(default)s)")
    r.add_argument("--tie", type=float, default=DEFAULT_TIE, metavar="FRACTION",
                   help="with --recommend: policies whose steps/s are within this fraction of "
                        "the best tie (default: %(default)s, i.e. 2%%)")
    r.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot steps/s and latency per policy (needs matplotlib)")
    r.add_argument("--json", default=None, metavar="FILE.json",
                   help="write the rows, what was replayed and the recommendation")
    r.add_argument("--seed", type=int, default=0,
                   help="seed of the simulation's draws (default: %(default)s)")
    r.add_argument("--ranks-per-host", type=int, default=None, metavar="N",
                   help=_RPH_HELP)
    s = sub.add_parser("run", help="simulate one policy under a compute-time model")
    s.add_argument("--policy", default="solo",
                   help=f"one policy: {POLICY_SYNTAX} (default: %(default)s)")
    s.add_argument("-P", "--world-size", type=int, default=32,
                   help="ranks to simulate (default: %(default)s)")
    s.add_argument("--steps", type=int, default=100,
                   help="steps (calls per rank) to simulate (default: %(default)s)")
    s.add_argument("--compute", default="linear:skew=0.001", metavar="MODEL[:k=v,...]",
                   help="seconds each rank computes before each call: one of "
                        + model_syntax().replace("%", "%%")
                        + " (seconds; default: %(default)s)")
    s.add_argument("--profile", default="aries", metavar="NAME|FILE", help=_PROFILE_HELP)
    s.add_argument("--nbytes", type=int, default=4,
                   help="bytes each call reduces (default: %(default)s)")
    s.add_argument("--barrier", action="store_true",
                   help="a barrier before every call (the ranks start each step together)")
    s.add_argument("--seed", type=int, default=0,
                   help="seed of the compute-time draws and the drawn initiators "
                        "(default: %(default)s)")
    s.add_argument("--ranks-per-host", type=int, default=None, metavar="N",
                   help=_RPH_HELP)
    sub.add_parser("profiles", help="list the shipped profiles and their sources")


def run(args: argparse.Namespace) -> int:
    """Run the ``sim`` subcommand in ``args``; returns the exit code (2: bad arguments)."""
    try:
        return _COMMANDS[args.sim_command](args)
    except ValueError as exc:
        print(f"asynccoll sim {args.sim_command}: {exc}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    from .calibrate import available_transports, calibrate
    from .cost import WAKE_FULL

    trs = tuple(t for t in args.transports.split(",") if t) if args.transports \
        else available_transports()
    profiles = calibrate(trs)
    for tr, prof in profiles.items():
        path = args.out if len(profiles) == 1 else _suffixed(args.out, tr)
        prof.save(path)
        f = prof.figures
        print(f"{tr}: alpha {prof.intra.alpha * 1e6:.1f} us, beta "
              f"{1 / prof.intra.beta / 1e9 if prof.intra.beta else float('inf'):.2f} GB/s, "
              f"gamma {prof.gamma * 1e6:.2f} us/op, reduce {prof.reduce_bps / 1e9:.1f} GB/s, "
              f"call overhead {f['call_overhead_us']:.0f} us"
              + (f"; {prof.cores} cores time-shared: {f['pool_msg_cpu_us']:.0f} us of CPU per "
                 f"message, {f['pool_byte_cpu_GBps']:.2f} GB/s at the largest messages"
                 + (f", {f['pool_wake_cpu_us']:.0f} us more at a rank idle {WAKE_FULL * 1e3:g} ms"
                    if "pool_wake_cpu_us" in f else "")
                 if "pool_msg_cpu_us" in f
                 else "")
              + ("; two processes, per byte by message size " + ", ".join(
                  f"{int(m) >> 10} KiB {v:.2f}" for m, v in f["byte_shape_GBps"].items())
                 + " GB/s" if f.get("byte_shape_GBps") else "") + f" -> {path}")
    return 0


def _placed(prof: Profile, ranks_per_host: int | None) -> Profile:
    """``prof`` with ``ranks_per_host`` ranks on each host (``--ranks-per-host``), else as is."""
    if ranks_per_host is None:
        return prof
    if ranks_per_host < 1:
        raise SystemExit(f"--ranks-per-host must be >= 1, got {ranks_per_host}")
    return prof.placed(ranks_per_host)


def _suffixed(path: str, name: str) -> str:
    stem, dot, ext = path.rpartition(".")
    return f"{stem}-{name}.{ext}" if dot else f"{path}-{name}"


def _replay(args: argparse.Namespace) -> int:
    from .profiles import builtin_profile
    from .replay import recommendation, render, replay, replay_png

    prof = _placed(builtin_profile(args.profile), args.ranks_per_host)
    rows, meta = replay(args.trace_dir, args.policies, profile=prof, scale_to=args.scale_to,
                        steps=args.steps, collective=args.collective, nbytes=args.nbytes,
                        seed=args.seed)
    print(render(rows, meta), end="")
    best = None
    if args.recommend:
        best, tied = recommendation(rows, args.max_staleness, args.tie)
        if best is None:
            print(f"no policy keeps the 99th-percentile staleness within "
                  f"{args.max_staleness}")
        else:
            print(f"recommended: {best['policy']} ({best['steps_per_s']:.2f} steps/s with "
                  f"staleness p99 <= {args.max_staleness})")
            if len(tied) > 1:
                print("tied within {:g}% of the best steps/s: {}; {} includes the most fresh "
                      "data of them".format(args.tie * 100, ", ".join(
                          f"{r['policy']} ({r['steps_per_s']:.2f})" for r in tied),
                          best["policy"]))
    if args.plot:
        replay_png(rows, meta, args.plot)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"replay": meta, "rows": rows,
                       "recommended": None if best is None else best["policy"]}, f, indent=1)
    return 0


def _run(args: argparse.Namespace) -> int:
    from .arrivals import parse_model
    from .profiles import builtin_profile
    from .run import simulate

    prof = _placed(builtin_profile(args.profile), args.ranks_per_host)
    res = simulate(args.policy, args.world_size, args.steps, profile=prof,
                   compute=parse_model(args.compute), nbytes=args.nbytes,
                   barrier=args.barrier, seed=args.seed)
    print(json.dumps(res.summary(), indent=1))
    return 0


def _profiles(args: argparse.Namespace) -> int:
    from .profiles import BUILTIN_PROFILES

    for name, p in BUILTIN_PROFILES.items():
        print(f"{name}: inter {p.inter.alpha * 1e6:.2f} us, {1 / p.inter.beta / 1e9:.1f} GB/s; "
              f"intra {p.intra.alpha * 1e6:.2f} us, {1 / p.intra.beta / 1e9:.1f} GB/s; "
              f"gamma {p.gamma * 1e6:.2f} us\n  source: {p.source}")
    return 0


_COMMANDS = {"calibrate": _calibrate, "replay": _replay, "run": _run, "profiles": _profiles}
