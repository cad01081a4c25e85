"""``failslow report RUN_DIR``: one self-contained HTML file for a run (DESIGN.md, ``observe/``).

The report puts in one place what the papers' evaluations show of a run: the job's step time
with the fail-slow and every decision on it (greyhound 7.2, Fig. 14), the per-rank view in which
the straggler stands out (4.2), the validation's evidence (4.3), each plan's estimated against
its measured effect (5.2), and the checkpoints and hot updates around it (byterobust 6). This
module finds what a run directory holds and reads it into one
:class:`~failslow.observe.report_records.RunView`; :mod:`.report_html` draws it (inline CSS and
SVG, a few lines of vanilla JS, nothing fetched).

A run directory is recognised by what it contains:

- a demo run (``failslow demo --out DIR``): ``summary.json``, ``steps.csv``,
  ``steps-rank<r>.json``, ``diagnosis-<n>.json`` and, newer, ``events.jsonl``;
- a ``failslow run --controller N`` ring directory: the event rings (:mod:`.report_rings`),
  ``diagnoses/`` with the control plane's journal and diagnosis files, ``updates.sqlite``;
- a ``failslow simulate --out DIR`` directory: ``results.json`` and ``actions.json``.

The control plane's journal (:mod:`failslow.core.control.journal`) is the first source of
diagnoses, validation rounds and plans; without it (older runs) they come from the summary and
the diagnosis files. A file that is there but cannot be read is a one-line
:class:`~failslow.errors.FailslowError` naming it.
"""

from __future__ import annotations

import csv
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from failslow.core.control.journal import JOURNAL, read_journal
from failslow.errors import FailslowError
from failslow.observe import report_rings
from failslow.observe.report_records import (
    Phase,
    RunView,
    actions_from_summary,
    bad_content,
    diagnoses_from_files,
    finish_view,
    onset_windows,
    read_control_journal,
    read_json,
)

_RANK_FILE = re.compile(r"steps-rank(\d+)(?:-(\w+))?\.json")
_MEASURE = (
    "{unit} time of each rank, from the {unit}'s start (the first rank's previous boundary) to "
    "this rank's {unit} boundary, over the median of all ranks"
)


def write_report(run_dir: Path, output: Path | None = None) -> Path:
    """Write the report of ``run_dir`` to ``output`` (default ``RUN_DIR/report.html``)."""
    from failslow.observe.report_html import render

    view = load_run(Path(run_dir))
    path = Path(output) if output is not None else Path(run_dir) / "report.html"
    try:
        path.write_text(render(view), encoding="utf-8")
    except OSError as exc:
        raise FailslowError(f"cannot write the report {path}: {exc.strerror or exc}") from None
    return path


def load_run(run_dir: Path) -> RunView:
    """What ``run_dir`` holds, read into a :class:`RunView`."""
    if not run_dir.is_dir():
        raise FailslowError(f"{run_dir}: not a directory (expected a run directory)")
    if (run_dir / "summary.json").is_file() or any(run_dir.glob("steps-rank*.json")):
        view = _load_demo(run_dir)
    elif (run_dir / "results.json").is_file():
        return _load_simulation(run_dir)
    elif report_rings.looks_like_run(run_dir):
        view = _load_ring_run(run_dir)
    else:
        raise FailslowError(
            f"{run_dir}: not a run directory: expected summary.json and steps-rank<r>.json "
            "(failslow demo), event rings or diagnoses/events.jsonl (failslow run --controller), "
            "or results.json (failslow simulate)"
        )
    history = report_rings.read_history(run_dir)
    if history is not None:
        view.updates = history[0]
    view.snapshots = report_rings.snapshot_records(run_dir, history[1] if history else {})
    finish_view(view)
    return view


