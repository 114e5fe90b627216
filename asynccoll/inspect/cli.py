"""``asynccoll inspect``: render schedules, summarise traces, explain hangs.

::

    asynccoll inspect schedule KIND --ranks P [--rank R] [--size BYTES] [--algorithm A]
                               [--format text|dot|json|html|png] [--out FILE]
    asynccoll inspect trace DIR [--execution N] [--sched-id S] [--perfetto OUT.json]
                               [--html OUT.html] [--png OUT.png] [--stragglers [PLOT.png]]
                               [--all]
    asynccoll inspect pending DIR [--pid PID --wait SECONDS]
    asynccoll inspect flight DIR [--rank R] [--all]
    asynccoll inspect kinds

``pending --pid PID`` sends ``SIGUSR1`` to a live rank first: the handler each Communicator
installs (when created on its process's main thread) writes a ``pending`` snapshot of every
waiting executor into its trace file (``rank-R.jsonl`` in DIR, when tracing into DIR) and prints
them to the rank's stderr; the rank keeps running. The command then waits up to ``--wait``
seconds for the files to grow and explains them.

``trace`` leaves out the runtime's own collectives (:mod:`.visible`) unless ``--all``.

``flight`` prints the flight records ranks wrote into DIR (on a timeout, or on ``SIGUSR1``):
each rank's last collectives, the latest record per rank (``--all``: every record).

Bad arguments (unknown kind, P < 1, rank outside 0..P-1, a missing trace directory, no process
PID) print a message listing what is valid and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from .visible import INTERNAL

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``inspect`` sub-subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="inspect_command", required=True)
    p = sub.add_parser("schedule", help="render a collective's schedule")
    p.add_argument("kind", help="collective kind (`asynccoll inspect kinds` lists them)")
    p.add_argument("--ranks", "-P", type=int, required=True, help="world size P")
    p.add_argument("--rank", "-r", type=int, default=None,
                   help="render only this rank's DAG (default: every rank, global view)")
    p.add_argument("--size", type=int, default=4096,
                   help="message size in bytes, float32 (default: %(default)s)")
    p.add_argument("--algorithm", "-a", default=None,
                   help="algorithm, where the kind has several (`asynccoll inspect kinds` "
                        "lists them per kind)")
    p.add_argument("--format", "-f", default="text",
                   choices=("text", "dot", "json", "html", "png"),
                   help="text (a table per rank), dot (Graphviz), json (the schedules as "
                        "data), html (a page with the DAG and the message flows), png (a "
                        "picture; needs matplotlib and --out) (default: %(default)s)")
    p.add_argument("--out", "-o", default=None, metavar="FILE",
                   help="write here instead of stdout")
    t = sub.add_parser("trace", help="summarise the traces a run wrote into DIR")
    t.add_argument("dir", help="the directory a traced run wrote (ASYNCCOLL_TRACE=DIR)")
    t.add_argument("--execution", "-e", type=int, default=None, metavar="N",
                   help="show execution N of each collective, rank by rank")
    t.add_argument("--sched-id", type=int, default=None,
                   help="only this collective (its sched_id, as the summary lists it)")
    t.add_argument("--all", action="store_true", dest="show_all",
                   help="also the runtime's own collectives (" + ", ".join(INTERNAL) + ": "
                        "host discovery, definition checks, shared-memory setup), hidden "
                        "by default")
    t.add_argument("--perfetto", default=None, metavar="OUT.json",
                   help="write Chrome trace-event JSON (Perfetto, chrome://tracing)")
    t.add_argument("--html", default=None, metavar="OUT.html", help="write a timeline page")
    t.add_argument("--png", default=None, metavar="OUT.png",
                   help="draw the timeline into a PNG (needs matplotlib)")
    t.add_argument("--stragglers", nargs="?", const="", default=None, metavar="PLOT.png",
                   help="rank lateness per rank (percentiles, how often last, fresh data); "
                        "with PLOT.png also plot lateness over time (needs matplotlib)")
    q = sub.add_parser("pending", help="explain a hang from the pending snapshots in DIR")
    q.add_argument("dir", help="the directory the ranks trace into (ASYNCCOLL_TRACE=DIR)")
    q.add_argument("--pid", type=int, default=None,
                   help="first signal this process (SIGUSR1): its communicators, tracing into "
                        "DIR, write their pending ops there (and print them to its stderr)")
    q.add_argument("--wait", type=float, default=2.0, metavar="SECONDS",
                   help="with --pid: seconds to wait for the snapshots (default: %(default)s)")
    fl = sub.add_parser("flight", help="the last collectives of each rank (flight records)")
    fl.add_argument("dir", help="the directory the ranks trace into (ASYNCCOLL_TRACE=DIR)")
    fl.add_argument("--rank", "-r", type=int, default=None, help="only this rank")
    fl.add_argument("--all", action="store_true", help="every record, not only the latest")
    sub.add_parser("kinds", help="list the collective kinds `schedule` can render")


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; returns the exit status (2 for bad arguments)."""
    from ..errors import TraceFormatError

    try:
        if args.inspect_command == "schedule":
            return _schedule(args)
        if args.inspect_command == "trace":
            return _trace(args)
        if args.inspect_command == "pending":
            return _pending(args)
        if args.inspect_command == "flight":
            return _flight(args)
        return _kinds()
    except (ValueError, KeyError, TraceFormatError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"asynccoll inspect: {msg}", file=sys.stderr)
        return 2
    except ImportError as exc:  # matplotlib for PNG output
        print(f"asynccoll inspect: {exc.name or exc} is needed for this output; install it "
              "(pip install 'asynccoll[plot]')", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`... | head`): silence the flush at exit, as Python's docs advise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _kinds() -> int:
    from .kinds import algorithms, available_kinds

    for name, help_ in available_kinds().items():
        algos = algorithms(name)
        print(f"{name:18} {help_}" + (f" [--algorithm {'|'.join(algos)}]" if algos else ""))
    return 0


