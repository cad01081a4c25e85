"""Throughput of a job with a straggler: unmitigated vs failslow (S2), one run each.

Usage::

    python benchmarks/straggler_mitigation.py [--framework deepspeed|megatron|accelerate|...]
        [--steps 200]
        [--slow-start 60] [--repeat 1] [--loop user|train_batch] [--hog N]
        [--micro-batch-size N] [--width N] [--loader failslow|own|prepared] [--zero 1|2]
        [--mesh hsdp|full]
        [--launcher demo|failslow-run] [--fault compute|device] [--device-factor 4]
        [--world-size 4] [--slow-rank 2]

``--framework deepspeed`` (default) runs ``failslow demo --framework deepspeed``'s job: 4 ranks,
ZeRO-1, CPU/gloo, 4 micro-batches of 128 per replica per step, trained by the loop DeepSpeed's
tutorials teach (``--loop user``: forward, backward, step over the loader) or by
``engine.train_batch()``. ``--framework megatron`` runs ``failslow demo --framework megatron``'s:
a Megatron-core GPT on TP1 x PP2 x DP2 (Megatron DDP, Adam, 1F1B), 4 micro-batches of 8
sequences per replica per step, the Megatron-LM loop with ``fs.forward_backward`` (``--loader
own``: over the loop's own Megatron-LM data iterator, re-cut by failslow per plan; default
``fs.data_iterator``). ``--zero 2`` runs the DeepSpeed job on ZeRO-2, where S2 takes the size
form (every replica runs its 4 micro-batches, a plan changes their samples; issue 46).
``--framework accelerate`` runs ``failslow demo --framework accelerate``'s: the DeepSpeed job's
MLP as FSDP2 over 4 ranks (``unshard_once``) under ``accelerate launch``, in Accelerate's own
``accumulate`` loop over the job's own prepared DataLoader, re-cut per plan (rank 0 writes the
full parameters). ``--framework transformers`` runs
``failslow demo --framework transformers``'s: a small GPT-2 trained by ``Trainer.train()``
(DDP, gradient accumulation 4, per-device batch 8) under ``accelerate launch``, S2 by size
(``--zero 1``/``2``: on the Trainer's DeepSpeed path, failslow from the config's block).
``--framework lightning`` runs ``failslow demo --framework lightning``'s: the DeepSpeed job's
MLP trained by Lightning's ``Trainer.fit()`` (strategy ddp, ``accumulate_grad_batches=4``),
S2 by size over the loader Lightning built.
``--framework fsdp`` runs the HSDP 2 x 2 job (``--mesh full``: pure FSDP2 over the 4 ranks, S2
by size). Rank 2 is
SIGSTOP/SIGCONT-cycled from outside (75% stopped, ~4x slower) from ``--slow-start`` to the end;
``--fault device``: instead its device computes ``--device-factor`` times slower while its host
and its part in the collectives run at full speed (:mod:`failslow.demo.slow_device`, a
throttled GPU).
Both runs train on the same data; the unmitigated run has no control plane, the failslow run
detects, validates, plans and applies S2 by itself. Printed (ratios, since the machine is
shared): the healthy step (steps 10 to slow-start, both runs), the slowed step without
mitigation, the failslow step once the plan is in effect (steady) and over the whole slowed
window (detection, validation pauses and re-checks included), the share of the slowdown removed
- ``(unmitigated - failslow) / (unmitigated - healthy)``; falcon: 60.1%, greyhound Fig. 14: up
to 1.59x - and the largest parameter difference between the two runs over every rank's
parameters (invariant 2; fp32, relative to each tensor's largest value).

The closed loop (issue 44): every action of the failslow run with what became of it - in effect
or not (what the ranks reported running), and the controller's verdict a few steps later (its
measured step time against its prediction: pays, or short - re-planned or reverted) - and
whether any plan was left in place without effect (the last column must say "none").
``--launcher failslow-run``: both runs started as users start a job - the unmitigated one by
plain ``torchrun --standalone --nproc-per-node 4 -m <worker>``, the failslow one by ``failslow
run --controller 4 -- torchrun ...`` (capture, controller and mitigator in that launcher);
default ``demo``: the demo's own launcher and in-process control plane (the records before
2026-11-30).
``--hog N`` runs N busy loops beside both runs (a CPU-saturated machine: moving micro-batches
between ranks that share its cores cannot help, and the run must find that out by itself).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from failslow.demo.mitigation import (
    JOBS,
    MitigationDemoOptions,
    job_name,
    run_mitigation_demo,
    step_times_of,
)


@contextlib.contextmanager
def hog(n: int) -> Iterator[None]:
    """``n`` busy loops beside the runs (ended by PID)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def describe(actions: list[dict[str, Any]]) -> tuple[str, str]:
    """Every action and what became of it; and the plans left in effect without paying (or
    not in effect and not rolled back) - "none" when the closed loop did its job."""
    lines, left = [], []
    for i, a in enumerate(actions):
        if not a.get("committed"):
            lines.append(f"{a['action']} {a['counts']}: not committed ({a['reason']})")
            continue
        outcome = a.get("outcome") or {}
        verdict = outcome.get("verdict")
        text = f"{a['action']} {a['counts']} @{a['apply_step']}: {a.get('effect') or 'unchecked'}"
        if a.get("effect_detail"):
            text += f" ({a['effect_detail']})"
        if outcome.get("measured_s") is not None:
            text += (f", measured {outcome['measured_s']:.3f} vs predicted "
                     f"{outcome.get('predicted_s') or float('nan'):.3f}: {verdict}")  # fmt: skip
        drift = a.get("drift") or {}
        if drift.get("measured_s") is not None:
            text += f"; stopped paying ({drift['measured_s']:.3f} s): {drift.get('then')}"
        lines.append(text)
        later = actions[i + 1 :]
        undone = any(b.get("committed") for b in later)
        if a.get("effect") == "not in effect" and not undone:
            left.append(f"{a['action']} @{a['apply_step']} not in effect")
        if verdict == "short" and not undone:
            left.append(f"{a['action']} @{a['apply_step']} short, kept")
    return "\n".join(lines) or "-", ", ".join(left) or "none"