def _journal(path: Path) -> list[dict[str, Any]] | None:
    if not path.is_file():
        return None
    try:
        return read_journal(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise FailslowError(f"{path}: cannot read the journal ({exc})") from None


# ---- a demo run -------------------------------------------------------------------------------
def _load_demo(run_dir: Path) -> RunView:
    summary_path = run_dir / "summary.json"
    summary = read_json(summary_path) if summary_path.is_file() else {}
    view = RunView(source="demo", run_dir=run_dir)
    ends = _rank_step_ends(run_dir)
    try:
        _demo_header(view, summary, ends)
        _demo_steps(view, run_dir, ends)
        view.phases = [
            Phase(name, int(p["steps"][0]), int(p["steps"][1]), float(p["median_step_s"]),
                  None if p.get("vs_healthy") is None else float(p["vs_healthy"]))
            for name, p in (summary.get("phases") or {}).items()
        ]  # fmt: skip
        start, end = summary.get("injected") or (None, None)
        if start is not None:
            view.windows.append(
                (float(start), float(view.end_step if end is None else end), "injected")
            )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise bad_content(summary_path, exc) from None
    events = _journal(run_dir / JOURNAL)
    if events:
        read_control_journal(view, events, run_dir / JOURNAL, _step_walls(ends))
    else:
        what = "no events.jsonl (an older run)" if events is None else "events.jsonl is empty"
        view.notes.append(
            f"{what}: diagnoses and actions come from summary.json and the diagnosis files; "
            "plan estimates and validation rounds were not recorded"
        )
        view.diagnoses = diagnoses_from_files(run_dir, summary.get("diagnoses"), summary_path)
        view.actions = actions_from_summary(summary.get("actions"), summary_path)
    return view


def _demo_header(view: RunView, summary: dict[str, Any], ends: dict[int, dict[int, float]]) -> None:
    job = summary.get("job") or summary.get("framework")
    world = summary.get("world_size") or len(ends) or "-"
    view.title = f"failslow demo: {job}" if job else f"failslow demo: {world} ranks"
    view.started = min((min(e.values()) for e in ends.values() if e), default=None)
    start, end = summary.get("injected") or (None, None)
    if summary.get("fault") == "link":
        fault = "link 0-1 shaped (tc)"
    else:
        share = summary.get("stopped_fraction")
        stopped = f", stopped {share:.0%} of the time" if isinstance(share, (int, float)) else ""
        fault = f"compute: rank {summary.get('slow_rank')} SIGSTOP-cycled{stopped}"
    fault = (
        f"{fault}; steps {start}-{'end' if end is None else end}" if start is not None else "none"
    )
    view.facts += [
        ("job", str(job) if job else "not recorded (summary.json names no framework)"),
        ("ranks", str(world)),
        ("fault injected", fault),
        ("mitigation", "on" if summary.get("mitigate", True) else "off (the baseline)"),
        ("steps run", str(summary.get("steps_run", "-"))),
    ]


def _rank_step_ends(run_dir: Path) -> dict[int, dict[int, float]]:
    """Per rank, when each step ended (step ``first - 1``: when the run started), from every
    ``steps-rank<r>*.json``: ``step_end[i]`` is when step ``first_step + i - 1`` ended; a
    restart's file (suffixed ``-<n>``) overrides the steps it ran again."""
    found = []
    for path in run_dir.glob("steps-rank*.json"):
        m = _RANK_FILE.fullmatch(path.name)
        if m:
            found.append((int(m.group(1)), m.group(2) or "", path))
    ends: dict[int, dict[int, float]] = {}
    for rank, _suffix, path in sorted(found, key=lambda f: (f[0], len(f[1]), f[1])):
        record = read_json(path)
        try:
            first = int(record.get("first_step") or 0)
            per_step = {first - 1 + i: float(t) for i, t in enumerate(record["step_end"])}
        except (KeyError, TypeError, ValueError) as exc:
            raise bad_content(path, exc) from None
        ends.setdefault(rank, {}).update(per_step)
    return ends


def _demo_steps(view: RunView, run_dir: Path, ends: dict[int, dict[int, float]]) -> None:
    """The job's step times (``steps.csv``, else the slowest rank's step ends) and the per-rank
    ratios of the heat map."""
    if (run_dir / "steps.csv").is_file():
        view.first_step, view.step_times = _read_steps_csv(run_dir / "steps.csv")
    common = sorted(set.intersection(*(set(e) for e in ends.values()))) if ends else []
    if len(common) < 2:
        return
    ranks = sorted(ends)
    steps = range(common[0], common[-1] + 1)
    matrix = np.array([[ends[r].get(s, np.nan) for s in steps] for r in ranks])
    if view.step_times is None:
        view.first_step = steps[1]
        view.step_times = np.diff(np.max(matrix, axis=0))
    view.rank_ids, view.rank_first = ranks, steps[1]
    view.rank_ratio = rank_ratio(matrix)


def rank_ratio(ends: np.ndarray) -> np.ndarray:
    """Each rank's step time over the step's median over ranks (ranks x steps, from ``ends``:
    when each rank reached each step boundary, one column more).

    A rank's step time counts from the step's start - the first rank's previous boundary - to
    its own boundary: in a synchronous job every rank's steps last as long as the slowest's
    (they wait for it in the collectives), and the straggler is the rank that gets there last."""
    with warnings.catch_warnings():  # a step no rank recorded stays NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        own = ends[:, 1:] - np.nanmin(ends[:, :-1], axis=0)
        return own / np.nanmedian(own, axis=0)


def _step_walls(ends: dict[int, dict[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, when the job finished each), by step: where timed events go on the timeline."""
    last: dict[int, float] = {}
    for per_step in ends.values():
        for step, wall in per_step.items():
            if step >= 0:
                last[step] = max(wall, last.get(step, wall))
    steps = sorted(last)
    return np.array(steps, dtype=float), np.array([last[s] for s in steps], dtype=float)


def _read_steps_csv(path: Path) -> tuple[int, np.ndarray]:
    try:
        with path.open(encoding="utf-8", newline="") as fh:
            rows = [(int(r["step"]), float(r["step_time_s"])) for r in csv.DictReader(fh)]
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise FailslowError(
            f"{path}: expected CSV columns step,step_time_s ({type(exc).__name__}: {exc})"
        ) from None
    if not rows:
        raise FailslowError(f"{path}: no steps (expected CSV columns step,step_time_s)")
    first = min(s for s, _ in rows)
    times = np.full(max(s for s, _ in rows) - first + 1, np.nan)
    for step, seconds in rows:
        times[step - first] = seconds
    return first, times


# ---- a failslow run ring directory ------------------------------------------------------------
def _load_ring_run(run_dir: Path) -> RunView:
    view = RunView(source="run", run_dir=run_dir, title="failslow run")
    log_dir = report_rings.log_dir_of(run_dir)
    events = _journal(log_dir / JOURNAL) if log_dir is not None else None
    found = report_rings.rank_boundaries(run_dir)
    walls: tuple[np.ndarray, np.ndarray] = (np.empty(0), np.empty(0))
    if found is not None:
        ranks, ends = found
        view.rank_ids, view.rank_first, view.rank_unit = ranks, 1, "iteration"
        view.rank_ratio = rank_ratio(ends)
        boundary = np.max(ends, axis=0)
        view.step_unit, view.first_step = "iteration", 1
        view.step_times = np.median(np.diff(ends, axis=1), axis=0)
        walls = (np.arange(len(boundary), dtype=float), boundary)
    steps = _journal_steps(events or [])
    if steps:  # the adapter's own step numbers and times (rank 0's) beat the rings'
        first = min(steps)
        view.step_unit, view.first_step = "step", first
        view.step_times = np.full(max(steps) - first + 1, np.nan)
        for step, (seconds, _wall) in steps.items():
            view.step_times[step - first] = seconds
        walls = (
            np.array(sorted(steps), dtype=float),
            np.array([steps[s][1] for s in sorted(steps)]),
        )
    if events is not None and log_dir is not None:
        read_control_journal(view, events, log_dir / JOURNAL, walls)
        view.windows += [(a, b, "onset") for a, b in onset_windows(view.onsets, view.end_step)]
    elif log_dir is not None:
        view.diagnoses = diagnoses_from_files(log_dir)
        view.notes.append(f"no {JOURNAL} in {log_dir}: diagnoses from the diagnosis files only")
    else:
        view.notes.append("no diagnoses/ directory: the control plane recorded nothing here")
    walls_known = [e["wall"] for e in events or [] if e.get("wall")]
    view.started = (
        min(walls_known) if walls_known else (float(walls[1][0]) if len(walls[1]) else None)
    )
    ranks_seen = len(view.rank_ids) or (max((o[2] for o in view.onsets), default=-1) + 1) or None
    view.facts += [
        ("ranks", f"{ranks_seen} (in the rings)" if view.rank_ids else str(ranks_seen or "-")),
        (
            f"{view.step_unit}s seen",
            str(view.end_step - view.first_step) if view.step_times is not None else "-",
        ),
        (
            "journal",
            str((log_dir / JOURNAL).relative_to(run_dir)) if events and log_dir else "none",
        ),
    ]
    return view


def _journal_steps(events: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """step -> (seconds, wall of the event that reported it) from the journal's steps events."""
    out: dict[int, tuple[float, float]] = {}
    for ev in events:
        if ev.get("kind") == "steps":
            for step, seconds in ev.get("steps") or []:
                out[int(step)] = (float(seconds), float(ev.get("wall") or 0.0))
    return out


# ---- a simulation -----------------------------------------------------------------------------
def _load_simulation(run_dir: Path) -> RunView:
    from failslow.sim.scenario import SCENARIOS, load_scenario

    results_path, actions_path = run_dir / "results.json", run_dir / "actions.json"
    results = read_json(results_path, list)
    actions = read_json(actions_path) if actions_path.is_file() else {}
    view = RunView(source="simulate", run_dir=run_dir, title="failslow simulate")
    try:
        # "gain" was the name of "vs_none" before the oracle column (older directories)
        view.sim_results = [
            {"vs_none": r.get("gain"), **r, "policy": str(r["policy"])} for r in results
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise bad_content(results_path, exc) from None
    try:
        view.sim_actions = {
            str(p): [(float(t), str(label)) for t, label in rows] for p, rows in actions.items()
        }
    except (TypeError, ValueError) as exc:
        raise bad_content(actions_path, exc) from None
    name = next((s for s in sorted(SCENARIOS, key=len, reverse=True) if s in run_dir.name), None)
    if name is not None:  # the default --out is runs/simulate-<scenario>-<time>
        view.sim_scenario = load_scenario(name)
        view.title = f"failslow simulate: {name}"
        view.facts.append(("scenario", f"{name}: {view.sim_scenario.description}"))
        view.facts.append(("simulated", f"{view.sim_scenario.duration_s / 60:.0f} min"))
    else:
        view.facts.append(("scenario", "not recorded (the directory's name names none)"))
    view.facts.append(("policies", ", ".join(r["policy"] for r in view.sim_results)))
    view.started = results_path.stat().st_mtime
    return view
