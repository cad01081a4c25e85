"""The charts of ``failslow report``, as inline SVG strings (no plotting library, nothing fetched).

- :func:`timeline`: the job's step time per step (greyhound Fig. 14's view of a run), fail-slow
  windows shaded, diagnoses and plans as labelled vertical lines, onsets and reliefs as ticks;
- :func:`heatmap`: ranks x step buckets, each cell a rank's step time over the step's median over
  ranks (greyhound 4.2: a straggler is a rank slower than its peers, not a slow job);

Every chart has a fixed ``viewBox`` and scales to the page's width; text is at least 11 px at
1280 px. Cells and lines carry ``<title>`` tooltips and ``data-`` attributes (tests read them).
"""

from __future__ import annotations

import math
import warnings
from html import escape
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from failslow.observe.report_records import RunView

WIDTH = 1160
LEFT, RIGHT = 72, 96
PLOT_W = WIDTH - LEFT - RIGHT
MAX_POINTS = 1500
MAX_COLUMNS = 160
MAX_ROWS = 40

COLORS = {
    "line": "#1f2937",
    "grid": "#e5e7eb",
    "axis": "#6b7280",
    "injected": "#ef4444",
    "onset": "#f59e0b",
    "diagnosis": "#d97706",
    "apply": "#2563eb",
    "replan": "#2563eb",
    "revert": "#7c3aed",
    "rollback": "#b91c1c",
    "healthy": "#9ca3af",
    "relief": "#16a34a",
    "transient": "#64748b",
    "healthy_phase": "#16a34a",
    "slowed": "#dc2626",
    "mitigated": "#2563eb",
    "after": "#6b7280",
}
PHASE_COLORS = {"healthy": "#16a34a", "slowed": "#dc2626", "S2": "#f59e0b", "mitigated": "#2563eb"}


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 5 x 10^k steps)."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def nice_max(hi: float, count: int = 6) -> float:
    """The smallest round value >= ``hi`` on the tick grid of [0, hi]."""
    if not hi > 0:
        return 1.0
    ticks = nice_ticks(0.0, hi, count)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else hi
    return ticks[-1] if ticks[-1] >= hi else ticks[-1] + step


