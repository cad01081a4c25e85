"""The ``failslow`` command.

Subcommands: ``analyze`` (offline detection on trace files, greyhound 4.2), ``export`` (a run's
event rings to JSONL), ``demo`` (a real 4-rank training job with an injected fail-slow), ``run``
(launch a command with capture on), ``doctor`` (can capture work on this machine), ``update``
(hot updates of a job ``run`` launched, byterobust 6.1).
User errors print one line and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from failslow import __version__
from failslow.errors import FailslowError

EXIT_USAGE = 2


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
        console.print(head, soft_wrap=True)
        if not a.events:
            console.print("  no fail-slow detected")
            continue
        table = Table("event", "iteration", "before (s)", "after (s)", "change")
        for e in a.events:
            style = "red" if e.type == "onset" else "green"
            table.add_row(
                f"[{style}]{e.type}[/{style}]",
                str(e.iteration),
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


DEMO_DEFAULTS = {
    # framework: (iterations, slow start, slow end, stopped fraction)
    "torch": (200, 70, 140, 0.7),
    "deepspeed": (260, 60, 180, 0.75),
}


def _cmd_demo(args: argparse.Namespace) -> int:
    iterations, start, end, stopped = (
        default if given is None else given
        for given, default in zip(
            (args.iterations, args.slow_start, args.slow_end, args.stopped_fraction),
            DEMO_DEFAULTS[args.framework],
            strict=True,
        )
    )
    out_dir = Path(args.out) if args.out else None
    if args.framework == "deepspeed":
        from failslow.demo.mitigation import MitigationDemoOptions, run_mitigation_demo

        run_mitigation_demo(
            MitigationDemoOptions(
                world_size=args.world_size,
                steps=iterations,
                slow_rank=args.slow_rank,
                slow_start=start,
                slow_end=end,
                stopped_fraction=stopped,
                out_dir=out_dir,
                live=not args.no_live,
            )
        )
        return 0
    from failslow.demo.launcher import DemoOptions, run_demo

    options = DemoOptions(
        world_size=args.world_size,
        iterations=iterations,
        slow_rank=args.slow_rank,
        slow_start=start,
        slow_end=end,
        stopped_fraction=stopped,
        out_dir=out_dir,
        live=not args.no_live,
    )
    return run_demo(options)


def _until_signalled() -> Any:
    """A stop() predicate that turns true on SIGINT or SIGTERM."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop.is_set


def _config_from_args(args: argparse.Namespace, **shortcuts: Any) -> Any:
    """FailslowConfig from ``--config FILE`` (JSON: a DeepSpeed config's ``"failslow"`` block or
    failslow's own settings), the environment, ``--set KEY=VALUE`` and option shortcuts."""
    from failslow.config import load_config
    from failslow.errors import ConfigError

    data, source = None, "failslow config"
    if getattr(args, "config", None):
        try:
            data = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--config {args.config}: {exc}") from None
        if isinstance(data, dict) and isinstance(data.get("failslow"), dict):
            data, source = data["failslow"], f"{args.config}: failslow"
        else:
            source = args.config
    overrides = {k: v for k, v in shortcuts.items() if v is not None}
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. detection.threshold=1.2")
        overrides[key.strip()] = value
    return load_config(data, source=source, overrides=overrides)


def _cmd_controller(args: argparse.Namespace) -> int:
    from failslow.control_plane import ControlPlane
    from failslow.core.control.store import open_store

    config = _config_from_args(
        args, **{"detection.threshold": args.threshold, "validation.link_mb": args.link_mb}
    )
    store = open_store(args.store)  # unreachable: StoreUnavailable -> one line, exit 2
    print(f"failslow controller: {args.world_size} ranks, store {args.store}", flush=True)
    plane = ControlPlane(
        store,
        config,
        world_size=args.world_size,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        on_diagnosis=lambda d: print(d.to_json(), flush=True),
    ).start()
    stop = _until_signalled()
    import time

    while not stop():
        time.sleep(0.2)
    plane.stop()
    return 0


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="JSON settings, or a DeepSpeed config with a failslow block")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="e.g. planner.min_gain=0.1")


def _cmd_config(args: argparse.Namespace) -> int:
    print(json.dumps(_config_from_args(args).to_dict(), indent=2))
    return 0


def _cmd_node(args: argparse.Namespace) -> int:
    import time

    from failslow.core.control.publisher import NodePublisher
    from failslow.core.control.resilient import ResilientStore
    from failslow.core.local_analyzer import LocalAnalyzer

    publisher = NodePublisher(LocalAnalyzer(Path(args.ring_dir)), ResilientStore(args.store))
    stop = _until_signalled()
    print(f"failslow node: {args.ring_dir} -> {args.store}", flush=True)
    while not stop():
        publisher.poll()
        time.sleep(args.poll_s)
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


