"""The ``asynccoll`` command.

``asynccoll demo`` (the README's main job, :mod:`asynccoll.demo`), ``asynccoll run`` (the
launcher), ``asynccoll inspect`` and ``asynccoll sim``; each subcommand lives in its own
module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


#: subcommand -> (module that defines it, help). Each module has ``configure(parser)`` and
#: ``run(args) -> int``; imported only when its subcommand is used.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("asynccoll.demo", "run the demo (the README's main job)"),
    "run": ("asynccoll.launch.cli", "start N ranks of a script, locally or across hosts"),
    "inspect": ("asynccoll.inspect.cli", "render schedules, summarise traces, explain hangs"),
    "sim": ("asynccoll.sim.cli", "simulate policies at scale, calibrate, replay traces"),
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
            mod = importlib.import_module(module)
            mod.configure(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    code: int = args._run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
