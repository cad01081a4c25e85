"""Live view and results of the DeepSpeed mitigation demo (:mod:`failslow.demo.mitigation`).

Phases of the run, by step: *healthy* (before the injection), *slowed* (injected, no plan yet:
detection, validation and the planner's break-even), *mitigated* (the S2 plan in effect while the
slowdown lasts), *after* (released). Throughput is the global batch over the job's step time
(the slowest rank's step ends). Written to the run directory: ``summary.json``, ``steps.csv``,
``steps.png`` (with matplotlib) and ``report.html`` (``failslow report``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

WARMUP_STEPS = 10  # first steps include imports settling and allocator warm-up


@contextlib.contextmanager
def live_view(run: Any, *, enabled: bool) -> Iterator[Callable[[], None]]:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    def table() -> Table:
        opts = run.options
        from failslow.demo.mitigation import job_name

        job = job_name(opts.framework, zero=opts.zero, mesh=opts.mesh)
        t = Table(title=f"failslow demo: {job}, {opts.world_size} ranks (CPU/gloo)")
        t.add_column("what")
        t.add_column("now")
        recent = [run.step_times[s] for s in sorted(run.step_times)[-10:]]
        t.add_row("step", f"{max(run.step, 0)} / {opts.steps}")
        t.add_row("step time (last 10)", f"{np.median(recent):.3f} s" if recent else "-")
        start, end = run.injected
        injected = "not yet"
        if start is not None and opts.fault == "link":
            injected = f"link 0-1 shaped to {opts.link_rate} from step {start}"
        elif start is not None and opts.fault == "device":
            injected = (
                f"rank {opts.slow_rank}'s device {opts.device_factor:g}x slower from step {start}"
            )
        elif start is not None:
            share = f"{opts.stopped_fraction:.0%}"
            injected = f"rank {opts.slow_rank} stopped {share} from step {start}"
        if start is not None:
            injected += f", released at step {end}" if end is not None else ""
        t.add_row("fail-slow", injected)
        t.add_row("controller", run.controller_state if opts.mitigate else "off (baseline)")
        t.add_row("diagnoses", str(len(run.diagnoses)))
        for a in run.actions:
            t.add_row(
                f"{a['action']} {a['strategy']}",
                f"{_what(a)} from step {a['apply_step']}{effect_text(a)}: {a['reason']}",
            )
        for strategy, why in run.unavailable.items():
            t.add_row(f"{strategy} unavailable", why)
        return t

    if not enabled:
        yield lambda: None
        return
    with Live(table(), console=Console(stderr=True), refresh_per_second=4) as live:
        yield lambda: live.update(table())


def effect_text(action: dict[str, Any]) -> str:
    """``, in effect; measured 0.095 s vs 0.091 s predicted (pays)`` - what the ranks reported
    after the apply step and what the controller measured (empty before either)."""
    text = ""
    if action.get("effect"):
        text = f", {action['effect']}"
        if action.get("effect_detail"):
            text += f" ({action['effect_detail']})"
    elif action.get("committed"):
        text = ", committed (not checked yet)"
    outcome = action.get("outcome") or {}
    if outcome.get("measured_s") is not None:
        text += f"; measured {outcome['measured_s']:.3f} s"
        if outcome.get("predicted_s") is not None:
            text += f" vs {outcome['predicted_s']:.3f} s predicted"
        text += f" ({outcome.get('verdict')})"
    elif outcome.get("verdict") == "not measured":
        why = outcome.get("reason")
        text += "; outcome not measured" + (f": {why}" if why else "")
    drift = action.get("drift") or {}
    if drift.get("measured_s") is not None:
        text += f"; later stopped paying ({drift['measured_s']:.3f} s): {drift.get('then')}"
    return text


def phases(run: Any, steps: int) -> dict[str, tuple[int, int]]:
    """[first, last) step of each phase that happened."""
    opts = run.options
    start = run.injected[0] if run.injected[0] is not None else opts.slow_start
    end = run.injected[1] if run.injected[1] is not None else steps
    applied = [a["apply_step"] for a in run.actions if a["action"] == "apply" and a["apply_step"]]
    out = {"healthy": (WARMUP_STEPS, start)}
    if applied and start <= applied[0] < end:
        out["slowed"] = (start, applied[0])
        out["mitigated"] = (applied[0], end)
    else:
        out["slowed"] = (start, end)
    if end < steps:
        out["after"] = (end, steps)
    return {k: v for k, v in out.items() if v[1] > v[0]}


def summarize(run: Any, out: Path) -> dict[str, Any]:
    from failslow.demo.mitigation import step_times_of

    opts = run.options
    times = step_times_of(out, opts.world_size)
    samples = opts.micro_batch_size * opts.micro_batches_per_replica * opts.world_size
    rows = phase_rows(times, phases(run, len(times)), samples)
    from failslow.demo.mitigation import job_name

    summary = {
        "framework": opts.framework,
        "job": job_name(opts.framework, zero=opts.zero, mesh=opts.mesh),
        "mitigate": opts.mitigate,
        "world_size": opts.world_size,
        "fault": opts.fault,
        "slow_rank": opts.slow_rank,
        "stopped_fraction": opts.stopped_fraction,
        "injected": list(run.injected),
        "throttle": run.throttle,
        "fault_changed": list(run.fault_changed) if run.fault_changed else None,
        "steps_run": len(times),
        "phases": rows,
        "actions": run.actions,
        "unavailable": getattr(run, "unavailable", {}),
        "diagnoses": [json.loads(d) for d in run.diagnoses],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_steps(times, summary, out)
    print_phases(summary)
    report(out)
    return summary


def phase_rows(
    times: np.ndarray, spans: dict[str, tuple[int, int]], samples_per_step: int
) -> dict[str, dict[str, Any]]:
    """Per phase ``[first, last)`` of ``spans``: the median step time, throughput, and the
    ratio to the healthy phase's median (``times[i]``: step ``i``'s wall time; NaN = unseen)."""
    rows: dict[str, dict[str, Any]] = {}
    for name, (a, b) in spans.items():
        median = float(np.nanmedian(times[a:b]))
        rows[name] = {"steps": [a, b], "median_step_s": median,
                      "samples_per_s": samples_per_step / median}  # fmt: skip
    healthy = rows.get("healthy", {}).get("median_step_s")
    for row in rows.values():
        row["vs_healthy"] = row["median_step_s"] / healthy if healthy else None
    return rows


def write_steps(times: np.ndarray, summary: dict[str, Any], out: Path) -> None:
    """``steps.csv`` and (with matplotlib) ``steps.png``: step times, phases and actions."""
    lines = ["step,step_time_s"] + [f"{i},{t:.6f}" for i, t in enumerate(times)]
    (out / "steps.csv").write_text("\n".join(lines) + "\n")
    _plot(times, summary, out / "steps.png")


def report(out: Path) -> None:
    """``failslow report`` of the run, beside its summary (a failure is one line, not the
    demo's end: the run's files are all there to report on later)."""
    from rich.console import Console

    from failslow.errors import FailslowError
    from failslow.observe.report import write_report

    try:
        path = write_report(out, None)
    except FailslowError as exc:
        Console().print(f"report: not written ({exc})")
        return
    Console().print(f"report: {path} (open it in a browser)")


def print_phases(summary: dict[str, Any]) -> None:
    """The phase table and one line per action."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="throughput by phase (median step)")
    for col in ("phase", "steps", "step time", "samples/s", "x healthy"):
        t.add_column(col)
    for name, row in summary["phases"].items():
        ratio = row["vs_healthy"]
        t.add_row(
            name,
            f"{row['steps'][0]}-{row['steps'][1]}",
            f"{row['median_step_s']:.3f} s",
            f"{row['samples_per_s']:.0f}",
            f"{ratio:.2f}" if ratio else "-",
        )
    console = Console()
    console.print(t)
    for a in summary["actions"]:
        console.print(
            f"{a['action']} {a['strategy']}: {_what(a)} from step {a['apply_step']}"
            f"{effect_text(a)} ({a['reason']})"
        )
    for strategy, why in (summary.get("unavailable") or {}).items():
        console.print(f"{strategy} unavailable in this job: {why}")


def _plot(times: np.ndarray, summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(np.arange(len(times)), times, lw=1, color="black", label="step time")
    colors = {"slowed": "tab:red", "S2": "tab:orange", "mitigated": "tab:green"}
    for name, row in summary["phases"].items():
        if name in colors:
            ax.axvspan(*row["steps"], color=colors[name], alpha=0.15, label=name)
    for a in summary["actions"]:
        if a["apply_step"]:
            ax.axvline(a["apply_step"], ls="--", color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _what(action: dict[str, Any]) -> str:
    """What an action changes: S2's counts, S3's host of every role, or S4's evicted hosts."""
    if action.get("evict"):
        return f"restart without host(s) {', '.join(action['evict'])}"
    if action.get("hosts"):
        return f"roles to hosts {action['hosts']}"
    return f"counts {action['counts']}"