def _cmd_run(args: argparse.Namespace) -> int:
    from failslow.hot_update.agent import AgentOptions
    from failslow.nccl_hook.run import RunOptions, run

    if args.stray and args.cmd is not None:
        raise FailslowError(f"unrecognized arguments before --: {' '.join(args.stray)}")
    if args.stray:
        raise FailslowError("put -- before the command: failslow run [options] -- CMD [ARGS...]")
    options = RunOptions(
        command=list(args.cmd or []),
        ring_dir=Path(args.ring_dir) if args.ring_dir else None,
        capacity=args.capacity,
        pause_timeout_s=args.pause_timeout,
        shim=not args.no_shim,
        python_hook=args.python_hook,
        controller_world_size=args.controller,
        threshold=args.threshold,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        snapshot_dir=Path(args.snapshot_dir) if args.snapshot_dir else None,
        code_dir=Path(args.code_dir) if args.code_dir else None,
        agent=AgentOptions(
            max_restarts=args.max_restarts,
            probation_s=args.probation,
            window_s=args.update_window,
            poll_s=args.update_poll,
            stop_timeout_s=args.stop_timeout,
        ),
    )
    return run(options)


def _cmd_update_submit(args: argparse.Namespace) -> int:
    from failslow.hot_update import commands

    history = commands.locate(args.state_dir)
    update = commands.submit(
        history,
        urgent=args.urgent,
        command=args.new_command,
        env=args.env or [],
        unset_env=args.unset_env or [],
        code_dir=args.code_dir,
        note=args.note or "",
        window_s=args.window,
    )
    print(f"update {update.id} ({update.urgency}) pending: {update.describe()}")
    return 0


def _cmd_update_list(args: argparse.Namespace) -> int:
    from failslow.hot_update import commands

    history = commands.locate(args.state_dir)
    updates = history.updates()
    if args.json:
        print(json.dumps([commands.to_json(u) for u in updates]))
    else:
        commands.print_table(history, updates)
    return 0


def _cmd_update_rollback(args: argparse.Namespace) -> int:
    from failslow.hot_update import commands

    history = commands.locate(args.state_dir)
    urgency = "lazy" if args.lazy else "urgent"
    update = history.request_rollback(args.id, urgency=urgency, note=args.note or "")
    print(f"update {update.id} ({update.urgency}) pending: {update.describe()}")
    return 0