def fmt_s(seconds: float | None) -> str:
    """A duration for a label: ms below 0.1 s, else seconds with three significant digits."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if abs(seconds) < 0.1:
        return f"{seconds * 1000:.3g} ms"
    return f"{seconds:.3g} s"


def tick_label(value: float) -> str:
    return f"{value:g}"


class Scale:
    def __init__(self, lo: float, hi: float, px0: float, px1: float) -> None:
        self.lo, self.hi, self.px0, self.px1 = lo, hi if hi > lo else lo + 1, px0, px1

    def __call__(self, v: float) -> float:
        return self.px0 + (v - self.lo) * (self.px1 - self.px0) / (self.hi - self.lo)


def _x_axis(x: Scale, y_px: float, unit: str, top: float | None = None) -> list[str]:
    out = [f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{y_px}" y2="{y_px}" class="axis"/>']
    for t in nice_ticks(x.lo, x.hi, 10):
        px = x(t)
        if top is not None:
            out.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{top}" y2="{y_px}" class="grid"/>')
        out.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{y_px}" y2="{y_px + 5}" class="axis"/>')
        out.append(
            f'<text x="{px:.1f}" y="{y_px + 18}" text-anchor="middle">{tick_label(t)}</text>'
        )
    out.append(
        f'<text x="{LEFT + PLOT_W / 2}" y="{y_px + 36}" text-anchor="middle" class="title">'
        f"{escape(unit)}</text>"
    )
    return out


def _stagger(marks: list[tuple[float, str]], rows: int, gap: float = 6.0) -> list[int]:
    """A label row for each (x, label), so labels in one row do not overlap (~7 px a char)."""
    ends = [-1e9] * rows
    out = []
    for px, label in marks:
        half = 3.6 * len(label)
        row = next((r for r in range(rows) if ends[r] + gap < px - half), None)
        row = row if row is not None else int(np.argmin(ends))
        ends[row] = px + half
        out.append(row)
    return out


# ---- the step-time timeline ---------------------------------------------------------------------
def timeline(view: RunView) -> str:
    """The job's step time per step with windows, phases, marks and onset ticks."""
    times = view.step_times
    assert times is not None
    first, n = view.first_step, len(times)
    top, plot_h, label_rows = 62, 250, 3
    bottom = top + plot_h
    x = Scale(first, first + n, LEFT, LEFT + PLOT_W)
    finite = times[np.isfinite(times)]
    peak = float(finite.max()) if len(finite) else 1.0
    usual = float(np.percentile(finite, 98)) * 1.5 if len(finite) else 1.0
    y_hi = nice_max(usual if peak > 1.3 * usual else peak * 1.04)  # rare spikes go off the top
    y = Scale(0.0, y_hi, bottom, top)
    svg = [
        f'<svg id="timeline" viewBox="0 0 {WIDTH} {bottom + 48}" role="img" '
        f'aria-label="step time per {view.step_unit}" data-unit="{view.step_unit}" '
        f'data-first="{first}" data-n="{n}" '
        f'data-left="{LEFT}" data-plot-width="{PLOT_W}" data-width="{WIDTH}">'
    ]
    for start, end, kind in view.windows:
        a, b = x(max(start, first)), x(min(end, first + n))
        if b > a:
            label = "injected fail-slow" if kind == "injected" else "fail-slow (onset to relief)"
            svg.append(
                f'<rect class="window" data-kind="{kind}" x="{a:.1f}" y="{top}" width="{b - a:.1f}"'
                f' height="{plot_h}" fill="{COLORS[kind]}" fill-opacity="0.12">'
                f"<title>{label}: {view.step_unit}s {start:g}-{end:g}</title></rect>"
            )
    for t in nice_ticks(0, y_hi, 6):
        svg.append(
            f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{y(t):.1f}" y2="{y(t):.1f}" class="grid"/>'
        )
        svg.append(
            f'<text x="{LEFT - 8}" y="{y(t) + 4:.1f}" text-anchor="end">{tick_label(t)}</text>'
        )
    svg.append(
        f'<text transform="translate(18 {top + plot_h / 2}) rotate(-90)" text-anchor="middle" '
        f'class="title">step time (s)</text>'
    )
    svg += _x_axis(x, bottom, view.step_unit)
    svg += _series(np.minimum(times, y_hi), first, x, y)
    svg += _off_scale(view, x, top, y_hi)
    svg += _onset_ticks(view, x, bottom)
    svg += _transient_bars(view, x, bottom)
    svg += _marks(view, x, top, bottom, label_rows)
    svg += _phase_strip(view, x, top)  # over the marks' lines, under their labels
    svg.append(
        f'<line id="hover-line" x1="0" x2="0" y1="{top}" y2="{bottom}" class="hover" '
        'visibility="hidden"/>'
    )
    svg.append("</svg>")
    return "\n".join(svg)


def _off_scale(view: RunView, x: Scale, top: float, y_hi: float) -> list[str]:
    """A mark with its value at the top for each step above the scale (a validation pause)."""
    assert view.step_times is not None
    with np.errstate(invalid="ignore"):
        over = np.flatnonzero(view.step_times > y_hi)
    out, last = [], -1e9
    for i in over[:200]:
        px, value = x(view.first_step + i + 0.5), float(view.step_times[i])
        step = view.first_step + int(i)
        label = ""
        if px - last > 48:  # room for its value, right of the mark
            label = f'<text x="{px + 6:.1f}" y="{top + 12}" class="off">{value:.2g} s</text>'
            last = px
        out.append(
            f'<g class="off-scale"><title>{view.step_unit} {step}: {fmt_s(value)} (off the scale)'
            f'</title><polygon points="{px - 4:.1f},{top + 12} {px + 4:.1f},{top + 12} '
            f'{px:.1f},{top + 3}" fill="{COLORS["line"]}"/>{label}</g>'
        )
    return out


