"""``failslow report`` and ``failslow top``: a run as one HTML file, a running job live."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _cmd_report(args: argparse.Namespace) -> int:
    from failslow.observe.report import write_report

    path = write_report(Path(args.run_dir), Path(args.output) if args.output else None)
    print(f"failslow report: {path}")
    return 0


def _cmd_top(args: argparse.Namespace) -> int:
    from failslow.observe.top import TopOptions, run_top

    return run_top(
        TopOptions(
            store_url=args.store,
            once=args.once,
            as_json=args.json,
            interval_s=args.interval,
            ranks=args.ranks,
        )
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "report", help="one self-contained HTML file for a run (demo, failslow run, simulate)"
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory")
    p.add_argument("-o", "--output", metavar="FILE", help="default: RUN_DIR/report.html")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("top", help="a live view of a running job, from its control store")
    p.add_argument("--store", required=True, metavar="URL", help="the job's control store")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="with --once: one JSON object")
    p.add_argument(
        "--interval", type=float, default=2.0, metavar="SECONDS", help="refresh (default 2)"
    )
    p.add_argument(
        "--ranks", type=int, default=16, metavar="K", help="show the K slowest ranks (16)"
    )
    p.set_defaults(func=_cmd_top)
