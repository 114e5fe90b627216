"""``asynccoll run``: start N local ranks of a script or module, on one host or across hosts.

    asynccoll run -n 4 train.py --epochs 3
    asynccoll run -n 2 --transport ucx -m mypkg.train
    asynccoll run -n 2 --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29400 train.py   # on host A
    asynccoll run -n 2 --nnodes 2 --node-rank 1 --rdzv 10.0.0.1:29400 train.py   # on host B
    asynccoll run -n 4 --max-restarts 3 train.py      # restart a failed rank, 3 times at most

The secret: ``--secret-file``, else ``ASYNCCOLL_SECRET``, else ``ASYNCCOLL_SECRET_FILE``; else a
fresh random one for a single-node job, or the per-user key file for a multi-node job (works
when the hosts share the home directory). See ``docs/launch.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys

from ..errors import AsyncCollError
from .env import ConfigError, parse_hostport, user_secret
from .runner import LaunchConfig, launch

__all__ = ["configure", "run"]


def configure(p: argparse.ArgumentParser) -> None:
    """Add the options of ``asynccoll run`` to ``p``."""
    p.description = "Start N ranks of a Python script or module, locally or across hosts."
    p.add_argument("-n", "--nproc-per-node", dest="nproc", type=int, required=True,
                   help="ranks to start on this node")
    p.add_argument("--transport", choices=("tcp", "ucx"), default="tcp",
                   help="how the ranks talk to each other (default: tcp)")
    p.add_argument("--nnodes", type=_nnodes, default=(1, None), metavar="N|MIN:MAX",
                   help="number of nodes (launchers); MIN:MAX: the job starts once nodes "
                        "0..MIN-1 met, and a launcher of node MIN..MAX-1 started later with "
                        "the same --rdzv and secret adds its ranks to the running job "
                        "(docs/launch.md, Growing)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index, 0..nnodes-1 (0..MAX-1)")
    p.add_argument("--rdzv", metavar="HOST:PORT", default=None,
                   help="the store's address on node 0 (node 0 binds it); required with "
                        "--nnodes > 1; default: a free port on 127.0.0.1")
    p.add_argument("--host", default=None,
                   help="the address this node's ranks listen on (default: the interface that "
                        "routes to the store)")
    p.add_argument("--secret-file", default=None,
                   help="file holding the job secret (mode 0600); the same on every node")
    p.add_argument("--rdzv-timeout", type=float, default=300.0,
                   help="seconds the launchers of all nodes may take to meet (multi-node), "
                        "and that node 0 waits for a launcher replacing a lost one")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("--max-failures", type=int, default=0, metavar="N",
                   help="keep the job running while at most N ranks of this node have failed "
                        "(partial collectives go on without them; see docs/launch.md); "
                        "default 0: the first failure stops every rank")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart a failed rank of this node, while the node has made fewer "
                        "than N restarts: the new process gets ASYNCCOLL_RESTART=k (its k-th "
                        "restart) and the other ranks go on meanwhile (they see "
                        "ASYNCCOLL_MAX_FAILURES >= 1); a launcher started for a node whose "
                        "launcher died takes its ranks again, as one restart of the node; "
                        "once they are spent --max-failures applies (docs/launch.md, Restarts)")
    p.add_argument("--verbose", action="store_true",
                   help="after Ctrl-C (or SIGTERM), pass on everything the ranks print while "
                        "they stop; default: drop it and print one line per rank")
    p.add_argument("--no-python", action="store_true",
                   help="run CMD as an executable instead of a Python script")
    p.add_argument("-m", dest="module", action="store_true",
                   help="CMD is a module name, run as python -m")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD ...",
                   help="the script (or module with -m) and its arguments")


def _argv(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("CMD is missing: give a script, -m MODULE, or an executable")
    if args.module:
        return [sys.executable, "-u", "-m", *cmd]
    if args.no_python:
        return cmd
    return [sys.executable, "-u", *cmd]


def _nnodes(text: str) -> tuple[int, int | None]:
    """``--nnodes``: ``N`` or ``MIN:MAX`` as (MIN, MAX or None)."""
    lo, sep, hi = text.partition(":")
    try:
        first, most = int(lo), int(hi) if sep else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be N or MIN:MAX (integers), got {text!r}"
                                         ) from None
    if first < 1 or (most is not None and most < first):
        raise argparse.ArgumentTypeError(f"must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, "
                                         f"got {text!r}")
    return first, None if most == first else most


def _secret(args: argparse.Namespace) -> bytes:
    if args.secret_file:
        return user_secret({"ASYNCCOLL_SECRET_FILE": args.secret_file})
    if os.environ.get("ASYNCCOLL_SECRET"):
        raw = os.environ["ASYNCCOLL_SECRET"]
        if len(raw) < 16:
            raise ConfigError("ASYNCCOLL_SECRET", f"must be at least 16 characters, "
                                                  f"got {len(raw)}")
        return raw.encode()
    if os.environ.get("ASYNCCOLL_SECRET_FILE") or (args.nnodes[1] or args.nnodes[0]) > 1:
        return user_secret(os.environ)
    return secrets.token_hex(32).encode()


def run(args: argparse.Namespace) -> int:
    """Run the job; return the launcher's exit code (2 for a usage error)."""
    try:
        rdzv = parse_hostport(args.rdzv, "--rdzv") if args.rdzv else None
        cfg = LaunchConfig(nproc=args.nproc, argv=_argv(args), secret=_secret(args),
                           nnodes=args.nnodes[0], max_nnodes=args.nnodes[1],
                           node_rank=args.node_rank, rdzv=rdzv,
                           transport=args.transport, host=args.host, grace=args.grace,
                           join_timeout=args.rdzv_timeout, max_failures=args.max_failures,
                           max_restarts=args.max_restarts, verbose=args.verbose)
    except (ValueError, ConfigError) as exc:
        print(f"asynccoll run: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(launch(cfg))
    except (AsyncCollError, OSError) as exc:
        print(f"asynccoll run: error: {exc}", file=sys.stderr)
        return 1