def _cmd_update_cancel(args: argparse.Namespace) -> int:
    from failslow.hot_update import commands

    update = commands.locate(args.state_dir).cancel(args.id)
    print(f"update {update.id} cancelled")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from failslow.nccl_hook.doctor import main as doctor

    return doctor(as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="failslow", description="Detect and mitigate fail-slows in distributed training."
    )
    parser.add_argument("--version", action="version", version=f"failslow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("analyze", help="detect fail-slows in iteration-time CSVs or event JSONL")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_analyze)

    p = sub.add_parser("export", help="export a run's event rings as JSONL")
    p.add_argument("ring_dir", metavar="RING_DIR")
    p.add_argument("-o", "--output", metavar="FILE", help="output file (default: stdout)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("demo", help="run a 4-rank gloo job with an injected compute fail-slow")
    p.add_argument(
        "--framework",
        choices=sorted(DEMO_DEFAULTS),
        default="torch",
        help="torch: detection on a DDP job; deepspeed: detection, diagnosis and automatic S2 "
        "mitigation of a DeepSpeed ZeRO-1 job, with before/after throughput",
    )
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--iterations", type=int, help="steps (torch 200, deepspeed 260)")
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--slow-start", type=int, help="iteration the slowdown starts (70, 60)")
    p.add_argument("--slow-end", type=int, help="iteration the slowdown ends (140, 180)")
    p.add_argument(
        "--stopped-fraction",
        type=float,
        help="share of wall time the slow rank is SIGSTOPped while the slowdown lasts (0.7, 0.75)",
    )
    p.add_argument("--out", help="run directory (default: runs/demo-<time>)")
    p.add_argument("--no-live", action="store_true", help="no live display (plain log lines)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("controller", help="run the job's controller (profiling, validation)")
    p.add_argument("--store", required=True, help="tcp://HOST:PORT or redis://HOST:PORT/DB")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--log-dir", help="where diagnosis-<n>.json files go")
    p.add_argument("--threshold", type=float, help="slow when > x peers' median (1.1)")
    p.add_argument("--link-mb", type=int, help="link-test message size (MB, 16)")
    _config_args(p)
    p.set_defaults(func=_cmd_controller)

    p = sub.add_parser("config", help="print the effective settings (defaults, file, env, --set)")
    _config_args(p)
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("node", help="publish this node's onsets and group summaries")
    p.add_argument("--store", required=True, help="tcp://HOST:PORT or redis://HOST:PORT/DB")
    p.add_argument("--ring-dir", required=True)
    p.add_argument("--poll-s", type=float, default=0.1)
    p.set_defaults(func=_cmd_node)

    p = sub.add_parser("simulate", help="simulate mitigation policies on a shipped scenario")
    p.add_argument("scenario", metavar="SCENARIO", help="greyhound-table6, odyssey-vb or scale-16k")
    p.add_argument("--policies", help="comma-separated (default: the scenario's own list)")
    p.add_argument("--out", help="output directory (default: runs/simulate-<name>-<time>)")
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser(
        "run",
        help="launch a command with capture on: failslow run [options] -- CMD ...",
        usage="failslow run [options] -- CMD [ARGS...]",
    )
    p.add_argument("--ring-dir", help="where the rings go (default: a new /dev/shm/failslow-*)")
    p.add_argument("--capacity", type=int, help="records per ring, a power of two")
    p.add_argument(
        "--pause-timeout",
        type=float,
        metavar="SECONDS",
        help="a paused rank resumes on its own after this long (default 60)",
    )
    p.add_argument("--no-shim", action="store_true", help="no LD_PRELOAD shim (Python hook only)")
    p.add_argument(
        "--python-hook",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="turn the Python hook on in every Python process of CMD (default: on)",
    )
    p.add_argument(
        "--controller",
        type=int,
        metavar="WORLD_SIZE",
        help="embed the controller (and this node's publisher) for a job of WORLD_SIZE ranks",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=1.1,
        help="embedded controller: slow when > this x the peers' median (default 1.1)",
    )
    p.add_argument("--state-dir", help="the update history's directory (default: the ring dir)")
    p.add_argument("--snapshot-dir", help="FAILSLOW_SNAPSHOT_DIR (default: in /dev/shm)")
    p.add_argument("--code-dir", help="CMD's code directory (its working dir; updates replace it)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart CMD in place after this many failures at most (default 0)",
    )
    p.add_argument(
        "--probation",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="roll an update back when CMD fails this soon after it (default 600)",
    )
    p.add_argument(
        "--update-window",
        type=float,
        default=24 * 3600.0,
        metavar="SECONDS",
        help="apply a lazy update at the latest this long after it was submitted (default 24 h)",
    )
    p.add_argument("--update-poll", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="SIGTERM CMD this long after its ranks agreed to stop for an update (default 300)",
    )
    p.add_argument("stray", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_run, cmd=None)

    p = sub.add_parser("update", help="hot updates of a running job: submit, list, rollback")
    update = p.add_subparsers(dest="update_command", required=True, metavar="ACTION")
    state = argparse.ArgumentParser(add_help=False)
    state.add_argument(
        "--state-dir",
        help="the job's state directory (failslow run prints it; $FAILSLOW_STATE_DIR)",
    )
    q = update.add_parser("submit", parents=[state], help="record an update for the launcher")
    when = q.add_mutually_exclusive_group()
    when.add_argument("--urgent", action="store_true", help="stop the job now and restart it")
    when.add_argument("--lazy", action="store_true", help="at the next failure (default)")
    q.add_argument("--env", action="append", metavar="NAME=VALUE", help="set a variable")
    q.add_argument("--unset-env", action="append", metavar="NAME", help="unset a variable")
    q.add_argument("--command", dest="new_command", metavar="CMD", help="the new command line")
    q.add_argument("--code-dir", metavar="DIR", help="the new code directory")
    q.add_argument("--note", help="why (shown by failslow update list)")
    q.add_argument(
        "--window", type=float, metavar="SECONDS", help="lazy: apply at the latest after this"
    )
    q.set_defaults(func=_cmd_update_submit)
    q = update.add_parser("list", parents=[state], help="the job's update history")
    q.add_argument("--json", action="store_true", help="print one JSON array")
    q.set_defaults(func=_cmd_update_list)
    q = update.add_parser(
        "rollback", parents=[state], help="restart with the version before update ID"
    )
    q.add_argument("id", type=int, nargs="?", metavar="ID", help="default: the last applied")
    q.add_argument("--lazy", action="store_true", help="at the next failure, not now")
    q.add_argument("--note", help="why")
    q.set_defaults(func=_cmd_update_rollback)
    q = update.add_parser("cancel", parents=[state], help="drop a pending update")
    q.add_argument("id", type=int, metavar="ID")
    q.set_defaults(func=_cmd_update_cancel)

    p = sub.add_parser("doctor", help="check that capture (shim, NCCL, Python hook) works here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_doctor)
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


if __name__ == "__main__":
    sys.exit(main())
