"""``failslow analyze``, ``export`` and ``simulate``: offline detection on trace files
(greyhound 4.2), a run's rings as JSONL, and mitigation policies in the cluster simulator."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from failslow.errors import EXIT_USAGE, FailslowError


def _cmd_analyze(args: argparse.Namespace) -> int:
    from failslow.analyze import analyze_trace
    from failslow.traceio import read_trace

    results = {}
    failed = False
    for path in args.files:
        try:
            results[path] = analyze_trace(read_trace(path))
        except FailslowError as exc:
            print(f"failslow analyze: {exc}", file=sys.stderr)
            failed = True
    if args.json:
        print(json.dumps({p: a.to_json() for p, a in results.items()}, indent=None))
    else:
        _print_analyses(list(results.values()))
    return EXIT_USAGE if failed else 0


def _print_analyses(analyses: list) -> None:
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for a in analyses:
        times = a.iteration_times
        head = f"[bold]{a.path}[/bold]: {len(times)} iterations"
        if a.period_calls is not None:
            head += f", period {a.period_calls} calls"
        if a.ranks:
            head += f", {a.ranks} ranks"
        if len(times):
            head += f", median {float(np.median(times)):.4f} s"
        if a.left_out:
            head += f"; left out: {a.left_out} periodic slow steps"
            head += f" ({a.special_steps} with calls of their own)" if a.special_steps else ""
        if a.transients:  # verified, but over before they persisted (issue 47)
            head += f"; {len(a.transients)} transient slowdowns (not fail-slows)"
        console.print(head, soft_wrap=True)
        if not a.events:
            console.print("  no fail-slow detected")
            continue
        table = Table("event", "iteration", "reported at", "before (s)", "after (s)", "change")
        for e in a.events:
            style = "red" if e.type == "onset" else "green"
            table.add_row(
                f"[{style}]{e.type}[/{style}]",
                str(e.iteration),
                str(e.detected_at),
                f"{e.before_s:.4f}",
                f"{e.after_s:.4f}",
                f"{e.change:+.1%}",
            )
        console.print(table)


def _cmd_export(args: argparse.Namespace) -> int:
    from failslow.traceio import export_rings

    if args.output in (None, "-"):
        written, lost = export_rings(args.ring_dir, sys.stdout)
    else:
        with open(args.output, "w") as fh:
            written, lost = export_rings(args.ring_dir, fh)
    print(f"failslow export: {written} events written, {lost} lost", file=sys.stderr)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console

    from failslow.sim.report import simulate
    from failslow.sim.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    policies = args.policies.split(",") if args.policies else None
    out = Path(args.out or f"runs/simulate-{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    simulate(scenario, policies, out, Console(width=max(Console().width, 120)))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("analyze", help="detect fail-slows in iteration-time CSVs or event JSONL")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_analyze)

    p = sub.add_parser("export", help="export a run's event rings as JSONL")
    p.add_argument("ring_dir", metavar="RING_DIR")
    p.add_argument("-o", "--output", metavar="FILE", help="output file (default: stdout)")
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("simulate", help="simulate mitigation policies on a shipped scenario")
    p.add_argument("scenario", metavar="SCENARIO", help="greyhound-table6, odyssey-vb or scale-16k")
    p.add_argument("--policies", help="comma-separated (default: the scenario's own list)")
    p.add_argument("--out", help="output directory (default: runs/simulate-<name>-<time>)")
    p.set_defaults(func=_cmd_simulate)
