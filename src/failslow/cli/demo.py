"""``failslow demo``: the main job - a real 4-rank job with a fail-slow injected from outside."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEMO_DEFAULTS = {
    # framework: (iterations, slow start, slow end, stopped fraction)
    "torch": (200, 70, 140, 0.7),
    "deepspeed": (260, 60, 180, 0.75),
    "megatron": (260, 60, 180, 0.75),
    "accelerate": (260, 60, 180, 0.75),
    "fsdp": (260, 60, 180, 0.75),
    "transformers": (260, 60, 180, 0.75),
    "lightning": (260, 60, 180, 0.75),
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
    if args.no_standby and args.fault != "kill":
        raise SystemExit("failslow demo: --no-standby goes with --fault kill")
    strategies = _strategies(args)
    if strategies is not None and "S4" in strategies:
        from failslow.demo.s4 import S4DemoOptions, run_s4_demo

        summary = run_s4_demo(
            S4DemoOptions(
                world_size=args.world_size,
                slow_rank=args.slow_rank,
                slow_start=args.slow_start or S4DemoOptions.slow_start,
                stopped_fraction=stopped,
                out_dir=out_dir,
                live=not args.no_live,
                strategies=tuple(strategies),
            )
        )
        moved = summary["slow_rank_moved"]  # restarted away onto a standby
        return 0 if moved and summary["parameters"].get("equal", True) else 1
    if args.fault in ("hang", "nan", "sdc", "matmul", "slow"):
        machine = args.fault in ("hang", "slow")  # the machine's: any framework's ranks
        if args.framework != "deepspeed" and not (machine and args.framework == "megatron"):
            needs = "deepspeed or megatron" if machine else "deepspeed"
            raise SystemExit(f"failslow demo: --fault {args.fault} needs --framework {needs}")
        from failslow.demo.failstop import FailstopDemoOptions, run_failstop_demo

        steps = args.iterations or FailstopDemoOptions.steps
        summary = run_failstop_demo(
            FailstopDemoOptions(
                world_size=args.world_size,
                steps=steps,
                kill_steps=(),
                victims=(),
                injected=(args.fault, args.slow_rank % args.world_size, steps * 2 // 7),
                out_dir=out_dir,
                live=not args.no_live,
                framework=args.framework,
                # a pipeline stage's fault stalls its whole pipeline: stack aggregation
                # over-evicts both machines of it (byterobust Fig. 7), each onto a standby
                standbys=2 if args.framework == "megatron" else 1,
            )
        )
        return 0 if summary["parameters"].get("equal", True) else 1
    if args.fault == "kill":
        if args.framework not in ("deepspeed", "megatron"):
            raise SystemExit("failslow demo: --fault kill needs --framework deepspeed or megatron")
        from failslow.demo.failstop import FailstopDemoOptions, run_failstop_demo

        steps = args.iterations or FailstopDemoOptions.steps
        kills = (steps * 2 // 7, steps * 9 // 14)  # 114 and 257 of the default 400
        summary = run_failstop_demo(
            FailstopDemoOptions(
                world_size=args.world_size,
                steps=steps,
                kill_steps=kills,
                victims=(args.slow_rank % args.world_size, (args.slow_rank + 3) % args.world_size),
                standbys=0 if args.no_standby else 1,
                min_ranks=args.world_size - 2 if args.no_standby else None,
                framework=args.framework,
                out_dir=out_dir,
                live=not args.no_live,
            )
        )
        return 0 if summary["parameters"].get("equal", True) else 1
    if args.fault not in ("compute", "device") and args.framework == "torch":
        raise SystemExit("failslow demo: --fault link needs --framework megatron or fsdp")
    if args.fault == "device" and args.framework == "torch":
        raise SystemExit(
            "failslow demo: --fault device needs a framework's job (--framework deepspeed, "
            "megatron, accelerate, fsdp, transformers or lightning)"
        )
    if args.framework != "torch":  # the mitigation demos
        from failslow.demo.mitigation import MitigationDemoOptions, run_mitigation_demo

        run_mitigation_demo(
            MitigationDemoOptions(
                framework=args.framework,
                world_size=args.world_size,
                steps=iterations,
                slow_rank=args.slow_rank,
                slow_start=start,
                slow_end=end,
                stopped_fraction=stopped,
                out_dir=out_dir,
                live=not args.no_live,
                loop=args.loop,
                loader=args.loader,
                zero=args.zero,
                mesh=args.mesh,
                launcher=args.launcher,
                fault=args.fault,
                link_rate=args.link_rate,
                device_factor=args.device_factor,
                failslow={"planner": {"strategies": strategies}} if strategies else {},
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


def _strategies(args: argparse.Namespace) -> list[str] | None:
    """``--strategies``: the planner's ladder for this demo (one line for what cannot run)."""
    if args.strategies is None:
        return None
    strategies = [s.strip().upper() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - {"S2", "S3", "S4"})
    if unknown or not strategies:
        raise SystemExit(f"failslow demo: --strategies takes S2, S3, S4 (not {unknown})")
    if "S4" in strategies:
        if args.framework != "deepspeed" or args.fault != "compute":
            raise SystemExit(
                "failslow demo: S4 (restart without the slow rank) is shown on the DeepSpeed "
                "job under failslow run: --framework deepspeed --fault compute --strategies S4 "
                "(or S2,S3,S4: the whole ladder)"
            )
        if args.iterations is not None or args.slow_end is not None:
            raise SystemExit(
                "failslow demo --strategies S4: the job ends 30 steps after its restart and the "
                "slowdown with the slow process; --iterations and --slow-end do not apply"
            )
    elif args.framework == "torch" or args.fault == "kill":
        raise SystemExit(
            "failslow demo: --strategies needs a demo with mitigation (--framework deepspeed, "
            "megatron, accelerate or fsdp; not --fault kill)"
        )
    return strategies


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run a 4-rank gloo job with an injected compute fail-slow")
    p.add_argument(
        "--framework",
        choices=sorted(DEMO_DEFAULTS),
        default="torch",
        help="torch: detection on a DDP job; deepspeed / megatron / accelerate / fsdp / "
        "transformers / lightning: detection, diagnosis and automatic S2 mitigation of a "
        "DeepSpeed ZeRO-1 job / a Megatron-core GPT (PP2 x DP2) / an FSDP2 job under accelerate "
        "launch / FSDP2 HSDP 2 x 2 / a Hugging Face Trainer GPT-2 (S2 by size) / a Lightning "
        "Trainer.fit() (DDP, S2 by size), with before/after throughput",
    )
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument(
        "--iterations", type=int, help="steps (torch 200, --fault kill 400, the others 260)"
    )
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--slow-start", type=int, help="iteration the slowdown starts (70, 60)")
    p.add_argument("--slow-end", type=int, help="iteration the slowdown ends (140, 180)")
    p.add_argument(
        "--stopped-fraction",
        type=float,
        help="share of wall time the slow rank is SIGSTOPped while the slowdown lasts (0.7, 0.75)",
    )
    p.add_argument(
        "--fault",
        choices=("compute", "device", "link", "kill", "hang", "nan", "sdc", "matmul", "slow"),
        default="compute",
        help="compute - the slow rank is SIGSTOP-cycled (S2); device - the slow rank's "
        "device computes --device-factor times slower, its host and collectives at full speed "
        "(a throttled GPU: S2 by size takes effect in full); link (megatron or fsdp, root) - "
        "every rank in its own network namespace, the link between ranks 0 and 1 shaped with "
        "tc (S3 swaps roles in place); kill (deepspeed or megatron) - --slow-rank and another "
        "rank are SIGKILLed at 2/7 and 9/14 of the run, the job restarts from memory on warm "
        "standbys and its parameters are compared with a run without kills; hang "
        "(deepspeed or megatron) - --slow-rank's machine hangs at 2/7 of the run, the launcher "
        "finds it by stack aggregation (on megatron: its whole pipeline, two standbys) and "
        "restarts the job from memory without it; nan (deepspeed) - "
        "--slow-rank's model gets a NaN at 2/7 of the run (once, a transient fault), its loss "
        "goes NaN and the job rolls back to the newest snapshot before it; sdc (deepspeed) - "
        "from 2/7 of the run --slow-rank's machine computes a gradient 10,000x too large (a "
        "faulty GPU): reattempt, then dual-phase replay names the machine, evicted onto the "
        "standby; matmul (deepspeed) - from 2/7 of the run every nn.Linear output of "
        "--slow-rank's machine is 8x too large: the stop-time checks' bitwise-alignment step "
        "names the machine, evicted onto the standby; slow (deepspeed or megatron) - from 2/7 of "
        "the run "
        "--slow-rank's rank spends 0.6 s per step in a slow data loader, every rank healthy in "
        "the validation round: rounds of stack samples name its machine, evicted onto the "
        "standby",
    )
    p.add_argument(
        "--device-factor",
        type=float,
        default=4.0,
        help="--fault device: how many times slower the slow rank's compute runs (4)",
    )
    p.add_argument(
        "--no-standby",
        action="store_true",
        help="--fault kill: no standby slot - each killed rank's slot is dropped and the job "
        "goes on with one rank fewer (failslow run --min-ranks), its state resharded from "
        "memory and its global batch kept (odyssey; on megatron in the grid odyssey chooses: "
        "reroute or reconfigure); parameters compared within 1e-5",
    )
    p.add_argument(
        "--link-rate", help="--fault link: the link's rate (megatron 25mbit, fsdp 200mbit)"
    )
    p.add_argument(
        "--strategies",
        help="the planner's strategies, comma-separated (default: S2; --fault link S3). S4 "
        "(deepspeed, --fault compute): the job runs under failslow run --nproc-per-node with a "
        "standby slot, and the slow rank is restarted away onto it from memory; S2,S3,S4: the "
        "ladder - S2 first, the restart once the slowdown S2 leaves has paid for it, S2 "
        "reverted after",
    )
    p.add_argument("--out", help="run directory (default: runs/demo-<time>)")
    p.add_argument("--no-live", action="store_true", help="no live display (plain log lines)")
    p.add_argument(
        "--loop",
        choices=("user", "train_batch"),
        default="user",
        help="deepspeed: the job's training loop - the one DeepSpeed's tutorials teach "
        "(forward, backward, step over the loader; default) or engine.train_batch()",
    )
    p.add_argument(
        "--loader",
        choices=("failslow", "own", "prepared"),
        help="where the ranks read their data - megatron: failslow (fs.data_iterator, default) "
        "or own (the loop's own Megatron-LM iterator); accelerate: prepared (default) or "
        "failslow (fs.loader)",
    )
    p.add_argument(
        "--mesh",
        choices=("hsdp", "full"),
        help="fsdp: hsdp (2 replicas x N/2 shards, default) or full (pure FSDP2 over every "
        "rank: S2 by size)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=(1, 2),
        help="deepspeed: the job's ZeRO stage (default 1; 2: S2 by size); transformers: the "
        "Trainer's DeepSpeed path at this ZeRO stage (failslow enabled by the DeepSpeed "
        'config\'s "failslow" block and FailslowCallback()); default: DDP',
    )
    p.add_argument(
        "--launcher",
        choices=("demo", "failslow-run"),
        default="demo",
        help="demo: the demo starts the ranks and runs the control plane itself (default); "
        "failslow-run: the job runs as users start it, failslow run --controller N -- torchrun "
        "--standalone --nproc-per-node N ..., the controller in that launcher (without "
        "mitigation: plain torchrun)",
    )
    p.set_defaults(func=_cmd_demo)
