"""The ``asynccoll`` command.

``asynccoll demo``: the README's main job. Until the training demo lands it runs a small
allreduce-shaped schedule (recursive doubling over 4 in-process ranks, 3 executions of a
persistent schedule) and prints what each rank's ops did.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import numpy as np

__all__ = ["main"]


def _doubling_schedule(rank: int, world: int, n: int) -> object:
    from .sched import Schedule

    s = Schedule(rank, world, "demo-recursive-doubling", {"x": n, "tmp": n})
    prev: int | None = None
    dist, step = 1, 0
    while dist < world:
        peer = rank ^ dist
        deps = [] if prev is None else [prev]
        snd = s.send(peer, "x", tag=step, deps=deps)
        rcv = s.recv(peer, "tmp", tag=step, deps=deps)
        prev = s.compute("sum", ["x", "tmp"], "x", deps=[snd, rcv])
        dist, step = dist * 2, step + 1
    return s.commit()


async def _demo(ranks: int, executions: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from .sched import Executor
    from .testing import inproc_world

    console = Console()
    n = 8
    async with inproc_world(ranks) as ts:
        bufs = [{"x": np.zeros(n, np.float32), "tmp": np.zeros(n, np.float32)}
                for _ in range(ranks)]
        results: list[list[float]] = []
        exs = []
        for r in range(ranks):
            def done(e: int, r: int = r) -> None:
                if r == 0:
                    results.append([float(b["x"][0]) for b in bufs])
            exs.append(Executor(_doubling_schedule(r, ranks, n), ts[r], bufs[r],  # type: ignore[arg-type]
                                sched_id=1, persistent=True, on_complete=done))
        for e in range(executions):
            for r in range(ranks):
                bufs[r]["x"][:] = r + 1 + e
            await asyncio.gather(*(ex.start() for ex in exs))
        table = Table(title=f"recursive-doubling allreduce schedule, {ranks} in-process ranks")
        for col in ("execution", "op", "what", "fired (µs)", "done (µs)", "bytes"):
            table.add_column(col)
        for rec in exs[0].trace.to_dict()["executions"]:
            t0 = rec["armed"]
            for i, (_, fired, comp, nb) in enumerate(rec["ops"]):
                table.add_row(str(rec["execution"]), str(i),
                              exs[0].schedule.ops[i].describe(),
                              f"{(fired - t0) * 1e6:.0f}" if fired else "-",
                              f"{(comp - t0) * 1e6:.0f}" if comp else "-", str(nb))
        console.print(table)
        expected = [sum(r + 1 + e for r in range(ranks)) for e in range(executions)]
        for ex in exs:
            ex.close()
        console.print(f"rank 0's view of x[0] after each execution: "
                      f"{[row[0] for row in results]} (expected {expected})")


def _configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--executions", type=int, default=3)


def _run_demo(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        raise SystemExit(f"asynccoll demo: --ranks must be >= 1, got {args.ranks}")
    asyncio.run(_demo(args.ranks, args.executions))
    return 0


#: subcommand -> (module that defines it, help). Each module has ``configure(parser)`` and
#: ``run(args) -> int``; imported only when its subcommand is used.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("asynccoll.cli", "run the demo (the README's main job)"),
    "run": ("asynccoll.launch.cli", "start N ranks of a script, locally or across hosts"),
    "inspect": ("asynccoll.inspect.cli", "render schedules, summarise traces, explain hangs"),
}


def main(argv: Sequence[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="asynccoll", description="asynccoll command line")
    sub = parser.add_subparsers(dest="command", required=True)
    name = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for cmd, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(cmd, help=help_)
        if cmd == name:  # import only the module of the subcommand being run
            mod = sys.modules[__name__] if module == __name__ else importlib.import_module(module)
            getattr(mod, "configure", _configure_demo)(p)
            p.set_defaults(_run=getattr(mod, "run", _run_demo))
    args = parser.parse_args(argv)
    code: int = args._run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