def _emit(text: str, out: str | None) -> None:
    if out is None:
        sys.stdout.write(text)
    else:
        Path(out).write_text(text, encoding="utf-8")


def _schedule(args: argparse.Namespace) -> int:
    from .kinds import build, build_all, check_args
    from .render import render, render_png

    check_args(args.kind, args.ranks, args.rank, args.size)
    if args.rank is not None:
        scheds = [build(args.kind, args.rank, args.ranks, args.size, args.algorithm)]
    else:
        scheds = build_all(args.kind, args.ranks, args.size, args.algorithm)
    if args.format == "png":
        if args.out is None:
            raise ValueError("--format png needs --out FILE.png")
        render_png(scheds, args.out, title=f"{args.kind}, P={args.ranks}" + (
            "" if args.rank is None else f", rank {args.rank}"))
        return 0
    color = args.format == "text" and args.out is None and sys.stdout.isatty()
    _emit(render(scheds, args.format, kind=args.kind, color=color), args.out)
    return 0


def _trace(args: argparse.Namespace) -> int:
    from .perfetto import perfetto_json, timeline_page, timeline_png
    from .summary import execution_detail, render_execution, render_summary, summarize
    from .tracefile import load_dir
    from .visible import internal_ids, user_traces

    every = load_dir(args.dir)
    ids = internal_ids(every)
    show_all = args.show_all or args.sched_id in ids  # one asked for by its id is shown
    traces = user_traces(every, show_all)
    hidden = [] if show_all else sorted({str(rec.get("collective")) for rt in every.values()
                                         for sid, rec in rt.schedules.items() if sid in ids})
    if args.stragglers is not None:
        from .stragglers import render_stragglers, stragglers, stragglers_png

        reps = [r for r in stragglers(traces) if args.sched_id in (None, r.sched_id)]
        sys.stdout.write(render_stragglers(reps))
        if args.stragglers:
            stragglers_png(reps, args.stragglers, f"lateness, trace {args.dir}")
            print(f"wrote {args.stragglers}")
        return 0
    if args.execution is not None:
        sys.stdout.write(render_execution(execution_detail(traces, args.execution,
                                                           args.sched_id)))
    else:
        sums = [s for s in summarize(traces) if args.sched_id in (None, s.sched_id)]
        sys.stdout.write(render_summary(sums))
    if hidden:
        print(f"(the runtime's own collectives are hidden: {', '.join(hidden)}; --all shows "
              "them)")
    if args.perfetto:
        Path(args.perfetto).write_text(perfetto_json(traces), encoding="utf-8")
        print(f"wrote {args.perfetto} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.html:
        Path(args.html).write_text(timeline_page(traces, f"trace {args.dir}"), encoding="utf-8")
        print(f"wrote {args.html}")
    if args.png:
        timeline_png(traces, args.png, f"trace {args.dir}")
        print(f"wrote {args.png}")
    return 0


def _pending(args: argparse.Namespace) -> int:
    from .pending import explain, render_explanations
    from .tracefile import load_dir

    if args.pid is not None:
        before = {p: p.stat().st_size for p in Path(args.dir).glob("rank-*.jsonl")}
        try:
            os.kill(args.pid, signal.SIGUSR1)
        except ProcessLookupError:
            raise ValueError(f"--pid {args.pid}: no such process") from None
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:  # a one-shot wait for the dump, not a hot loop
            now = {p: p.stat().st_size for p in Path(args.dir).glob("rank-*.jsonl")}
            if now != before:
                break
            time.sleep(0.05)
    sys.stdout.write(render_explanations(explain(load_dir(args.dir))))
    return 0


def _flight(args: argparse.Namespace) -> int:
    from ..sched.flight import flight_text
    from .tracefile import load_dir

    traces = load_dir(args.dir)
    if args.rank is not None and args.rank not in traces:
        raise ValueError(f"--rank {args.rank}: no trace file of that rank in {args.dir!r} "
                         f"(ranks: {sorted(traces)})")
    shown = 0
    for r, rt in sorted(traces.items()):
        if args.rank not in (None, r):
            continue
        for rec in rt.flights if args.all else rt.flights[-1:]:
            print(f"rank {r}, {rec.get('reason', '?')}:")
            sys.stdout.write(flight_text(rec.get("entries") or [], r))
            shown += 1
    if not shown:
        print("no flight records: a rank writes one on a timeout or on SIGUSR1 "
              "(`asynccoll inspect pending DIR --pid PID`)")
    return 0