def _series(times: np.ndarray, first: int, x: Scale, y: Scale) -> list[str]:
    n = len(times)
    if n > MAX_POINTS:  # a long run: per-bucket median line and min-max band
        size = math.ceil(n / MAX_POINTS)
        pad = np.full(math.ceil(n / size) * size, np.nan)
        pad[:n] = times
        cols = pad.reshape(-1, size)
        with warnings.catch_warnings():  # an all-NaN bucket (steps never seen) stays NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            mid, lo, hi = np.nanmedian(cols, 1), np.nanmin(cols, 1), np.nanmax(cols, 1)
        steps = first + np.arange(len(cols)) * size + size / 2
        band = [f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps, hi, strict=True) if np.isfinite(v)]
        band += [
            f"{x(s):.1f},{y(v):.1f}"
            for s, v in zip(steps[::-1], lo[::-1], strict=True)
            if np.isfinite(v)
        ]
        out = [f'<polygon points="{" ".join(band)}" fill="{COLORS["line"]}" fill-opacity="0.15"/>']
        return [*out, _path(steps, mid, x, y)]
    return [_path(first + np.arange(n) + 0.5, times, x, y)]


def _path(steps: np.ndarray, values: np.ndarray, x: Scale, y: Scale) -> str:
    parts, pen = [], "M"
    for s, v in zip(steps, values, strict=True):
        if not np.isfinite(v):
            pen = "M"
            continue
        parts.append(f"{pen}{x(float(s)):.1f} {y(float(v)):.1f}")
        pen = "L"
    return (
        f'<path class="series" d="{" ".join(parts)}" fill="none" stroke="{COLORS["line"]}" '
        'stroke-width="1.4"/>'
    )


def _phase_strip(view: RunView, x: Scale, top: float) -> list[str]:
    out = []
    for p in view.phases:
        a, b = x(max(p.start, x.lo)), x(min(p.end, x.hi))
        if b <= a:
            continue
        color = PHASE_COLORS.get(p.name, COLORS["after"])
        label = f"{p.name} {fmt_s(p.median_s)}"
        out.append(
            f'<g class="phase" data-phase="{escape(p.name)}"><rect x="{a:.1f}" y="{top - 16}" '
            f'width="{b - a:.1f}" height="14" fill="{color}" fill-opacity="0.85"/>'
            f"<title>{escape(p.name)}: steps {p.start}-{p.end}, median {fmt_s(p.median_s)}</title>"
        )
        if b - a > 7 * len(label):
            out.append(
                f'<text x="{(a + b) / 2:.1f}" y="{top - 5}" text-anchor="middle" '
                f'class="on-dark">{escape(label)}</text>'
            )
        out.append("</g>")
    return out


def _onset_ticks(view: RunView, x: Scale, bottom: float) -> list[str]:
    grouped: dict[tuple[int, str], list[int]] = {}
    for iteration, kind, rank in view.onsets:
        grouped.setdefault((iteration, kind), []).append(rank)
    out = []
    for (iteration, kind), ranks in sorted(grouped.items()):
        if not x.lo <= iteration <= x.hi:
            continue
        px = x(iteration)
        color = COLORS["injected"] if kind == "onset" else COLORS["relief"]
        shape = (
            f"{px - 5:.1f},{bottom - 1} {px + 5:.1f},{bottom - 1} {px:.1f},{bottom - 10}"
            if kind == "onset"
            else f"{px - 5:.1f},{bottom - 10} {px + 5:.1f},{bottom - 10} {px:.1f},{bottom - 1}"
        )
        out.append(
            f'<polygon class="onset" data-kind="{kind}" points="{shape}" fill="{color}">'
            f"<title>{kind} at iteration {iteration}: rank(s) {', '.join(map(str, sorted(ranks)))}"
            "</title></polygon>"
        )
    return out


