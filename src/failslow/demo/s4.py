"""``failslow demo --framework deepspeed --fault compute --strategies S4``: the top of the
ladder on a fail-slow - the slow rank restarted away onto a warm standby (issue 16; greyhound
5.2's S4, byterobust 6.2-6.3).

The 4-rank DeepSpeed ZeRO-1 demo job runs under what users run (:mod:`failslow.demo.rank_launch`:
``failslow run --controller 4 --nproc-per-node 4 --standbys 1 --slots-as-hosts``), with the
planner allowed S4 only and buying it by Algorithm 1's break-even rule once the slowdown has
cost 5 s (``planner.restart_s``; a warm restart measured here is about 1 s,
``benchmarks/failstop_restart.py``, but validation noise on shared CPU cores must not pay for
one). Once the launcher's warm spares are ready, one
rank is SIGSTOP/SIGCONT-cycled from outside (:class:`~failslow.faults.DutyCycleThrottle`, a slow
GPU). Then, with no human step: onset, validation naming the rank, the S4 plan through the plan
channel, every rank committing its snapshot at the plan's step and exiting, the launcher moving
the evicted rank to the standby slot (a new process the throttle does not touch; its slot's
memory gone with it, so it restores from its holder's backup), every rank resuming from
memory, and the job training at the healthy pace again. The job then runs ``after_steps`` more
steps and ends at a common step (its stop file); the same job runs once more without the
slowdown, and the final parameters of both are compared (bitwise: a restart from a bitwise
snapshot runs the same math).

``--strategies S2,S3,S4`` climbs the ladder in the same job (issue 44; the slowdown starts at
``slow_start`` without waiting for the spares - the restart comes after S2's rent, and the
restart table says whether they were ready): the planner may buy
every strategy the adapter and the launcher can apply (DeepSpeed cannot swap its topology: S3 is
declared unavailable with that reason), each by the break-even rule. S2 is bought first (its
cost is a step boundary): the slow replica runs fewer micro-batches, every rank checks it ran
that and the controller measures it against its prediction. A rank 4x slower is not fixed by
S2 (it still runs one micro-batch at 4x, and the others more), so the slowdown keeps paying rent
until the restart is paid for: S4 moves it onto the standby, every rank resuming from memory with
the S2 split it had. The next re-validation finds every rank healthy and the split is reverted -
the walk back. The job ends ``after_steps`` after that revert took effect, and its parameters
match the job without the slowdown within 1e-6 relative (S2 sums the same gradients in another
order; the restart is bitwise).

Results: a phase table (healthy, slowed, mitigated: after the restart), the restart (plan step,
lost steps, downtime, where the moved rank's state came from), ``summary.json``, ``steps.csv``
and ``steps.png`` in the run directory, beside the control plane's ``events.jsonl`` and
``report.html`` (``failslow report``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from failslow.core.control.journal import JOURNAL, read_journal
from failslow.demo import rank_launch
from failslow.demo.mitigation_report import (
    WARMUP_STEPS,
    phase_rows,
    print_phases,
    report,
    write_steps,
)
from failslow.demo.rank_launch import READY, RESUMED
from failslow.demo.run_dir import new_run_dir
from failslow.errors import FailslowError
from failslow.faults import DutyCycleThrottle

S4_ENV = {
    # the demo's settings for CPU ranks on shared cores (failslow.demo.mitigation.DEMO_SETTINGS)
    "FAILSLOW__DETECTION__COOLDOWN_S": "8",
    "FAILSLOW__VALIDATION__GEMM_SERIAL": "true",
    "FAILSLOW__VALIDATION__GEMM_DTYPES": "float32",
    "FAILSLOW__VALIDATION__LINK_MB": "2",
    "FAILSLOW__VALIDATION__RECHECK_EVERY_S": "8",
    "FAILSLOW__VALIDATION__PAUSE_TIMEOUT_S": "20",
    # only S4, bought by Algorithm 1 once the slowdown cost 5 s: more than a warm restart's
    # ~1 s here, because on shared CPU cores the validation's link timings alone scatter 2-3x
    # under load, and their "slowdowns" add up to ~2 s over a couple of minutes - a restart
    # must not be bought on them (it was, once, under a CPU hog with 2 s)
    "FAILSLOW__PLANNER__STRATEGIES": "S4",  # --strategies replaces it
    "FAILSLOW__PLANNER__RULE": "break-even",
    "FAILSLOW__PLANNER__RESTART_S": "5",
}
"""The settings of the job and its controller (environment variables of ``failslow run``)."""
LADDER_ENV = {"FAILSLOW__PLANNER__RESTART_S": "12"}
"""With S2 on the ladder: the diagnosis comes ~20 slow steps after the onset, when the impact
since the onset (Algorithm 1's) is already ~5 s here, which would buy S2 and the restart in one
go; at 12 s S2 is in effect first, and the restart is bought once the slowdown S2 leaves (a
replica still 4x slower on its one micro-batch) has paid the rest."""
THRESHOLD = 2.0
"""A rank is slow at > 2x its peers: healthy CPU ranks on shared cores scatter up to ~1.5x."""
MICRO_BATCHES = 4 * 32
"""Samples per replica and step of the demo job (4 micro-batches of 32)."""


@dataclass
class S4DemoOptions:
    world_size: int = 4
    slow_rank: int = 2
    slow_start: int = 30
    """Slow the rank from this step on, once the warm spares are ready (or ``spare_wait_s``
    later): the restart is then the one a long job gets. With S2 on the ladder the restart
    comes only after S2 has paid its rent (a minute or more here), long after the spares are
    ready, so the slowdown starts at this step: waiting would only add healthy steps to the
    job and to its reference run (~130 steps, ~35 s each, on 2 shared cores). Whether the
    spares were ready at the restart is measured (the restart table's "warm")."""
    stopped_fraction: float = 0.75
    throttle_period_s: float = 0.02
    after_steps: int = 30
    """Steps the job runs after every rank resumed (then it ends at a common step)."""
    max_steps: int = 1500
    """The job ends here at the latest (S4 not bought: the demo fails)."""
    standbys: int = 1
    out_dir: Path | None = None
    live: bool = True
    reference: bool = True
    """Run the job once more without the slowdown and compare the parameters."""
    spare_wait_s: float = 120.0
    timeout_s: float = 1800.0
    strategies: tuple[str, ...] = ("S4",)
    """The planner's ladder (S4 in it); with S2 the job climbs S2 -> S4 and walks back."""

    def validate(self) -> None:
        if self.world_size < 2 or not 0 <= self.slow_rank < self.world_size:
            raise FailslowError(
                f"demo --strategies S4: need --world-size >= 2 and 0 <= --slow-rank < world "
                f"size, got {self.world_size} and {self.slow_rank}"
            )
        if self.standbys < 1:
            raise FailslowError("demo --strategies S4: the restart needs a standby slot")
        if not 0 < self.slow_start < self.max_steps - self.after_steps:
            raise FailslowError(
                f"demo --strategies S4: need 0 < --slow-start < {self.max_steps - self.after_steps}"
                f", got {self.slow_start}"
            )
        if not 0.0 < self.stopped_fraction < 1.0:
            raise FailslowError(
                f"demo: --stopped-fraction must be in (0, 1), got {self.stopped_fraction}"
            )


@dataclass
class _Run:
    options: S4DemoOptions
    step: int = -1
    step_times: dict[int, float] = field(default_factory=dict)
    """Rank 0's step durations (a synchronous job has one step time), every launch."""
    seen: dict[int, float] = field(default_factory=dict)
    """When each step was first seen done."""
    injected: int | None = None
    """The step the slowdown began at."""
    throttled: int | None = None
    """The slowed process."""
    ready_at: float | None = None
    """When the launcher first said its warm spares were ready (wall clock)."""
    evictions: list[dict[str, Any]] = field(default_factory=list)
    """The launcher's record of each evicted rank (``failstops.jsonl``)."""
    resumes: list[dict[str, Any]] = field(default_factory=list)
    """Per restart: the step every rank resumed at, when that was seen and when its first step
    was done."""
    state: str = "-"
    events: list[str] = field(default_factory=list)
    journal: list[dict[str, Any]] = field(default_factory=list)


def run_s4_demo(opts: S4DemoOptions) -> dict[str, Any]:
    """Run the job with the slowdown (and the reference without); returns the summary, also
    written to ``summary.json`` in the run directory."""
    opts.validate()
    out = new_run_dir(opts.out_dir, "s4")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    run = _Run(opts)
    with tempfile.TemporaryDirectory(prefix="failslow-s4-", dir=shm) as t:
        tmp = Path(t)
        with _live(run, opts.live) as refresh:
            _job(opts, tmp, out, run, refresh)
            reference = None
            if opts.reference:
                run.events.append("reference: the same job without the slowdown ...")
                refresh()
                steps = _steps_run(out / "job")
                reference = rank_launch.run_reference(
                    tmp, out, steps, world_size=opts.world_size, timeout_s=opts.timeout_s
                )
                run.events.append("reference done")
                refresh()
        journal = tmp / "s4-rings" / "diagnoses" / JOURNAL
        if journal.is_file():
            shutil.copy(journal, out / JOURNAL)
    summary = _summary(run, out, reference)
    print_phases(summary)
    _print_restarts(summary, out)
    report(out)
    return summary


def _job(opts: S4DemoOptions, tmp: Path, out: Path, run: _Run, refresh: Callable[[], None]) -> None:
    job_out = out / "job"
    stop_file = tmp / "stop"
    settings = {**S4_ENV, "FAILSLOW__PLANNER__STRATEGIES": ",".join(opts.strategies)}
    if "S2" in opts.strategies:
        settings.update(LADDER_ENV)
    env = rank_launch.job_env(
        job_out, opts.max_steps, FAILSLOW_DEMO_STOP_FILE=str(stop_file), **settings
    )
    argv = rank_launch.command(
        tmp, "s4", world_size=opts.world_size, standbys=opts.standbys, restarts=0,
        threshold=THRESHOLD,
    )  # fmt: skip
    log_path = out / "job.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    throttle: DutyCycleThrottle | None = None
    started = time.monotonic()
    waiting_since: float | None = None
    try:
        while proc.poll() is None:
            if time.monotonic() - started > opts.timeout_s:
                raise FailslowError(f"demo: not done after {opts.timeout_s:.0f} s; see {log_path}")
            text = log_path.read_text(errors="replace")
            _follow(run, tmp, job_out, text)
            if run.ready_at is None and READY in text:
                run.ready_at = time.time()
            if throttle is None and run.step >= opts.slow_start:
                waiting_since = waiting_since or time.monotonic()
                warm = run.ready_at is not None
                waited = time.monotonic() - waiting_since
                if warm or "S2" in opts.strategies or waited > opts.spare_wait_s:
                    throttle = _slow_down(run, tmp / "s4-rings")
            if throttle is not None and throttle.active and run.throttled is not None:
                if not Path(f"/proc/{run.throttled}").exists():  # restarted: a new process
                    throttle.stop()
            done_from = _settled(run)
            if done_from is not None and run.step >= done_from + opts.after_steps:
                stop_file.touch()  # every rank ends at one step (ds_worker)
            refresh()
            time.sleep(0.05)
    finally:
        if throttle is not None:
            throttle.stop()
        rank_launch.end(proc)
    _follow(run, tmp, job_out, log_path.read_text(errors="replace"))
    if proc.returncode != 0:
        raise FailslowError(f"demo: the job failed with status {proc.returncode}; see {log_path}")
    run.events.append("the job finished")
    refresh()


def _settled(run: _Run) -> int | None:
    """The step from which the job runs as it will to its end: every rank resumed after the
    restart, and where an S2 split was in effect, its revert in effect after that (the walk
    back); None before."""
    if not run.resumes:
        return None
    start = int(run.resumes[-1]["resumed_at"])
    s2 = [e for e in run.journal if e.get("kind") == "plan" and e.get("committed")
          and (e.get("plan") or {}).get("type") == "MicroBatchPlan"
          and int(e["apply_step"]) <= start]  # fmt: skip
    if not s2 or s2[-1]["action"] in ("revert", "rollback"):
        return start  # no split in force at the restart (never bought, or it did not pay)
    reverted = [
        int(e["apply_step"]) for e in run.journal
        if e.get("kind") == "effect" and e.get("action") in ("revert", "rollback")
        and e.get("state") == "in effect" and int(e.get("apply_step") or -1) >= start
    ]  # fmt: skip
    return max(reverted) if reverted else None


def _slow_down(run: _Run, rings: Path) -> DutyCycleThrottle | None:
    """Start SIGSTOP/SIGCONT-cycling the slow rank's process (None: not running yet)."""
    opts = run.options
    pid = rank_launch.pid_of(rings, opts.slow_rank, set())
    if pid is None:
        return None
    throttle = DutyCycleThrottle(pid, opts.stopped_fraction, opts.throttle_period_s)
    throttle.start()
    run.injected, run.throttled = run.step, pid
    run.events.append(
        f"rank {opts.slow_rank} (pid {pid}) slowed from step {run.step}: stopped "
        f"{opts.stopped_fraction:.0%} of every {opts.throttle_period_s * 1000:.0f} ms"
    )
    return throttle


def _follow(run: _Run, tmp: Path, job_out: Path, text: str) -> None:
    """Take in rank 0's progress, the evictions, the resume lines and the control plane's
    journal."""
    now = time.time()
    stops = rank_launch.failstops(tmp / "s4-state")
    for e in [s for s in stops if s["cause"] == "evicted"][len(run.evictions) :]:
        run.evictions.append(e)
        onto = f"standby slot {e['replaced_by']}" if e["replaced_by"] is not None else "itself"
        run.events.append(f"S4: rank {e['rank']} (slot {e['slot']}) evicted onto {onto}")
    for step in RESUMED.findall(text)[len(run.resumes) :]:
        run.resumes.append({"resumed_at": int(step), "seen": now, "first_step_done": None})
        run.events.append(f"every rank resumed from memory at step {step}")
    progress = rank_launch.progress(job_out)
    pending = [r for r in run.resumes if r["first_step_done"] is None]
    if pending and progress:
        mtime = (job_out / "progress-rank0.json").stat().st_mtime
        for resume in pending:
            if mtime > resume["seen"]:
                resume["first_step_done"] = mtime
    for step, seconds in progress:  # a new launch's file replaces the last one's
        run.step_times[step] = seconds
        run.seen.setdefault(step, now)
        run.step = max(run.step, step)
    journal = tmp / "s4-rings" / "diagnoses" / JOURNAL
    with contextlib.suppress(OSError, ValueError):
        run.journal = read_journal(journal) if journal.is_file() else []
    states = [e["state"] for e in run.journal if e.get("kind") == "state"]
    run.state = states[-1] if states else run.state


def _steps_run(job_out: Path) -> int:
    """How many steps the job trained (its last launch's record): the reference runs as many."""
    records = [json.loads(p.read_text()) for p in job_out.glob("steps-rank0*.json")]
    if not records:
        raise FailslowError(f"demo: the job left no record of its steps in {job_out}")
    return max(r["first_step"] + len(r["step_end"]) - 1 for r in records)


def _restarts(run: _Run, log: str) -> list[dict[str, Any]]:
    """Each committed restart: its plan step, who moved where, where their state came from,
    the steps lost and the downtime (the gap between the last step before and the first step
    after, less a normal step)."""
    plans = [
        p for p in run.journal
        if p.get("kind") == "plan" and p["plan"].get("type") == "RestartPlan" and p["committed"]
    ]  # fmt: skip
    walls = sorted(run.seen.values())
    normal = [b - a for a, b in itertools.pairwise(walls)]
    step_s = float(np.median(normal)) if normal else 0.0
    sources = rank_launch.restore_sources(log)
    launches = sorted({e["launch"] for e in run.evictions})  # the launches a plan stopped
    out = []
    for i, resume in enumerate(run.resumes):
        plan = plans[i] if i < len(plans) else None
        before = resume["resumed_at"] - 1
        step = plan["apply_step"] if plan else None
        evicted = [e for e in run.evictions if i < len(launches) and e["launch"] == launches[i]]
        restored = sources[i] if i < len(sources) else {}
        last_seen, after = run.seen.get(before), resume["first_step_done"]
        out.append(
            {"plan_step": step, "evict": plan["plan"]["evict"] if plan else [],
             "reason": plan["reason"] if plan else None,
             "moved": [{"rank": e["rank"], "slot": e["slot"], "onto": e["replaced_by"],
                        "restored_from": restored.get(str(e["rank"]))} for e in evicted],
             "resumed_at": resume["resumed_at"],
             "lost_steps": step - resume["resumed_at"] if step is not None else None,
             "downtime_s": after - last_seen - step_s if last_seen and after else None,
             "warm_spares": run.ready_at is not None and run.ready_at <= resume["seen"]}
        )  # fmt: skip
    return out


def _summary(run: _Run, out: Path, reference: Path | None) -> dict[str, Any]:
    opts = run.options
    end = max(run.step_times, default=-1) + 1
    times = np.full(end, np.nan)
    for step, seconds in run.step_times.items():
        times[step] = seconds
    restarts = _restarts(run, (out / "job.log").read_text(errors="replace"))
    first = restarts[0] if restarts else None
    start = run.injected if run.injected is not None else end
    plans = [e for e in run.journal if e.get("kind") == "plan"]
    s2 = [int(p["apply_step"]) for p in plans if p.get("committed") and p["action"] == "apply"
          and p["plan"].get("type") == "MicroBatchPlan"]  # fmt: skip
    spans = {"healthy": (WARMUP_STEPS, start)}
    if first is not None and first["plan_step"] is not None:
        if s2 and start <= s2[0] < first["plan_step"]:  # the ladder's first rung
            spans["slowed"] = (start, s2[0])
            spans["S2"] = (s2[0], first["plan_step"])
        else:
            spans["slowed"] = (start, first["plan_step"])
        spans["mitigated"] = (first["resumed_at"], end)
    else:
        spans["slowed"] = (start, end)
    rows = phase_rows(times, {k: v for k, v in spans.items() if v[1] > v[0]},
                      MICRO_BATCHES * opts.world_size)  # fmt: skip
    moved = [m for r in restarts for m in r["moved"] if m["rank"] == opts.slow_rank]
    parameters: dict[str, Any] = {"compared": False}
    if reference is not None and "S2" in opts.strategies:
        parameters = rank_launch.compare_parameters(
            out / "job", reference, "1e-6 relative (S2 sums the same gradients in another order; "
            "a restart from a bitwise snapshot runs the same math)", rtol=1e-6,
        )  # fmt: skip
    elif reference is not None:
        parameters = rank_launch.compare_parameters(
            out / "job", reference, "bitwise (a restart from a bitwise snapshot runs the same math)"
        )
    effects = {(e["action"], e["apply_step"]): e for e in run.journal if e.get("kind") == "effect"}
    outcomes = {e["apply_step"]: e for e in run.journal if e.get("kind") == "outcome"}
    summary = {
        "framework": "deepspeed",
        "fault": "compute",
        "strategies": list(opts.strategies),
        "world_size": opts.world_size,
        "slow_rank": opts.slow_rank,
        "stopped_fraction": opts.stopped_fraction,
        "injected": [run.injected, first["plan_step"] if first else None],
        "steps_run": end,
        "phases": rows,
        "restarts": restarts,
        "slow_rank_moved": bool(moved) and all(m["onto"] is not None for m in moved),
        "diagnoses": [e["diagnosis"] for e in run.journal if e.get("kind") == "diagnosis"],
        "actions": [
            {
                "action": p["action"],
                "strategy": p["strategy"],
                "apply_step": p["apply_step"],
                "evict": list(p["plan"].get("evict", ())),
                "counts": list(p["plan"].get("counts", ())),
                "reason": p["reason"],
                "committed": p["committed"],
                "effect": (effects.get((p["action"], p["apply_step"])) or {}).get("state"),
                "effect_detail": (effects.get((p["action"], p["apply_step"])) or {}).get("detail"),
                "outcome": {k: outcomes[p["apply_step"]].get(k)
                            for k in ("before_s", "predicted_s", "measured_s", "verdict", "reason")}
                if p["apply_step"] in outcomes and p["action"] in ("apply", "replan") else None,
            }
            for p in plans
        ],
        "unavailable": {e["strategy"]: e["reason"] for e in run.journal
                        if e.get("kind") == "unavailable"},
        "parameters": parameters,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_steps(times, summary, out)
    return summary


@contextlib.contextmanager
def _live(run: _Run, enabled: bool) -> Iterator[Callable[[], None]]:
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    opts = run.options

    def render() -> Table:
        title = (
            f"failslow demo --strategies {','.join(opts.strategies)}: {opts.world_size}-rank "
            "DeepSpeed ZeRO-1"
        )
        table = Table(title=title)
        table.add_column("what")
        table.add_column("now")
        recent = [run.step_times[s] for s in sorted(run.step_times)[-10:]]
        table.add_row("step", str(max(run.step, 0)))
        table.add_row("step time (last 10)", f"{np.median(recent):.3f} s" if recent else "-")
        table.add_row("controller", run.state)
        for e in run.journal:
            if e.get("kind") == "diagnosis":
                slow = e["diagnosis"].get("slow_ranks") or {}
                table.add_row("diagnosis", f"slow ranks {slow}")
            elif e.get("kind") == "plan":
                table.add_row(f"{e['action']} {e['strategy']}",
                              f"from step {e['apply_step']}: {e['reason']}")  # fmt: skip
            elif e.get("kind") == "effect":
                table.add_row(f"  {e['action']} {e['strategy']}",
                              f"{e['state']} {e.get('detail') or ''}".strip())  # fmt: skip
            elif e.get("kind") == "unavailable":
                table.add_row(f"{e['strategy']} unavailable", str(e["reason"]))
        table.add_row("events", "\n".join(run.events[-6:]) or "-")
        return table

    with Live(render(), console=Console(stderr=True), refresh_per_second=4) as live:
        yield lambda: live.update(render())


def _print_restarts(summary: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not summary["restarts"]:
        console.print("[red]S4 was not bought: the slow rank was never restarted away[/red]")
    else:
        table = Table(title="S4: restarted without the slow host, every rank from memory")
        for col in ("plan step", "moved", "its state from", "resumed at", "lost steps",
                    "downtime", "warm"):  # fmt: skip
            table.add_column(col)
        for r in summary["restarts"]:
            moved = [f"rank {m['rank']}: slot {m['slot']} -> "
                     + (f"standby slot {m['onto']}" if m["onto"] is not None else "itself")
                     for m in r["moved"]]  # fmt: skip
            table.add_row(
                str(r["plan_step"]), "\n".join(moved) or "-",
                "\n".join(m["restored_from"] or "-" for m in r["moved"]) or "-",
                str(r["resumed_at"]), str(r["lost_steps"]),
                f"{r['downtime_s']:.1f} s" if r["downtime_s"] is not None else "-",
                "yes" if r["warm_spares"] else "no",
            )  # fmt: skip
        console.print(table)
    slow = summary["slow_rank"]
    verdict = "moved to a standby" if summary["slow_rank_moved"] else "[red]NOT moved[/red]"
    console.print(f"the slow rank {slow}: {verdict}")
    p = summary["parameters"]
    if p["compared"]:
        bitwise = p["tolerance"].startswith("bitwise")
        same = "bitwise equal" if bitwise else f"equal within {p['tolerance']}"
        verdict = same if p["equal"] else f"DIFFER (max |diff| {p['max_abs_diff']:.3g})"
        console.print(f"final parameters vs the same job without the slowdown: {verdict}")
    console.print(f"summary: {out / 'summary.json'}, steps.png, steps.csv, {JOURNAL}")
