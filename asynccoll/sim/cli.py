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

if TYPE_CHECKING:
    from .cost import Profile

__all__ = ["configure", "run"]

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
                   help="comma-separated (default: tcp, and ucx when ucxx imports)")
    r = sub.add_parser("replay", help="replay a trace's compute times through policies")
    r.add_argument("trace_dir")
    r.add_argument("--policies", default="sync,solo,majority,two_choice,deadline")
    r.add_argument("--scale-to", type=int, default=None, help="simulate this many ranks")
    r.add_argument("--steps", type=int, default=None)
    r.add_argument("--profile", default="aries", help="a shipped profile or a JSON file")
    r.add_argument("--collective", default=None, help="which traced collective (name or id)")
    r.add_argument("--nbytes", type=int, default=None)
    r.add_argument("--recommend", action="store_true")
    r.add_argument("--max-staleness", type=int, default=1,
                   help="with --recommend: the 99th-percentile staleness allowed (executions)")
    r.add_argument("--plot", default=None)
    r.add_argument("--json", default=None)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--ranks-per-host", type=int, default=None,
                   help=_RPH_HELP)
    s = sub.add_parser("run", help="simulate one policy under a compute-time model")
    s.add_argument("--policy", default="solo")
    s.add_argument("-P", "--world-size", type=int, default=32)
    s.add_argument("--steps", type=int, default=100)
    s.add_argument("--compute", default="linear:skew=0.001")
    s.add_argument("--profile", default="aries")
    s.add_argument("--nbytes", type=int, default=4)
    s.add_argument("--barrier", action="store_true")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ranks-per-host", type=int, default=None,
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
    from .replay import recommend, render, replay, replay_png

    prof = _placed(builtin_profile(args.profile), args.ranks_per_host)
    rows, meta = replay(args.trace_dir, args.policies, profile=prof, scale_to=args.scale_to,
                        steps=args.steps, collective=args.collective, nbytes=args.nbytes,
                        seed=args.seed)
    print(render(rows, meta), end="")
    best = None
    if args.recommend:
        best = recommend(rows, args.max_staleness)
        if best is None:
            print(f"no policy keeps the 99th-percentile staleness within "
                  f"{args.max_staleness}")
        else:
            print(f"recommended: {best['policy']} ({best['steps_per_s']:.2f} steps/s with "
                  f"staleness p99 <= {args.max_staleness})")
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
