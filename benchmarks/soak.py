"""The demo's faults, round after round, beside a CPU hog (issue 49): does each one finish with
the right diagnosis and the promised parameters every time?

Usage::

    python benchmarks/soak.py [--faults kill,hang,nan,sdc,matmul,slow,compute] [--rounds 20]
        [--hog 2] [--framework deepspeed] [--keep DIR] [--json FILE]

Each round runs ``failslow demo --framework F --fault X --no-live`` once per fault, one after
the other, with ``--hog`` busy loops (``python -c "while True: pass"``) beside it for the whole
soak (the loaded machine the issue asks about: these machines have 2 cores, so 2 loops double
the demand). What each fault's demo promises, and what is read from its ``summary.json``:

- ``kill``: two ranks SIGKILLed; the job restarts from memory on warm standbys; parameters
  bitwise those of the same job without kills;
- ``hang``: the slow rank's machine hangs; stack aggregation names it; parameters bitwise;
- ``nan``: a NaN loss on the slow rank (once); every rank rolls back to the newest snapshot
  before it; parameters bitwise;
- ``sdc``: a gradient 10,000x too large on the slow rank's machine, every launch; dual-phase
  replay names it; parameters bitwise;
- ``matmul``: the slow rank's ``nn.Linear`` outputs 8x; the stop-time checks name it;
  parameters bitwise;
- ``slow``: a slow data loader on the slow rank; rounds of stack samples name it; bitwise;
- ``compute``: the slow rank SIGSTOP-cycled 75%; the controller's diagnosis names it and S2
  is applied and in effect (no parameter comparison in this demo: ``benchmarks/
  straggler_mitigation.py`` has it).

Printed per fault: rounds finished (the demo exited 0 - it exits 1 where its own parameter
check failed), the diagnosis right (the machine named is the slow rank's; for ``kill``: every
kill seen and resumed), the plans the controller bought (none may be: each of these demos
compares its model bitwise, and a micro-batch plan changes the gradient sums' order),
parameters equal (the demo's comparison: bitwise unless it states its tolerance), lost steps
and downtime (median and max over the rounds), and the wall time per round; then every failed
round's directory and reason. ``--keep DIR`` keeps the run directories (default: deleted after
each round unless it failed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

FAULTS = ("kill", "hang", "nan", "sdc", "matmul", "slow", "compute")
SLOW_RANK = 2
"""The demo's default ``--slow-rank``: the machine each fault's diagnosis must name."""


@contextmanager
def hog(n: int) -> Iterator[None]:
    """``n`` busy loops beside the soak (ended by PID)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _named(summary: dict[str, Any]) -> list[int] | None:
    """The ranks (machines) a fail-stop demo's diagnosis named (None: nobody)."""
    suspects = summary.get("suspects")
    if isinstance(suspects, dict):
        suspects = suspects.get("ranks")
    return sorted(int(r) for r in suspects) if suspects else None


def judge(fault: str, rc: int, summary: dict[str, Any] | None) -> dict[str, Any]:
    """One round of ``fault``: finished, diagnosis right, parameters equal, lost steps and
    downtime, and why it failed (empty when it did not)."""
    row: dict[str, Any] = {"finished": rc == 0 and summary is not None, "why": []}
    if summary is None:
        row.update(diagnosis=False, equal=None, lost=None, downtime=None)
        row["why"].append(f"exit {rc}, no summary.json")
        return row
    if rc != 0:
        row["why"].append(f"exit {rc}")
    if fault == "compute":
        named = sorted({int(r) for d in summary.get("diagnoses", [])
                        for r, *_ in d.get("slow_ranks", [])})  # fmt: skip
        applied = [a for a in summary.get("actions", [])
                   if a.get("action") == "apply" and a.get("effect") == "in effect"]  # fmt: skip
        row["diagnosis"] = named == [SLOW_RANK] and bool(applied)
        if not row["diagnosis"]:
            row["why"].append(f"diagnosed {named}, {len(applied)} plan(s) in effect")
        row.update(equal=None, lost=None, downtime=None)
        return row
    if fault == "kill":
        restarts = summary.get("restarts", [])
        row["diagnosis"] = len(restarts) == 2 and all(
            r.get("resumed_at") is not None for r in restarts
        )
        if not row["diagnosis"]:
            row["why"].append(f"{len(restarts)} restart(s): {restarts}")
    else:
        suspects = _named(summary)
        row["diagnosis"] = suspects == [SLOW_RANK] if fault != "nan" else bool(summary.get("rungs"))
        if not row["diagnosis"]:
            row["why"].append(f"named {suspects}")
    row["plans"] = len(summary.get("plans") or [])  # none allowed (failstop.chaos_env)
    if row["plans"]:
        row["why"].append(f"the controller bought {row['plans']} plan(s): {summary['plans']}")
    parameters = summary.get("parameters") or {}
    row["equal"] = bool(parameters.get("equal")) if parameters.get("compared") else None
    if row["equal"] is False:
        row["why"].append(
            f"parameters differ by {parameters.get('max_abs_diff')} ({parameters.get('tolerance')})"
        )
    row["lost"] = summary.get("lost_steps")
    row["downtime"] = summary.get("downtime_s")
    return row


