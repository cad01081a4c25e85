"""The ``failslow`` command.

Subcommands, one module each group: ``analyze``, ``export``, ``simulate`` (:mod:`.analysis`),
``demo`` (:mod:`.demo`), ``controller``, ``node``, ``config`` (:mod:`.control`), ``run``,
``update``, ``doctor``, ``build-hook`` (:mod:`.launch`), ``report``, ``top``
(:mod:`.observe`). User errors print one line and exit with status 2; nothing prints a
traceback for them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from failslow import __version__
from failslow.cli import analysis, control, demo, launch, observe
from failslow.errors import EXIT_USAGE, FailslowError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="failslow", description="Detect and mitigate fail-slows in distributed training."
    )
    parser.add_argument("--version", action="version", version=f"failslow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (analysis, demo, control, launch, observe):
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] | None = None
    if argv[:1] == ["run"] and "--" in argv:  # everything after -- belongs to CMD
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    if argv[:1] == ["run"]:  # stray words become one readable error in _cmd_run
        args, unknown = parser.parse_known_args(argv)
        args.stray = [*args.stray, *unknown]
        args.cmd = command
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except FailslowError as exc:
        print(f"failslow {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"failslow {args.command}: interrupted", file=sys.stderr)
        return 130
