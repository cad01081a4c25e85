"""The S2 plan's predicted step time against the step time measured while it is in effect.

Usage::

    python benchmarks/s2_prediction.py [--runs deepspeed,megatron,accelerate,fsdp,deepspeed:2]
        [--repeat N] [--from-dirs DIR ...]

Runs ``failslow demo --framework F --no-live`` for each run (the S2 demos: a compute fail-slow
on rank 2 from step 60 to 180; detection, validation and the planner's S2 plan by themselves;
``F:N`` runs it with ``--world-size N``, the slowed rank the last), or reads existing demo run
directories (``--from-dirs``), and prints for every applied micro-batch plan, from the run's
``events.jsonl`` (the control plane's journal):

- *healthy*: the median step before the injection (steps 10..slow start);
- *before*: the median of the five steps before the plan took effect (the observed slowdown
  the planner judges the plan against);
- *measured*: the median step while the plan is in effect (from two steps after it applied
  to its revert or the end of the injection);
- *predicted*: the plan's ``step_time_s``, and which model gave it: *rank profiles* (the ranks'
  measured time per micro-batch, rest and optimizer part, :mod:`failslow.core.planner.
  measured_step`), else *GEMM model* on the observed scale (``before * step_time_s /
  baseline_step_s``, the healthy time per micro-batch and the validation GEMM's slowdown);
- its error against *measured*. Goal (issue 17, again issue 44): within 10% for every S2 demo;
- what the closed loop said of it (issue 44): *effect* (every rank reported running it, or not)
  and the controller's own *verdict* a few steps after it applied (its measured saving against
  the predicted one: pays, or short - then re-planned or reverted).

``--repeat N`` runs every demo N times (a row per run and plan).

The default runs have 4 ranks on this machine's 2 cores, and ``deepspeed:2`` one rank per core:
on an oversubscribed CPU, moving micro-batches between replicas also moves CPU share between
them, which the per-rank model (made for dedicated devices) does not see.

One run takes 2-5 minutes on 2 cores; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RUNS = ("deepspeed", "megatron", "accelerate", "fsdp", "deepspeed:2")
SLOW_START, SLOW_END = 60, 180  # failslow demo's defaults for the S2 demos


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        raise SystemExit(f"s2_prediction: {path} is missing (not a failslow demo run directory)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _median(steps: dict[int, float], lo: int, hi: int) -> float | None:
    values = [t for s, t in steps.items() if lo <= s < hi]
    return statistics.median(values) if values else None


def rows_of(run_dir: Path) -> list[dict[str, Any]]:
    """One row per applied micro-batch plan of the run."""
    events = _events(run_dir)
    steps: dict[int, float] = {}
    for e in events:
        if e.get("kind") == "steps":
            for s, t in e.get("steps") or []:
                steps[int(s)] = float(t)
    plans = [e for e in events if e.get("kind") == "plan" and e.get("committed")]
    effects = {e.get("apply_step"): e for e in events if e.get("kind") == "effect"}
    outcomes = {e.get("apply_step"): e for e in events if e.get("kind") == "outcome"}
    healthy = _median(steps, 10, SLOW_START)
    rows = []
    for i, e in enumerate(plans):
        plan = e.get("plan") or {}
        if e.get("action") not in ("apply", "replan") or plan.get("type") != "MicroBatchPlan":
            continue
        start = int(e["apply_step"])
        end = next((int(p["apply_step"]) for p in plans[i + 1 :]), SLOW_END)
        before = _median(steps, start - 5, start)
        measured = _median(steps, start + 2, min(end, SLOW_END))
        step_s, baseline = plan.get("step_time_s"), plan.get("baseline_step_s")
        if baseline:  # the builder's relative model, on the observed scale
            predicted = before * step_s / baseline if before and step_s else None
        else:
            predicted = step_s
        rows.append(
            {
                "run": run_dir.name,
                "ranks": _world_size(run_dir),
                "counts": plan.get("counts"),
                "healthy": healthy,
                "before": before,
                "measured": measured,
                "predicted": predicted,
                "model": "GEMM model"
                if baseline
                else "probe: linear guess"
                if (e.get("step_model") or {}).get("calibrated") is False
                else "rank profiles",
                "action": e.get("action"),
                "effect": (effects.get(start) or {}).get("state", "-"),
                "verdict": (outcomes.get(start) or {}).get("verdict", "-"),
            }
        )
    return rows


def _world_size(run_dir: Path) -> int | None:
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return None
    return json.loads(summary.read_text()).get("world_size")


def _run_demo(run: str, out: Path, console: Console, repeat: int = 0) -> Path:
    framework, _, ranks = run.partition(":")
    cmd = [sys.executable, "-m", "failslow.cli", "demo", "--framework", framework, "--no-live"]
    if ranks:
        cmd += ["--world-size", ranks, "--slow-rank", str(int(ranks) - 1)]
    run_dir = out / f"demo-{framework}-{ranks or 'default'}-{repeat + 1}"
    console.print(f"running {' '.join(cmd[2:])} -> {run_dir}")
    subprocess.run([*cmd, "--out", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
    return run_dir


def _fmt(x: float | None, spec: str = "{:.3f} s") -> str:
    return "-" if x is None else spec.format(x)


def _err(predicted: float | None, measured: float | None) -> str:
    if predicted is None or not measured:
        return "-"
    return f"{(predicted - measured) / measured:+.0%}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help="FRAMEWORK[:RANKS],...")
    parser.add_argument("--from-dirs", nargs="+", type=Path, metavar="DIR")
    parser.add_argument("--out", type=Path, help="where demo runs go (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every demo")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 170))
    if args.from_dirs:
        dirs = list(args.from_dirs)
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="s2-prediction-"))
        dirs = [
            _run_demo(run, out, console, i)
            for i in range(args.repeat)
            for run in args.runs.split(",")
        ]
    table = Table(title="S2 plan: predicted vs measured step time (issue 17 goal: within 10%)")
    for col in ("run", "ranks", "action", "counts", "healthy", "before", "measured", "predicted",
                "error"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("run", "counts", "action") else "right")
    table.add_column("model")
    table.add_column("effect")
    table.add_column("verdict")
    for run_dir in dirs:
        rows = rows_of(run_dir)
        if not rows:
            console.print(f"{run_dir.name}: no micro-batch plan was applied (see its events.jsonl)")
        for r in rows:
            table.add_row(
                r["run"],
                str(r["ranks"] or "-"),
                str(r["action"]),
                str(r["counts"]),
                _fmt(r["healthy"]),
                _fmt(r["before"]),
                _fmt(r["measured"]),
                _fmt(r["predicted"]),
                _err(r["predicted"], r["measured"]),
                r["model"],
                str(r["effect"]),
                str(r["verdict"]),
            )
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
