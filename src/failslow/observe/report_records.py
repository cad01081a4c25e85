"""What ``failslow report`` draws, and how the control plane's records become it.

:class:`RunView` is the report of one run: the job's step times, the per-rank ratios of the heat
map, the fail-slow windows, diagnoses (greyhound 4.3), validation rounds, actions with their
estimated and measured effect (greyhound 5.2), checkpoints and hot updates (byterobust 6).
The loaders of :mod:`.report` fill it; :mod:`.report_html` draws it. The functions here turn
the control plane's journal (:mod:`failslow.core.control.journal`), diagnosis files and a demo's
summary into its records; each names the file it read when the content is not what it expects.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from failslow.errors import FailslowError

WARMUP_STEPS = 10
"""Steps a derived healthy phase skips at the start (imports settling, allocator warm-up)."""


@dataclass
class Phase:
    name: str
    start: int
    end: int
    median_s: float
    vs_healthy: float | None


@dataclass
class Mark:
    """A vertical line on the timeline: a diagnosis, a plan's apply step, a healthy round."""

    step: float
    kind: str  # diagnosis | apply | revert | healthy
    label: str
    title: str


@dataclass
class Diagnosed:
    number: int
    wall: float | None
    step: int | None
    kind: str
    slow_ranks: list[tuple[int, float]]
    slow_links: list[tuple[int, int, float]]
    evidence: dict[str, Any]


@dataclass
class Round:
    """One validation round (profiling, validating, diagnosed) from the journal."""

    wall: float
    step: int | None
    trigger: str
    suspects: list[int]
    healthy: bool | None
    paused_s: float | None


@dataclass
class Action:
    """A plan applied or reverted, with the model's estimates and the measured effect."""

    action: str  # apply | revert
    strategy: str
    what: str
    apply_step: int | None
    reason: str
    committed: bool | None  # None: not recorded (a summary without the journal)
    wall: float | None = None
    estimated_s: float | None = None
    baseline_s: float | None = None
    overhead_s: float | None = None
    before: tuple[int, int, float | None] | None = None  # steps [a, b), median step time
    after: tuple[int, int, float | None] | None = None
    effect: str | None = None
    """What the ranks reported after the apply step: "in effect" / "not in effect" (None: not
    recorded)."""
    effect_detail: str = ""
    outcome: dict[str, Any] | None = None
    """The controller's measurement a few steps later: predicted_s, measured_s, verdict."""
    drift: dict[str, Any] | None = None
    """Where it paid and later stopped paying: measured_s, reason, then (what was done)."""


@dataclass
class RunView:
    """Everything the report draws; None or empty where the run recorded nothing."""

    source: str  # demo | run | simulate
    run_dir: Path
    title: str = ""
    started: float | None = None
    facts: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    first_step: int = 0
    step_times: np.ndarray | None = None  # [i] is step first_step + i (NaN: not seen)
    step_unit: str = "step"
    phases: list[Phase] = field(default_factory=list)
    windows: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, kind
    marks: list[Mark] = field(default_factory=list)
    onsets: list[tuple[int, str, int]] = field(default_factory=list)  # iteration, type, rank
    transients: list[tuple[int, int, int, float]] = field(default_factory=list)
    """Slowdowns over before they persisted (issue 47): start, end iteration, rank, x level."""
    rank_ratio: np.ndarray | None = None  # ranks x steps
    rank_ids: list[int] = field(default_factory=list)
    rank_first: int = 0
    rank_unit: str = "step"
    diagnoses: list[Diagnosed] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    updates: list[dict[str, Any]] | None = None
    snapshots: list[dict[str, Any]] | None = None
    sim_results: list[dict[str, Any]] | None = None
    sim_actions: dict[str, list[tuple[float, str]]] | None = None
    sim_scenario: Any = None

    @property
    def end_step(self) -> int:
        return self.first_step + (0 if self.step_times is None else len(self.step_times))


def when(wall: float | None) -> str:
    """A wall time as ``YYYY-mm-dd HH:MM:SS UTC``."""
    return "-" if wall is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall))