def one_pair(
    base: Path,
    steps: int,
    start: int,
    loop: str,
    framework: str,
    micro_batch_size: int | None = None,
    width: int | None = None,
    loader: str | None = None,
    zero: int | None = None,
    launcher: str = "demo",
    mesh: str | None = None,
    fault: str = "compute",
    device_factor: float = 4.0,
    world_size: int = 4,
    slow_rank: int = 2,
) -> dict[str, Any]:
    runs = {}
    for name, mitigate in (("unmitigated", False), ("failslow", True)):
        out = base / name
        summary = run_mitigation_demo(
            MitigationDemoOptions(
                framework=framework,
                steps=steps,
                slow_start=start,
                slow_end=None,
                mitigate=mitigate,
                out_dir=out,
                live=False,
                loop=loop,
                micro_batch_size=micro_batch_size,
                width=width,
                loader=loader,
                zero=zero,
                mesh=mesh,
                launcher=launcher,
                fault=fault,
                device_factor=device_factor,
                world_size=world_size,
                slow_rank=slow_rank,
            )
        )
        runs[name] = (summary, step_times_of(out, world_size))
    (_, u_times), (f_summary, f_times) = runs["unmitigated"], runs["failslow"]
    healthy = statistics.median([*u_times[10:start], *f_times[10:start]])
    applied = [a["apply_step"] for a in f_summary["actions"] if a["action"] == "apply"]
    if not applied:
        raise SystemExit(f"failslow run applied no plan: {f_summary['actions']}")
    settle = start + 10
    unmitigated = float(np.median(u_times[settle:]))
    steady = float(np.median(f_times[applied[0] + 2 :]))
    window_u = float(np.mean(u_times[start:]))
    window_f = float(np.mean(f_times[start:]))
    rel = 0.0
    whole = ("deepspeed", "accelerate", "transformers", "lightning", "fsdp")  # rank 0: all
    files = ["parameters.npz"] if framework in whole else [
        f"parameters-rank{r}.npz" for r in range(world_size)
    ]  # fmt: skip
    for name in files:
        got, want = np.load(base / "failslow" / name), np.load(base / "unmitigated" / name)
        rel = max(
            rel,
            *(float(np.abs(got[n] - want[n]).max()) / float(np.abs(want[n]).max())
              for n in want.files),
        )  # fmt: skip
    return {
        "healthy_s": healthy,
        "unmitigated_s": unmitigated,
        "failslow_steady_s": steady,
        "window_unmitigated_s": window_u,
        "window_failslow_s": window_f,
        "removed_steady": (unmitigated - steady) / (unmitigated - healthy),
        "removed_window": (window_u - window_f) / (window_u - healthy),
        "speedup_window": window_u / window_f,
        "apply_step": float(applied[0]),
        "counts": str(next(a["counts"] for a in f_summary["actions"])),
        "param_rel_diff": rel,
        "actions": describe(f_summary["actions"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--slow-start", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--loop", choices=("user", "train_batch"), default="user")
    parser.add_argument("--framework", choices=sorted(JOBS), default="deepspeed")
    parser.add_argument("--hog", type=int, default=0, help="busy loops beside the runs")
    parser.add_argument("--micro-batch-size", type=int, help="samples per micro-batch")
    parser.add_argument("--width", type=int, help="the model's width (DeepSpeed: MLP, 256)")
    parser.add_argument(
        "--loader", help="megatron: failslow (fs.data_iterator) or own (the loop's own iterator)"
    )
    parser.add_argument(
        "--zero",
        type=int,
        choices=(1, 2),
        help="deepspeed: the job's ZeRO stage (2: S2 by size); transformers: the Trainer's "
        "DeepSpeed path",
    )
    parser.add_argument(
        "--mesh", choices=("hsdp", "full"), help="fsdp: hsdp (default) or full (pure FSDP2)"
    )
    parser.add_argument(
        "--launcher",
        choices=("demo", "failslow-run"),
        default="demo",
        help="failslow-run: plain torchrun vs failslow run --controller 4 -- torchrun",
    )
    parser.add_argument(
        "--fault",
        choices=("compute", "device"),
        default="compute",
        help="compute: rank 2 SIGSTOP-cycled (75%%); device: rank 2's compute --device-factor "
        "times slower, its collectives at full speed (failslow.demo.slow_device)",
    )
    parser.add_argument("--device-factor", type=float, default=4.0)
    parser.add_argument(
        "--world-size",
        type=int,
        default=4,
        help="ranks (2: one per core here - ranks that share cores share their CPU, which no "
        "plan moves)",
    )
    parser.add_argument("--slow-rank", type=int, default=2)
    args = parser.parse_args()
    console = Console(width=230)
    job = job_name(args.framework, zero=args.zero, mesh=args.mesh)
    loop = f", loop: {args.loop}" if args.framework == "deepspeed" else ""
    hogs = f", {args.hog} busy loops beside" if args.hog else ""
    shape = "".join(f", {k} {v}" for k, v in (("micro-batch size", args.micro_batch_size),
                                              ("width", args.width), ("loader", args.loader),
                                              ("ZeRO stage", args.zero),
                                              ("mesh", args.mesh),
                                              ("launcher", args.launcher))
                    if v)  # fmt: skip
    slow = (
        f"rank {args.slow_rank}'s device {args.device_factor:g}x slower"
        if args.fault == "device" else f"rank {args.slow_rank} stopped 75%"
    )  # fmt: skip
    table = Table(title=f"{job}, {args.world_size} ranks, {slow} (CPU/gloo){loop}{hogs}{shape}")
    for col in (
        "run",
        "healthy",
        "unmitigated",
        "failslow (plan on)",
        "removed",
        "window unmit.",
        "window failslow",
        "removed (window)",
        "plan",
        "from step",
        "param rel diff",
        "actions: effect, measured vs predicted",
        "left without effect",
    ):
        table.add_column(col)
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="failslow-dsbench-") as tmp, hog(args.hog):
            console.print(f"run {i + 1}/{args.repeat}: unmitigated, then failslow ...")
            r = one_pair(Path(tmp), args.steps, args.slow_start, args.loop, args.framework,
                         args.micro_batch_size, args.width, args.loader, args.zero,
                         args.launcher, args.mesh, args.fault,
                         args.device_factor, args.world_size, args.slow_rank)  # fmt: skip
        table.add_row(
            str(i + 1),
            f"{r['healthy_s']:.3f} s",
            f"{r['unmitigated_s']:.3f} s ({r['unmitigated_s'] / r['healthy_s']:.2f}x)",
            f"{r['failslow_steady_s']:.3f} s ({r['failslow_steady_s'] / r['healthy_s']:.2f}x)",
            f"{r['removed_steady']:.0%}",
            f"{r['window_unmitigated_s']:.3f} s",
            f"{r['window_failslow_s']:.3f} s",
            f"{r['removed_window']:.0%} ({r['speedup_window']:.2f}x)",
            r["counts"],
            f"{r['apply_step']:.0f}",
            f"{r['param_rel_diff']:.1e}",
            *r["actions"],
        )
    console.print(table)


if __name__ == "__main__":
    main()