def one_run(fault: str, framework: str, out: Path, timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "failslow.cli", "demo", "--framework", framework,
               "--fault", fault, "--no-live", "--out", str(out)]  # fmt: skip
    start = time.monotonic()
    log = out.parent / f"{out.name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # the demo and every process it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    found = sorted(out.rglob("summary.json"))
    summary = json.loads(found[-1].read_text()) if found else None
    row = judge(fault, rc, summary)
    row["wall_s"] = time.monotonic() - start
    row["dir"] = str(found[-1].parent if found else out)
    row["log"] = str(log)
    return row


def _median_max(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} / {max(values):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hog", type=int, default=2, help="busy loops beside the soak")
    parser.add_argument("--framework", default="deepspeed")
    parser.add_argument("--keep", type=Path, help="keep every run directory here")
    parser.add_argument("--json", type=Path, help="write every round's row here")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per demo run")
    args = parser.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"--faults: unknown {unknown}; choose from {', '.join(FAULTS)}")
    console = Console(width=200)
    rows: dict[str, list[dict[str, Any]]] = {f: [] for f in faults}
    base = args.keep or Path(tempfile.mkdtemp(prefix="failslow-soak-"))
    base.mkdir(parents=True, exist_ok=True)
    with hog(args.hog), Progress(console=console) as progress:
        task = progress.add_task("soak", total=args.rounds * len(faults))
        for i in range(args.rounds):
            for fault in faults:
                progress.update(task, description=f"round {i + 1}/{args.rounds}: {fault}")
                out = base / f"{fault}-{i + 1}"
                row = one_run(fault, args.framework, out, args.timeout)
                row["round"] = i + 1
                rows[fault].append(row)
                if not row["why"] and args.keep is None:
                    shutil.rmtree(out, ignore_errors=True)
                    Path(row["log"]).unlink(missing_ok=True)
                progress.advance(task)
                if args.json:
                    args.json.write_text(json.dumps(rows, indent=1) + "\n")
    table = Table(
        title=f"failslow demo --framework {args.framework}, {args.rounds} rounds per fault, "
        f"{args.hog} busy loops beside"
    )
    columns = (
        "fault", "finished", "diagnosis right", "parameters equal",
        "plans bought", "lost steps (median / max)", "downtime s (median / max)",
        "wall s per round",
    )  # fmt: skip
    for col in columns:
        table.add_column(col)
    for fault, got in rows.items():
        n = len(got)
        compared = [r for r in got if r["equal"] is not None]
        table.add_row(
            fault,
            f"{sum(r['finished'] for r in got)}/{n}",
            f"{sum(bool(r['diagnosis']) for r in got)}/{n}",
            f"{sum(r['equal'] for r in compared)}/{len(compared)}" if compared else "-",
            str(sum(r.get("plans") or 0 for r in got)) if fault != "compute" else "-",
            _median_max([float(r["lost"]) for r in got if r["lost"] is not None]),
            _median_max([float(r["downtime"]) for r in got if r["downtime"] is not None]),
            _median_max([r["wall_s"] for r in got]),
        )
    console.print(table)
    for fault, got in rows.items():
        for r in got:
            if r["why"]:
                console.print(f"{fault} round {r['round']}: {'; '.join(r['why'])} - {r['dir']}")
    if args.keep is None and not any(r["why"] for got in rows.values() for r in got):
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