def bad_content(path: Path, exc: Exception) -> FailslowError:
    """The one-line error for a file whose content is not what the report expects."""
    what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
    return FailslowError(f"{path}: unexpected content ({type(exc).__name__}: {what})")


def read_json(path: Path, expected: type = dict) -> Any:
    """A JSON file's content, which must be an ``expected``; else a one-line error naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FailslowError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise FailslowError(f"{path}: not a text file (expected JSON)") from None
    except ValueError as exc:
        raise FailslowError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, expected):
        kind = expected.__name__.replace("dict", "object").replace("list", "array")
        raise FailslowError(f"{path}: expected a JSON {kind}, got {type(data).__name__}")
    return data


# ---- diagnoses and validation rounds ---------------------------------------------------------
def diagnoses_from_files(
    log_dir: Path, fallback: Any = None, fallback_path: Path | None = None
) -> list[Diagnosed]:
    """``diagnosis-<n>.json`` in ``log_dir`` by number, else ``fallback`` (a demo summary's
    list); each placed at the step validation paused at (``evidence.target.step``)."""
    files = sorted(
        (int(m.group(1)), p)
        for p in log_dir.glob("diagnosis-*.json")
        if (m := re.fullmatch(r"diagnosis-(\d+)\.json", p.name))
    )
    records = [(p, read_json(p)) for _, p in files]
    if not records and isinstance(fallback, list):
        records = [(fallback_path or log_dir, d) for d in fallback]
    out = []
    for n, (path, raw) in enumerate(records, 1):
        try:
            d = diagnosed(n, raw, None)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise bad_content(path, exc) from None
        target = d.evidence.get("target")
        if isinstance(target, dict) and isinstance(target.get("step"), int):
            d.step = target["step"]
        out.append(d)
    return out


def diagnosed(n: int, raw: dict[str, Any], wall: float | None) -> Diagnosed:
    return Diagnosed(
        number=n,
        wall=wall,
        step=None,
        kind=str(raw["kind"]),
        slow_ranks=[(int(r), float(s)) for r, s in raw.get("slow_ranks", [])],
        slow_links=[(int(a), int(b), float(s)) for a, b, s in raw.get("slow_links", [])],
        evidence=dict(raw.get("evidence") or {}),
    )


def read_control_journal(
    view: RunView, events: list[dict[str, Any]], path: Path, walls: tuple[np.ndarray, np.ndarray]
) -> None:
    """Diagnoses, validation rounds, onsets, transients and plans from the journal's events
    (``path``), timed events placed at the step whose end is closest (``walls``: steps, their
    end walls)."""
    try:
        _journal_records(view, events, walls)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise bad_content(path, exc) from None


def _journal_records(
    view: RunView, events: list[dict[str, Any]], walls: tuple[np.ndarray, np.ndarray]
) -> None:
    trigger, suspects = "", []
    for ev in events:
        kind, wall = ev["kind"], float(ev.get("wall") or 0.0)
        if kind == "onset":
            view.onsets.append((int(ev["iteration"]), str(ev["type"]), int(ev["rank"])))
        elif kind == "transient":
            before = float(ev["before_s"])
            x = float(ev["after_s"]) / before if before > 0 else math.nan
            view.transients.append((int(ev["start"]), int(ev["end"]), int(ev["rank"]), x))
        elif kind == "diagnosis":
            d = diagnosed(len(view.diagnoses) + 1, ev["diagnosis"], wall)
            d.step = step_at(walls, wall)
            view.diagnoses.append(d)
        elif kind == "plan":
            view.actions.append(_journal_action(ev, wall))
        elif kind in ("effect", "outcome", "drift"):
            action = _action_of(view.actions, ev)
            if action is not None and kind == "effect":
                action.effect, action.effect_detail = str(ev["state"]), str(ev.get("detail") or "")
            elif action is not None and kind == "drift":
                action.drift = {k: ev.get(k) for k in ("measured_s", "reason", "then")}
            elif action is not None:
                action.outcome = {
                    k: ev.get(k) for k in ("predicted_s", "measured_s", "verdict", "reason")
                }
        elif kind == "unavailable":
            view.notes.append(f"{ev['strategy']} is unavailable in this job: {ev['reason']}")
        elif kind == "state":
            detail = ev.get("detail") or {}
            if ev["state"] == "profiling":
                trigger, suspects = _trigger(detail), []
            elif ev["state"] == "validating":
                suspects = sorted({int(r) for s in detail.get("suspects", []) for r in s["ranks"]})
            elif ev["state"] == "diagnosed":
                view.rounds.append(
                    Round(wall, step_at(walls, wall), trigger or "-", suspects,
                          detail.get("healthy"), detail.get("paused_s"))
                )  # fmt: skip


def _action_of(actions: list[Action], ev: dict[str, Any]) -> Action | None:
    """The newest committed action at ``ev``'s apply step (what an effect or outcome is of)."""
    step = ev.get("apply_step")
    return next(
        (a for a in reversed(actions) if a.committed and a.apply_step == step
         and a.action == ev.get("action")),
        None,
    )  # fmt: skip