def _transient_bars(view: RunView, x: Scale, bottom: float) -> list[str]:
    """A short bar on the axis per transient: a slowdown verified on a rank and over before it
    persisted (issue 47) - drawn so a reader sees what the detector chose not to act on."""
    out = []
    for start, end, rank, level in sorted(view.transients):
        a, b = x(max(start, x.lo)), x(min(max(end, start + 1), x.hi))
        if b <= a:
            continue
        ratio = f", x{level:.2f}" if math.isfinite(level) else ""
        out.append(
            f'<rect class="transient" data-rank="{rank}" x="{a:.1f}" y="{bottom - 16}" '
            f'width="{max(b - a, 2.0):.1f}" height="4" fill="{COLORS["transient"]}">'
            f"<title>transient on rank {rank}: iterations {start}-{end}{ratio} (over before it "
            "persisted: not a fail-slow, no validation)</title></rect>"
        )
    return out


def _marks(view: RunView, x: Scale, top: float, bottom: float, rows: int) -> list[str]:
    marks = sorted((m for m in view.marks if x.lo <= m.step <= x.hi), key=lambda m: m.step)
    labelled = [(x(m.step), m.label) for m in marks]
    out = []
    for m, (px, _), row in zip(marks, labelled, _stagger(labelled, rows), strict=True):
        color = COLORS[m.kind]
        dash = {"diagnosis": "5 3", "healthy": "2 3"}.get(m.kind, "")
        width = 2 if m.kind in ("apply", "replan", "revert", "rollback") else 1.3
        label_y = top - 22 - row * 14
        out.append(
            f'<g class="mark" data-kind="{m.kind}" data-step="{m.step:g}">'
            f"<title>{escape(m.title)}</title>"
            f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{label_y + 3}" y2="{bottom}" stroke="{color}" '
            f'stroke-width="{width}" stroke-dasharray="{dash}"/>'
            f'<text x="{px:.1f}" y="{label_y}" text-anchor="middle" fill="{color}" '
            f'class="mark-label">{escape(m.label)}</text></g>'
        )
    return out


