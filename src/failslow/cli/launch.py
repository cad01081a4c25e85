"""``failslow run``, ``update`` and ``doctor``: launch a command with failslow around it, hot
updates of the job it runs (byterobust 6.1), and whether capture works on this machine."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from failslow import envvars
from failslow.errors import FailslowError


def _cmd_run(args: argparse.Namespace) -> int:
    from failslow.node.hot_update.agent import AgentOptions
    from failslow.node.launcher import RunOptions, run

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
        store_url=args.store,
        job_token=args.job_token or os.environ.get(envvars.JOB_TOKEN) or None,
        threshold=args.threshold,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        snapshot_dir=Path(args.snapshot_dir) if args.snapshot_dir else None,
        code_dir=Path(args.code_dir) if args.code_dir else None,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        nproc_per_node=args.nproc_per_node,
        standbys=args.standbys,
        min_ranks=args.min_ranks,
        max_stage_layers=args.max_stage_layers,
        hang_after_s=args.hang_after,
        stop_checks=args.stop_checks,
        decline_every_s=args.decline_every,
        preload=tuple(m.strip() for m in (args.preload or "").split(",") if m.strip()),
        warm=args.warm,
        fork_server=args.fork_server,
        spare_delay_s=args.spare_delay,
        slots_as_hosts=args.slots_as_hosts,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        node_addr=args.node_addr,
        rdzv_timeout_s=args.rdzv_timeout,
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
    from failslow.node.hot_update import commands

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
    from failslow.node.hot_update import commands

    history = commands.locate(args.state_dir)
    updates = history.updates()
    if args.json:
        print(json.dumps([commands.to_json(u) for u in updates]))
    else:
        commands.print_table(history, updates)
    return 0


def _cmd_update_rollback(args: argparse.Namespace) -> int:
    from failslow.node.hot_update import commands

    history = commands.locate(args.state_dir)
    urgency = "lazy" if args.lazy else "urgent"
    update = history.request_rollback(args.id, urgency=urgency, note=args.note or "")
    print(f"update {update.id} ({update.urgency}) pending: {update.describe()}")
    return 0


def _cmd_update_cancel(args: argparse.Namespace) -> int:
    from failslow.node.hot_update import commands

    update = commands.locate(args.state_dir).cancel(args.id)
    print(f"update {update.id} cancelled")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from failslow.core.tracking import native
    from failslow.nccl_hook import doctor

    report = doctor.diagnose()  # capture; the analyzer's own kernel is not capture's to check
    report.add("tracking", *native.status())
    return doctor.main(as_json=args.json, report=report)


def _cmd_build_hook(args: argparse.Namespace) -> int:
    from failslow.nccl_hook import native_hook

    try:
        path = native_hook.built()
        if path is None or args.force:
            print(f"failslow build-hook: compiling {native_hook.SOURCE.name} for this torch "
                  "(about a minute)", file=sys.stderr)
            path = native_hook.build(verbose=args.verbose)
    except ImportError as exc:
        raise FailslowError(f"torch is not importable ({exc}); the hook needs torch") from exc
    except native_hook.NativeHookError as exc:
        raise FailslowError(str(exc).removeprefix("failslow: ")) from exc
    print(path)
    return 0


def register(sub: Any) -> None:
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
        help="run the job's controller here, for a job of WORLD_SIZE ranks (without --store: "
        "an embedded control store on 127.0.0.1, one node)",
    )
    p.add_argument(
        "--store",
        metavar="URL",
        help="the job's control store, the same on every node: redis://[:PW@]HOST:PORT/DB, "
        "rediss://... (TLS), tcp://HOST:PORT (tcp://HOST:PORT?master=1 hosts it here)",
    )
    p.add_argument(
        "--job-token",
        metavar="TOKEN",
        help="the job's secret for pause requests and plans, the same on every node "
        "(default: $FAILSLOW_JOB_TOKEN, else generated by the launcher with --controller)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="embedded controller: slow when > this x the peers' median (default: "
        "detection.threshold, FAILSLOW__DETECTION__THRESHOLD, else 1.1)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics of this node (and of the controller) on PORT (0: a free "
        "port, printed); default: observe.metrics_port, else none",
    )
    p.add_argument(
        "--metrics-addr",
        metavar="ADDR",
        help="the metrics endpoint's address (default 127.0.0.1; 0.0.0.0 to be scraped from "
        "other machines)",
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
    p.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="start N ranks here, as torchrun would (CMD is SCRIPT [ARGS] or -m MODULE [ARGS]), "
        "from warm processes, with a dead rank noticed at once and its survivors released",
    )
    p.add_argument(
        "--standbys",
        type=int,
        default=0,
        metavar="S",
        help="with --nproc-per-node: S standby slots; a failed rank's slot is evicted onto one",
    )
    p.add_argument(
        "--min-ranks",
        type=int,
        metavar="K",
        help="with --nproc-per-node: a failed rank's slot with no standby left is dropped and the "
        "job goes on with one rank fewer, down to K ranks, from the in-memory snapshots "
        "(default: it restarts on its own slot)",
    )
    p.add_argument(
        "--hang-after",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="with --nproc-per-node: no collective on any rank for this long is a hang; stack "
        "aggregation (py-spy) names the parallel group to evict and the job restarts from "
        "memory without it. Keep it above the longest time one rank works alone while the "
        "others wait (rank 0 writing a checkpoint to disk), or that rank is the outlier; "
        "with --nnodes, node 0 looks across every node's ranks (default 300; 0: off)",
    )
    p.add_argument(
        "--decline-every",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --nproc-per-node and --controller: when the step time is up and the "
        "validation round finds every rank healthy (an unexplained decline), start a round of "
        "5 stack samples of every rank this often, 5 rounds, and evict the parallel group "
        "flagged in more than half of them if the step time is still up (byterobust 5.1; 10 "
        "is the paper's; default 0: off)",
    )
    p.add_argument(
        "--stop-checks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --nproc-per-node and in-memory snapshots: when a rank's metrics go bad, test "
        "every machine first (device, links, a bitwise-alignment reference step) and evict "
        "the ones that fail, before the reattempt (byterobust 4.2; a few seconds per incident)",
    )
    p.add_argument(
        "--max-stage-layers",
        type=int,
        metavar="L",
        help="with --min-ranks, for a job that reports its layers (Megatron-core): the most "
        "transformer layers one rank can hold; odyssey chooses between dropping the replicas "
        "that lost a rank (reroute) and a new PP x DP layout (reconfigure) within it "
        "(default: any)",
    )
    p.add_argument(
        "--preload",
        metavar="MODULES",
        help="with --nproc-per-node: modules the warm processes import before they get a rank, "
        "comma-separated (torch always; add the framework: --preload deepspeed)",
    )
    p.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --nproc-per-node: keep a warm spare per rank, so restarts skip the imports",
    )
    p.add_argument(
        "--fork-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --nproc-per-node: import --preload once, in one process, and fork every rank, "
        "spare and stop-time check from it (copy-on-write: N ranks pay the framework's import "
        "once); --no-fork-server: each rank process imports for itself",
    )
    p.add_argument(
        "--spare-delay",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="with --nproc-per-node: start the warm spares this long after a launch, one at a "
        "time, so they do not slow the ranks' own start (default 10)",
    )
    p.add_argument(
        "--slots-as-hosts",
        action="store_true",
        help="with --nproc-per-node, one machine standing for several (tests, demos): each "
        "slot is a host with its own snapshot memory, lost when the slot is evicted",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="with --nproc-per-node and --store: the job's nodes, each running failslow run "
        "with its --node-rank; a rank that fails anywhere restarts every node's ranks from "
        "memory (default 1)",
    )
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (0: the first)")
    p.add_argument(
        "--node-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address the other nodes reach this node at: node 0 hosts each launch's "
        "rendezvous there (default 127.0.0.1)",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a node waits for node 0's rendezvous of each launch (default 600)",
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

    p = sub.add_parser(
        "build-hook",
        help="compile the collective hook's C++ kernel for the installed torch",
        description="Compile failslow/nccl_hook/native/hook.cpp against the installed torch "
        "into ~/.cache/failslow/hook (once per torch version; ./dev setup runs it). Without "
        "it the hook records every collective from Python (about 0.1-0.3 ms per call).",
    )
    p.add_argument("--force", action="store_true", help="compile even if it is built")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.set_defaults(func=_cmd_build_hook)

    p = sub.add_parser("doctor", help="check that capture (shim, NCCL, Python hook) works here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_doctor)