def _trigger(detail: dict[str, Any]) -> str:
    if detail.get("recheck"):
        return f"re-validation ({detail['recheck']})"
    onsets = detail.get("onsets") or []
    if not onsets:
        return "-"
    o, more = onsets[0], f" (+{len(onsets) - 1})" if len(onsets) > 1 else ""
    return f"onset: rank {o.get('rank')} at iteration {o.get('iteration')}{more}"


def step_at(walls: tuple[np.ndarray, np.ndarray], wall: float) -> int | None:
    """The step whose end is closest to ``wall`` (None when no step has a wall time)."""
    steps, times = walls
    if not len(times):
        return None
    i = int(np.searchsorted(times, wall))
    best = min((j for j in (i - 1, i) if 0 <= j < len(times)), key=lambda j: abs(times[j] - wall))
    return int(steps[best])


def onset_windows(onsets: list[tuple[int, str, int]], end: float) -> list[tuple[float, float]]:
    """Spans, by iteration, in which some rank was slow: from the first onset to the last relief
    while any rank's onset had no relief yet, in the journal's order (a node places a change
    point some iterations back; one still open lasts to ``end``)."""
    slow: set[int] = set()
    spans: list[tuple[float, float]] = []
    start = stop = 0.0
    for iteration, kind, rank in onsets:
        if kind == "onset":
            start, stop = (min(start, iteration), stop) if slow else (iteration, iteration)
            slow.add(rank)
        elif rank in slow:
            slow.discard(rank)
            stop = max(stop, iteration)
            if not slow:
                spans.append((float(start), float(stop)))
    if slow:
        spans.append((float(start), float(end)))
    merged: list[tuple[float, float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


# ---- actions ----------------------------------------------------------------------------------
def _what(plan: dict[str, Any]) -> str:
    """What a plan changes: S2's counts, S3's host of every role, S4's evicted hosts."""
    if plan.get("counts"):
        return f"counts {list(plan['counts'])}"
    if plan.get("hosts"):
        return f"roles to hosts {list(plan['hosts'])}"
    if plan.get("evict"):
        return f"evict {list(plan['evict'])}"
    return str(plan.get("type", "-"))


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _journal_action(ev: dict[str, Any], wall: float) -> Action:
    plan = ev.get("plan") or {}
    return Action(
        action=str(ev["action"]),
        strategy=str(ev.get("strategy") or plan.get("type", "-")),
        what=_what(plan),
        apply_step=None if ev.get("apply_step") is None else int(ev["apply_step"]),
        reason=str(ev.get("reason") or "") + (f" ({ev['detail']})" if ev.get("detail") else ""),
        committed=bool(ev.get("committed")),
        wall=wall,
        estimated_s=_float(plan.get("step_time_s")),
        baseline_s=_float(plan.get("baseline_step_s")),
        overhead_s=_float(plan.get("overhead_s")),
    )


def actions_from_summary(rows: Any, path: Path) -> list[Action]:
    """A demo summary's actions (no journal: no estimates, no commit outcome recorded)."""
    try:
        return [
            Action(
                action=str(a["action"]),
                strategy=str(a["strategy"]),
                what=_what(a),
                apply_step=None if a.get("apply_step") is None else int(a["apply_step"]),
                reason=str(a.get("reason") or ""),
                committed=None,
            )
            for a in rows or []
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise bad_content(path, exc) from None


# ---- what every kind of run gets once its records are read -------------------------------------
def finish_view(view: RunView) -> None:
    """Marks on the timeline, phases (when the run did not record them) and each action's
    measured effect."""
    for d in view.diagnoses:
        if d.step is not None:
            who = ", ".join(f"rank {r} {s:.1f}x" for r, s in d.slow_ranks[:3]) or ", ".join(
                f"link {a}-{b} {s:.1f}x" for a, b, s in d.slow_links[:3]
            )
            view.marks.append(
                Mark(d.step, "diagnosis", f"D{d.number}", f"diagnosis {d.number}: {who or d.kind}")
            )
    for r in view.rounds:
        if r.healthy and r.step is not None:
            view.marks.append(Mark(r.step, "healthy", "ok", f"validated healthy: {r.trigger}"))
    for a in view.actions:
        if a.apply_step is not None and a.committed is not False:
            short = a.strategy.split()[0] if a.strategy else "?"
            view.marks.append(
                Mark(a.apply_step, a.action, f"{a.action} {short}",
                     f"{a.action} {a.strategy} from step {a.apply_step}: {a.reason}")
            )  # fmt: skip
    if view.step_times is None or not len(view.step_times):
        return
    if not view.phases:
        view.phases = derive_phases(view)
    measure_actions(view)


def derive_phases(view: RunView) -> list[Phase]:
    """healthy / slowed / mitigated / after from the fail-slow window - the first diagnosis's,
    else the first - and the first plan applied in it (the demo's own phases,
    :mod:`failslow.demo.mitigation_report`)."""
    assert view.step_times is not None
    first, end = view.first_step, view.end_step
    warm = first + (WARMUP_STEPS if end - first > 4 * WARMUP_STEPS else 0)
    bounds = {"healthy": (warm, end)}
    diagnosed = [d.step for d in view.diagnoses if d.step is not None]
    window = next(
        (w for w in view.windows if diagnosed and w[0] <= diagnosed[0] <= w[1]),
        view.windows[0] if view.windows else None,
    )
    if window is not None:
        start, stop = int(window[0]), int(min(window[1], end))
        applied = [a.apply_step for a in view.actions if a.action == "apply" and a.apply_step]
        bounds = {"healthy": (warm, start)}
        if applied and start <= applied[0] < stop:
            bounds["slowed"] = (start, applied[0])
            bounds["mitigated"] = (applied[0], stop)
        else:
            bounds["slowed"] = (start, stop)
        bounds["after"] = (stop, end)
    phases = []
    for name, (a, b) in bounds.items():
        median = median_of(view, a, b)
        if b > a and median is not None:
            phases.append(Phase(name, a, b, median, None))
    healthy = next((p.median_s for p in phases if p.name == "healthy"), None)
    for p in phases:
        p.vs_healthy = p.median_s / healthy if healthy else None
    return phases


def median_of(view: RunView, a: int, b: int) -> float | None:
    """The median step time over steps [a, b) (None: no step seen there)."""
    if view.step_times is None:
        return None
    lo, hi = max(a - view.first_step, 0), max(b - view.first_step, 0)
    values = view.step_times[lo:hi]
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else None


def measure_actions(view: RunView, before_steps: int = 20) -> None:
    """Each action's measured effect: the median step time from its apply step to the next
    action's, against the steps before it (since the previous action or the start of the
    fail-slow window it acts in; at most ``before_steps``)."""
    applied = sorted(
        (a for a in view.actions if a.apply_step is not None and a.committed is not False),
        key=lambda a: a.apply_step or 0,
    )
    for i, a in enumerate(applied):
        step = int(a.apply_step or 0)
        nxt = int(applied[i + 1].apply_step or 0) if i + 1 < len(applied) else view.end_step
        lo = step - before_steps
        if i > 0:
            lo = max(lo, int(applied[i - 1].apply_step or 0))
        for start, stop, _kind in view.windows:
            if start <= step < stop:
                lo = max(lo, int(start))
        a.before = (lo, step, median_of(view, lo, step))
        a.after = (step, nxt, median_of(view, step, nxt))