# ---- the per-rank heat map --------------------------------------------------------------------
def heatmap(view: RunView) -> tuple[str, str]:
    """(the SVG, a note on what it leaves out): ranks x step buckets, colour = ratio."""
    ratio = view.rank_ratio
    assert ratio is not None
    ranks = list(view.rank_ids)
    with np.errstate(all="ignore"):
        logs = np.log(ratio)
    steps = view.rank_first + np.arange(logs.shape[1])
    slow = np.zeros(len(steps), dtype=bool)
    for start, end, _kind in view.windows:
        slow |= (steps >= start) & (steps < end)
    mean_all = _row_means(logs)
    mean_log = _row_means(logs[:, slow]) if slow.any() else mean_all
    note = ""
    if len(ranks) > MAX_ROWS:  # the ranks that stand out most
        keep = sorted(np.argsort(-np.abs(mean_log))[:MAX_ROWS])
        note = (
            f"showing the {MAX_ROWS} of {len(ranks)} ranks whose step time differs most from "
            "their peers'"
        )
        logs, ranks, mean_log, mean_all = (
            logs[keep],
            [ranks[i] for i in keep],
            mean_log[keep],
            mean_all[keep],
        )
    n = logs.shape[1]
    size = max(1, math.ceil(n / MAX_COLUMNS))
    cols = math.ceil(n / size)
    finite = np.abs(logs[np.isfinite(logs)])
    vmax = float(
        np.clip(np.quantile(finite, 0.995) if len(finite) else 0.0, math.log(1.02), math.log(4))
    )
    row_h = 24 if len(ranks) <= 16 else max(8, 360 // len(ranks))
    top = 36
    bottom = top + row_h * len(ranks)
    x = Scale(view.rank_first, view.rank_first + n, LEFT, LEFT + PLOT_W)
    slowest = int(np.argmax(mean_log))
    svg = [
        f'<svg id="heatmap" viewBox="0 0 {WIDTH} {bottom + 96}" role="img" '
        f'aria-label="per-rank step time over the median">',
        f'<text x="{LEFT + PLOT_W + 6}" y="{top - 20}" class="title">mean</text>',
        f'<text x="{LEFT + PLOT_W + 6}" y="{top - 6}">({"fail-slow" if slow.any() else "all"})'
        "</text>",
    ]
    for i, rank in enumerate(ranks):
        ry = top + i * row_h
        mean = math.exp(mean_log[i])
        star = i == slowest and len(ranks) > 1
        svg.append(
            f'<g class="hm-row{" slowest" if star else ""}" data-rank="{rank}" '
            f'data-mean="{math.exp(mean_all[i]):.4f}" data-shown-mean="{mean:.4f}">'
            f'<text x="{LEFT - 8}" y="{ry + row_h / 2 + 4:.1f}" text-anchor="end" '
            f'class="{"strong" if star else ""}">rank {rank}</text>'
        )
        for c in range(cols):
            chunk = logs[i, c * size : (c + 1) * size]
            chunk = chunk[np.isfinite(chunk)]
            if not len(chunk):
                continue
            v = float(np.median(chunk))
            a, b = x(view.rank_first + c * size), x(view.rank_first + min((c + 1) * size, n))
            lo, hi = view.rank_first + c * size, view.rank_first + min((c + 1) * size, n) - 1
            span = f"{lo}" if lo == hi else f"{lo}-{hi}"
            svg.append(
                f'<rect x="{a:.2f}" y="{ry}" width="{b - a + 0.3:.2f}" height="{row_h - 1}" '
                f'fill="{diverging(v / vmax)}" data-ratio="{math.exp(v):.4f}"><title>rank {rank}, '
                f"{view.rank_unit} {span}: {math.exp(v):.3f}x the median</title></rect>"
            )
        svg.append(
            f'<text x="{LEFT + PLOT_W + 6}" y="{ry + row_h / 2 + 4:.1f}" '
            f'class="{"strong" if star else ""}">{mean:.3f}x</text></g>'
        )
    svg += _x_axis(x, bottom + 2, view.rank_unit)
    svg += _colorbar(vmax, bottom + 58)
    svg.append("</svg>")
    where = "in the fail-slow's steps" if slow.any() else "over the run"
    summary = (
        f"Slowest rank {where}: rank {ranks[slowest]}, {math.exp(mean_log[slowest]):.3f}x the "
        f"median of all ranks on average (the others: "
        + ", ".join(f"{math.exp(v):.3f}x" for j, v in enumerate(mean_log) if j != slowest)[:300]
        + ")."
    )
    return "\n".join(svg), [summary] + ([note] if note else [])


def _row_means(logs: np.ndarray) -> np.ndarray:
    """Each row's mean of its finite values (0: none), i.e. the geometric mean ratio's log."""
    finite = np.isfinite(logs)
    total = np.where(finite, logs, 0.0).sum(axis=1)
    return np.divide(total, finite.sum(axis=1), out=np.zeros(len(logs)), where=finite.any(axis=1))


def diverging(t: float) -> str:
    """Blue (faster than the median) through near-white (the median) to red (slower); t in
    [-1, 1] (clipped)."""
    t = max(-1.0, min(1.0, t))
    end = (215, 48, 39) if t > 0 else (44, 123, 182)
    mid = (246, 246, 246)
    k = abs(t) ** 1.2  # small deviations (noise) stay pale
    r, g, b = (round(m + (e - m) * k) for m, e in zip(mid, end, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def _colorbar(vmax: float, y0: float) -> list[str]:
    w, x0 = 320, LEFT + PLOT_W - 320
    out = [
        f'<text x="{x0 - 10}" y="{y0 + 12}" text-anchor="end">'
        "rank's step time / median over ranks:</text>"
    ]
    steps = 40
    for i in range(steps):
        t = -1 + 2 * (i + 0.5) / steps
        out.append(
            f'<rect x="{x0 + i * w / steps:.1f}" y="{y0}" width="{w / steps + 0.4:.1f}" '
            f'height="14" fill="{diverging(t)}"/>'
        )
    for t, sign in ((-1, "\u2264"), (0, ""), (1, "\u2265")):
        px = x0 + (t + 1) / 2 * w
        out.append(
            f'<text x="{px:.1f}" y="{y0 + 30}" text-anchor="middle">'
            f"{sign}{math.exp(t * vmax):.3g}x</text>"
        )
    return out
