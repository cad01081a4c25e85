"""The S2 plan's predicted step time against the step time measured while it is in effect.

Usage::

    python benchmarks/s2_prediction.py [--frameworks deepspeed,megatron,accelerate,fsdp]
        [--from-dirs DIR ...]

Runs ``failslow demo --framework F --no-live`` for each framework (the S2 demos: a compute
fail-slow on rank 2 from step 60 to 180; detection, validation and the planner's S2 plan by
themselves), or reads existing demo run directories (``--from-dirs``), and prints for every
applied micro-batch plan, from the run's ``events.jsonl`` (the control plane's journal):

- *healthy*: the median step before the injection (steps 10..slow start);
- *before*: the median of the five steps before the plan took effect (the observed slowdown
  the planner judges the plan against);
- *measured*: the median step while the plan is in effect (from two steps after it applied
  to its revert or the end of the injection);
- *predicted (observed scale)*: what the planner expects on the scale of observed step times,
  ``before * step_time_s / baseline_step_s`` (its relative rule), and *predicted (absolute)*:
  the plan's ``step_time_s`` itself (``max_i m_i * t_i`` from the healthy per-micro-batch time
  and the validation GEMM's slowdown);
- their errors against *measured*. Goal (issue 17): within 10% for every S2 demo.

One run per framework takes 2-5 minutes on 2 cores; run it on a quiet machine.
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

FRAMEWORKS = ("deepspeed", "megatron", "accelerate", "fsdp")
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
    healthy = _median(steps, 10, SLOW_START)
    rows = []
    for i, e in enumerate(plans):
        plan = e.get("plan") or {}
        if e.get("action") != "apply" or plan.get("type") != "MicroBatchPlan":
            continue
        start = int(e["apply_step"])
        end = next((int(p["apply_step"]) for p in plans[i + 1 :]), SLOW_END)
        before = _median(steps, start - 5, start)
        measured = _median(steps, start + 2, min(end, SLOW_END))
        step_s, baseline = plan.get("step_time_s"), plan.get("baseline_step_s")
        relative = before * step_s / baseline if before and step_s and baseline else None
        rows.append(
            {
                "run": run_dir.name,
                "counts": plan.get("counts"),
                "healthy": healthy,
                "before": before,
                "measured": measured,
                "relative": relative,
                "absolute": step_s,
            }
        )
    return rows


def _run_demo(framework: str, out: Path, console: Console) -> Path:
    run_dir = out / f"demo-{framework}"
    console.print(f"running failslow demo --framework {framework} -> {run_dir}")
    cmd = [sys.executable, "-m", "failslow.cli", "demo", "--framework", framework, "--no-live"]
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
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--from-dirs", nargs="+", type=Path, metavar="DIR")
    parser.add_argument("--out", type=Path, help="where demo runs go (default: a temp dir)")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 150))
    if args.from_dirs:
        dirs = list(args.from_dirs)
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="s2-prediction-"))
        dirs = [_run_demo(f, out, console) for f in args.frameworks.split(",")]
    table = Table(title="S2 plan: predicted vs measured step time (issue 17 goal: within 10%)")
    for col in (
        "run",
        "counts",
        "healthy",
        "before",
        "measured",
        "predicted (observed scale)",
        "error",
        "predicted (absolute)",
        "error",
    ):
        table.add_column(col, justify="left" if col in ("run", "counts") else "right")
    for run_dir in dirs:
        for r in rows_of(run_dir):
            table.add_row(
                r["run"],
                str(r["counts"]),
                _fmt(r["healthy"]),
                _fmt(r["before"]),
                _fmt(r["measured"]),
                _fmt(r["relative"]),
                _err(r["relative"], r["measured"]),
                _fmt(r["absolute"]),
                _err(r["absolute"], r["measured"]),
            )
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
