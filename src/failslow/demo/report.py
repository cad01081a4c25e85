"""Live view and results of ``failslow demo``: rich display, summary table, CSV, JSON, plot."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from failslow.core.ring import RingReader, find_rings
from failslow.core.tracking import iteration_times
from failslow.traceio import export_rings

if TYPE_CHECKING:
    from failslow.core.tracking.analyzer import LocalAnalyzer
    from failslow.demo.launcher import DemoState

console = Console()


def _view(state: DemoState) -> Group:
    opts = state.options
    head = Text.assemble(
        ("failslow demo ", "bold"),
        f"- {opts.world_size} ranks, DDP tiny transformer over gloo; ",
        f"injection on rank {opts.slow_rank}: ",
        (state.injected, "red" if "stopped" in state.injected else "green"),
    )
    bar = ProgressBar(total=opts.iterations, completed=min(state.iteration, opts.iterations))
    progress = Text(f"iterations derived from the rings: {state.iteration}/{opts.iterations} "
                    "(a few start-up calls precede the first)")
    table = Table("rank", "last iteration (s)", "median of last 20 (s)", "healthy baseline (s)",
                  "state", box=None)
    for rank in sorted(state.last_times):
        slow = state.slow.get(rank, False)
        base = state.baseline.get(rank)
        recent = state.recent.get(rank)
        table.add_row(
            str(rank), f"{state.last_times[rank]:.3f}", f"{recent:.3f}" if recent else "-",
            f"{base:.3f}" if base else "-",
            Text("SLOW", style="bold red") if slow else Text("healthy", style="green"),
        )
    lines = [head, bar, progress, table]
    for e in state.detected:
        style = "red" if e.type == "onset" else "green"
        lines.append(Text(
            f"detected {e.type} at iteration {e.iteration} ({e.change:+.1%}), "
            f"reported at {e.reported_at}, ranks {sorted(e.ranks)}", style=style))
    return Group(*lines)


@contextlib.contextmanager
def render_live(state: DemoState, *, enabled: bool) -> Iterator[Callable[[], None]]:
    if not enabled:
        last = [-1]

        def log() -> None:
            if state.iteration // 20 != last[0] // 20:
                last[0] = state.iteration
                times = ", ".join(f"r{r}={t:.3f}s" for r, t in sorted(state.last_times.items()))
                print(f"iteration {state.iteration}: {times} [{state.injected}]", flush=True)

        yield log
        return
    with Live(_view(state), console=console, refresh_per_second=4, transient=False) as live:
        yield lambda: live.update(_view(state))


def _ground_truth(out: Path) -> dict[int, np.ndarray]:
    truth = {}
    for path in sorted(out.glob("steps-rank*.json")):
        obj = json.loads(path.read_text())
        truth[int(obj["rank"])] = np.asarray(obj["step_end_ns"], dtype=np.int64)
    return truth


def iteration_time_error(
    ring_dir: Path, truth: dict[int, np.ndarray], window: int = 10
) -> dict[int, dict[str, float]]:
    """Relative error of ring-derived iteration times vs each rank's own step timer.

    Each derived iteration (ending at ``end_ns``) is matched with the step whose end is nearest;
    matches further than half a step apart are left out. Per rank: the median error of single
    iterations, and of ``window``-iteration means (what training logs usually print).
    """
    errors: dict[int, dict[str, float]] = {}
    for ring in find_rings(ring_dir):
        reader = RingReader(ring)
        try:
            rank, records = reader.global_rank, reader.poll()
        finally:
            reader.close()
        if rank not in truth or len(truth[rank]) < 3:
            continue
        derived = iteration_times(records[np.argsort(records["t_start_ns"], kind="stable")])
        ends, secs = np.asarray(derived.end_ns), np.asarray(derived.seconds)
        if not len(ends):
            continue
        t_end = truth[rank]
        t_dur = np.diff(t_end).astype(np.float64) / 1e9
        t_end = t_end[1:]
        idx = np.clip(np.searchsorted(t_end, ends), 1, len(t_end) - 1)
        nearer = np.where(np.abs(t_end[idx - 1] - ends) < np.abs(t_end[idx] - ends), idx - 1, idx)
        close = np.abs(t_end[nearer] - ends) < 0.5 * t_dur[nearer] * 1e9
        if not close.any():
            continue
        got, want = secs[close], t_dur[nearer[close]]
        means = [abs(got[i : i + window].sum() / want[i : i + window].sum() - 1)
                 for i in range(0, len(got) - window + 1, window)]
        errors[rank] = {
            "per_iteration": float(np.median(np.abs(got - want) / want)),
            f"per_{window}_iterations": float(np.median(means)) if means else float("nan"),
        }
    return errors


def _plot(state: DemoState, analyzer: LocalAnalyzer, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 4))
    for rank, rs in sorted(analyzer.ranks.items()):
        ax.plot(rs.iteration_times, lw=0.9, label=f"rank {rank}")
    if state.inject_start_iter is not None:
        end = state.inject_end_iter or state.iteration
        ax.axvspan(state.inject_start_iter, end, color="red", alpha=0.12, label="injected slowdown")
    for e in state.detected:
        ax.axvline(e.iteration, color="red" if e.type == "onset" else "green", ls="--", lw=1)
    ax.set_xlabel("iteration (derived from collective calls)")
    ax.set_ylabel("iteration time (s)")
    ax.set_title("failslow demo: ACF iteration times, BOCD+V onset/relief (dashed)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(state: DemoState, analyzer: LocalAnalyzer, ring_dir: Path, out: Path) -> int:
    opts = state.options
    with open(out / "events.jsonl", "w") as fh:
        n_events, lost = export_rings(ring_dir, fh)
    truth = _ground_truth(out)
    errors = iteration_time_error(ring_dir, truth)
    r0 = analyzer.ranks[min(analyzer.ranks)] if analyzer.ranks else None
    with open(out / "iteration_times.csv", "w") as fh:
        fh.write("iteration,iteration_time_s,injected\n")
        for i, t in enumerate(r0.iteration_times if r0 else []):
            inj = (state.inject_start_iter is not None and state.inject_start_iter <= i
                   and (state.inject_end_iter is None or i < state.inject_end_iter))
            fh.write(f"{i},{t:.6f},{int(inj)}\n")
    onsets = [e for e in state.detected if e.type == "onset"]
    reliefs = [e for e in state.detected if e.type == "relief"]
    start, end = state.inject_start_iter, state.inject_end_iter
    # Judged by when an event was reported: an onset reported while the injected slowdown lasts
    # is its detection; the first relief reported after it ends is its relief.
    onset = next((e for e in onsets if start is not None and e.reported_at >= start
                  and (end is None or e.reported_at <= end)), None)
    relief = next((e for e in reliefs if end is not None and e.reported_at >= end), None)
    # Onsets other than the injected one: the shared machine itself sometimes slows the whole
    # job for a while (every rank sees it); they are shown, and do not fail the demo. A compound
    # onset reported while the injection lasts is a further step of it, not another slowdown.
    other_onsets = [e for e in onsets if e is not onset and not (
        onset is not None and e.reported_at > onset.reported_at
        and (end is None or e.reported_at <= end))]
    summary: dict[str, Any] = {
        "world_size": opts.world_size,
        "slow_rank": opts.slow_rank,
        "stopped_fraction": opts.stopped_fraction,
        "iterations_derived": state.iteration,
        "injected": {"start_iteration": start, "end_iteration": end},
        "detected": [e.__dict__ for e in state.detected],
        "onset_latency_iterations": onset.reported_at - start if onset and start else None,
        "relief_latency_iterations": relief.reported_at - end if relief and end else None,
        "injected_onset": onset.__dict__ if onset else None,  # the onset judged the injected one
        "other_onsets": [e.__dict__ for e in other_onsets],
        "rank_events": state.rank_events,  # what each rank's detector reported, and when
        "iteration_time_rel_error": errors,
        "events_exported": n_events,
        "events_lost": lost,
        "analyzer_records_lost": analyzer.dropped(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plotted = _plot(state, analyzer, out / "iteration_times.png")

    table = Table(title="failslow demo - summary")
    table.add_column("what")
    table.add_column("injected")
    table.add_column("detected")
    table.add_column("latency (iterations)")
    table.add_row(
        "onset", f"iteration {start}" if start is not None else "-",
        f"iteration {onset.iteration} ({onset.change:+.1%}), ranks {sorted(onset.ranks)}"
        if onset else "[red]missed[/red]",
        str(summary["onset_latency_iterations"]) if onset else "-",
    )
    table.add_row(
        "relief", f"iteration {end}" if end is not None else "-",
        f"iteration {relief.iteration} ({relief.change:+.1%})" if relief else "[red]missed[/red]",
        str(summary["relief_latency_iterations"]) if relief else "-",
    )
    table.add_row(
        "other slowdowns", "none",
        ", ".join(f"iteration {e.iteration} ({e.change:+.0%})" for e in other_onsets) or "none",
        "",
    )
    console.print(table)
    if errors:
        single = [e["per_iteration"] for e in errors.values()]
        tens = [e["per_10_iterations"] for e in errors.values()]
        console.print(
            "ACF iteration time vs each rank's own step timer (median relative error): "
            f"{np.median(tens):.2%} for 10-iteration means, {np.median(single):.2%} per single "
            "iteration (scheduling noise of 4 ranks on this machine's cores)", soft_wrap=True)
    console.print(f"{n_events} collective events captured ({lost} lost); results in {out}/ "
                  f"(iteration_times.csv, events.jsonl, summary.json"
                  f"{', iteration_times.png' if plotted else ''})")
    ok = onset is not None and relief is not None
    if not ok:
        console.print("[red]demo: detection did not match the injection (see summary.json)[/red]")
    return 0 if ok else 1
