"""Run a scenario under several policies; print a table and draw throughput over time."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from failslow.errors import ConfigError
from failslow.sim.engine import Simulation, Trace
from failslow.sim.policies import POLICIES
from failslow.sim.scenario import FailSlow, FailStop, Scenario


@dataclass(frozen=True)
class Result:
    policy: str
    steps: int
    steps_per_min: float
    vs_none: float
    """Steps over the ``none`` policy's (no mitigation)."""
    vs_oracle: float | None
    """Steps over the hindsight ``oracle``'s (None when the oracle did not run)."""
    lost_steps: int
    paused_s: float
    actions: int
    wall_s: float


def run_policies(
    scenario: Scenario, policies: Sequence[str], console: Console | None = None
) -> tuple[list[Result], dict[str, Trace]]:
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ConfigError(f"unknown policy {unknown[0]!r}; known policies: {', '.join(POLICIES)}")
    traces: dict[str, Trace] = {}
    walls: dict[str, float] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"simulating {scenario.name}", total=len(policies))
        for name in policies:
            progress.update(task, description=f"{scenario.name}: {name}")
            started = time.perf_counter()
            traces[name] = Simulation(scenario, POLICIES[name]()).run()
            walls[name] = time.perf_counter() - started
            progress.advance(task)
    minutes = scenario.duration_s / 60.0
    base = traces.get("none")
    oracle = traces.get("oracle")
    best = _steps_at(oracle, scenario.duration_s) if oracle else None
    results = []
    for name, trace in traces.items():
        steps = _steps_at(trace, scenario.duration_s)
        ref = _steps_at(base, scenario.duration_s) if base else steps
        results.append(
            Result(
                name,
                steps,
                steps / minutes,
                steps / ref if ref else float("nan"),
                steps / best if best else None,
                trace.lost_steps,
                trace.paused_s,
                len(trace.actions),
                walls[name],
            )
        )
    return results, traces


def _steps_at(trace: Trace, at: float) -> int:
    index = int(np.searchsorted(trace.times, at, side="right")) - 1
    return trace.steps[max(index, 0)]


def table(scenario: Scenario, results: Sequence[Result]) -> Table:
    t = Table(title=f"{scenario.name}: {scenario.description}")
    for col in (
        "policy",
        "steps",
        "steps/min",
        "vs none",
        "vs oracle",
        "lost steps",
        "paused (s)",
        "actions",
        "sim wall (s)",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        t.add_row(
            r.policy,
            str(r.steps),
            f"{r.steps_per_min:.2f}",
            f"{r.vs_none:.3f}x",
            "" if r.vs_oracle is None else f"{r.vs_oracle:.3f}",
            str(r.lost_steps),
            f"{r.paused_s:.0f}",
            str(r.actions),
            f"{r.wall_s:.2f}",
        )
    return t


def throughput(trace: Trace, duration_s: float, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Steps per minute in bins of ``bin_s`` (progress lost to a rollback counts as 0)."""
    edges = np.arange(0.0, duration_s + bin_s, bin_s)
    times = np.asarray(trace.times)
    steps = np.maximum.accumulate(np.asarray(trace.steps))
    at = np.interp(edges, times, steps)
    return edges[:-1], np.diff(at) * 60.0 / bin_s


def plot(scenario: Scenario, traces: dict[str, Trace], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bin_s = max(30.0, scenario.duration_s / 150)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for event in scenario.events:
        if isinstance(event, FailSlow):
            color = "tab:red" if event.link else "tab:orange"
            ax.axvspan(event.start_s / 60, event.end_s / 60, color=color, alpha=0.08)
        elif isinstance(event, FailStop):
            ax.axvline(event.time_s / 60, color="k", alpha=0.3, linewidth=0.8)
    markers = {"failslow": "^", "greyhound": "v"}
    for name, trace in traces.items():
        x, y = throughput(trace, scenario.duration_s, bin_s)
        (line,) = ax.plot(x / 60, y, label=name, linewidth=1.2)
        if name in markers and len(trace.actions) <= 200:
            ts = [t / 60 for t, _ in trace.actions]
            ys = np.interp(ts, x / 60, y) if len(x) else []
            ax.scatter(ts, ys, marker=markers[name], s=18, color=line.get_color(), zorder=3)
    ax.set_xlabel("time (min)  [shaded: orange GPU / red link fail-slow; lines: fail-stops]")
    ax.set_ylabel("steps / min")
    ax.set_title(f"{scenario.name}: throughput (markers: mitigation actions)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def simulate(
    scenario: Scenario, policies: Sequence[str] | None, out_dir: Path, console: Console
) -> list[Result]:
    chosen = list(policies or scenario.policies)
    results, traces = run_policies(scenario, chosen, console)
    console.print(table(scenario, results))
    by = {r.policy: r for r in results}
    if "failslow" in by and by["failslow"].vs_oracle is not None:
        console.print(f"failslow / oracle = {by['failslow'].vs_oracle:.3f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(
        json.dumps([r.__dict__ for r in results], indent=2) + "\n"
    )
    actions = {name: trace.actions for name, trace in traces.items()}
    (out_dir / "actions.json").write_text(json.dumps(actions, indent=1) + "\n")
    try:
        plot(scenario, traces, out_dir / "throughput.png")
        console.print(f"plot: {out_dir / 'throughput.png'}")
    except ImportError:
        console.print("matplotlib is not installed: no plot (pip install failslow[plot])")
    return results
