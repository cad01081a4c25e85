"""Clean exits of unmodified scripts under ``failslow run --controller``, beside plain torchrun.

A job that finished must not be reported failed. Each case runs a 2-rank gloo DDP script (60
steps of a small MLP; the validation cases train longer, with rank 1 duty-cycled 75% from step
40 until the launcher wrote a diagnosis (at most 4 minutes), so a pause + GEMM + link
validation round happens during the run) many times with two busy loops beside it (a loaded
2-core machine, as CI is), and counts the runs whose every process exited 0:

- ``torchrun``: plain ``torchrun`` (no failslow) - the control;
- ``failslow``: ``failslow run --controller 2 -- torchrun ...``;
- ``failslow+validation``: the same with a straggler diagnosed during the run;

each with and without ``destroy_process_group()`` at the end of the script. A run counts as an
abort when any output says "terminate called" or the exit status is 134 (SIGABRT).

    python benchmarks/clean_exit.py [--runs 50] [--cases all] [--hogs 2] [--json out.json]

Prints each round's counts as it goes and a table at the end (case, runs, clean, aborts, other
failures, seconds per run); ``--runs 50`` took 95 minutes here (each run imports torch in 3-4
processes on loaded cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

TRAIN = textwrap.dedent(
    """\
    import os, sys, time
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    validation = os.environ.get("CLEAN_EXIT_VALIDATION") == "1"
    diagnoses = os.environ.get("CLEAN_EXIT_DIAGNOSES", "")
    helper, step, started = None, 0, time.time()
    while True:
        if validation and rank == 1 and step == 40:  # only under failslow run: the control
            from failslow.faults import throttle_self  # (plain torchrun) never imports failslow
            helper = throttle_self(0.75, 0.01)  # 75% of every 10 ms stopped
        x = torch.randn(64, 256)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.01)  # data loading
        step += 1
        done = step >= 60 and (not validation or time.time() - started > 240
                                or (os.path.isdir(diagnoses) and bool(os.listdir(diagnoses))))
        flag = torch.tensor([1.0 if done else 0.0])  # every step: every rank stops at one step
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            break
    if helper:
        helper.stop()
    if os.environ.get("CLEAN_EXIT_DESTROY") == "1":
        dist.destroy_process_group()
    """
)

CASES = {
    "torchrun": ("torchrun", False),
    "torchrun+destroy": ("torchrun", True),
    "failslow": ("failslow", False),
    "failslow+destroy": ("failslow", True),
    "failslow+validation": ("validation", False),
    "failslow+validation+destroy": ("validation", True),
}


def _command(kind: str, script: Path, ring_dir: Path) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2", str(script)]
    if kind == "torchrun":
        return torchrun
    launcher = [sys.executable, "-m", "failslow.cli", "run", "--controller", "2"]
    launcher += ["--threshold", "2.0", "--ring-dir", str(ring_dir), "--"]
    return launcher + torchrun


def run_once(case: str, work: Path) -> tuple[str, str]:
    """One run of ``case``: ("clean" | "abort" | "failed", detail)."""
    kind, destroy = CASES[case]
    ring_dir = Path(tempfile.mkdtemp(prefix="clean-exit-", dir="/dev/shm"))
    script = work / "train.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
    env.update(
        OMP_NUM_THREADS="1",
        CLEAN_EXIT_DESTROY="1" if destroy else "0",
        CLEAN_EXIT_VALIDATION="1" if kind == "validation" else "0",
        CLEAN_EXIT_DIAGNOSES=str(ring_dir / "diagnoses"),
        # CPU ranks on shared cores: GEMMs in turns, fp32 (bf16 matmuls here take seconds)
        FAILSLOW__VALIDATION__GEMM_SERIAL="true",
        FAILSLOW__VALIDATION__GEMM_DTYPES="float32",
    )
    try:
        out = subprocess.run(
            _command(kind, script, ring_dir),
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        return "failed", "timeout"
    finally:
        subprocess.run(["rm", "-rf", str(ring_dir)], check=False)
    text = out.stdout + out.stderr
    if "terminate called" in text or out.returncode in (134, -6):
        return "abort", f"status {out.returncode}"
    if out.returncode != 0:
        return "failed", f"status {out.returncode}: {text.strip().splitlines()[-1:]}"
    if kind == "validation" and "failslow run: diagnosis" not in text:
        return "failed", "no diagnosis before the job ended"
    return "clean", ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--cases", default="all", help=f"comma-separated of {', '.join(CASES)}")
    ap.add_argument("--hogs", type=int, default=2, help="busy loops beside the job")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    cases = list(CASES) if args.cases == "all" else args.cases.split(",")
    console = Console()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    counts = {
        c: {"runs": 0, "clean": 0, "abort": 0, "failed": 0, "seconds": 0.0, "details": []}
        for c in cases
    }
    started = time.time()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            (work / "train.py").write_text(TRAIN)
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("runs", total=args.runs * len(cases))
                for i in range(args.runs):  # interleaved: the machine's load hits every case
                    for case in cases:
                        begun = time.time()
                        outcome, detail = run_once(case, work)
                        row = counts[case]
                        row["seconds"] += time.time() - begun
                        row["runs"] += 1
                        row[outcome] += 1
                        if detail:
                            row["details"].append(f"run {i}: {outcome} {detail}")
                        progress.advance(task)
                    summary = ", ".join(f"{c} {r['clean']}/{r['runs']}" for c, r in counts.items())
                    console.print(f"round {i + 1}: clean {summary}")
                    if args.json:  # as it goes: a long run can be read before it ends
                        Path(args.json).write_text(json.dumps(counts, indent=1))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    table = Table(title=f"clean exits, {args.hogs} busy loops beside every run")
    for col in ("case", "runs", "clean", "aborts", "other failures", "s per run"):
        table.add_column(col)
    for case, row in counts.items():
        table.add_row(
            case,
            str(row["runs"]),
            str(row["clean"]),
            str(row["abort"]),
            str(row["failed"]),
            f"{row['seconds'] / max(row['runs'], 1):.0f}",
        )
    console.print(table)
    console.print(f"{(time.time() - started) / 60:.1f} min")
    for case, row in counts.items():
        for line in row["details"][:5]:
            console.print(f"  {case}: {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
