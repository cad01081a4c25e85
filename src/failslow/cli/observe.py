"""``failslow report``, ``failslow top`` and ``failslow stacks``: a run as one HTML file, a
running job live, and where a hung or declining job's processes stand (stack aggregation)."""

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


def _cmd_stacks(args: argparse.Namespace) -> int:
    import json

    from failslow.core.diagnosis.stacks import aggregate
    from failslow.errors import ConfigError
    from failslow.node.stacks import capture, job_topology, print_aggregation, rank_pids

    ranks = rank_pids(Path(args.ring_dir))
    if not ranks:
        raise ConfigError(f"{args.ring_dir}: no ring of a running rank (is the job running?)")
    topology = job_topology(args.store)
    if topology is not None and max(ranks) >= topology.world_size:
        topology = None  # the record is of another launch (a smaller world): ranks only
    stacks = capture(
        ranks, native=args.native, children=not args.no_children, timeout_s=args.timeout
    )
    found = aggregate(stacks, topology)
    if args.json:
        text = json.dumps(found.to_dict(), indent=2)
        if args.json == "-":
            print(text)
            return 0
        Path(args.json).write_text(text)
    print_aggregation(found)
    return 0


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

    p = sub.add_parser(
        "stacks",
        help="a hung or slowed job: every rank's stack and its children's (py-spy), grouped; "
        "the parallel group the outliers share (byterobust 5.1)",
    )
    p.add_argument("--ring-dir", required=True, metavar="DIR", help="the job's ring directory")
    p.add_argument(
        "--store", metavar="URL", help="the job's control store (its topology names the group)"
    )
    p.add_argument("--native", action="store_true", help="C/C++ frames too (py-spy --native)")
    p.add_argument(
        "--no-children", action="store_true", help="the ranks only, not their data loaders"
    )
    p.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="per process (10)"
    )
    p.add_argument("--json", metavar="FILE", help="also write the groups as JSON (- : stdout)")
    p.set_defaults(func=_cmd_stacks)
