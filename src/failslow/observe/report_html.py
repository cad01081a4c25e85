"""The HTML page of ``failslow report``: one self-contained file (inline CSS, SVG and JS).

:func:`render` turns a :class:`~failslow.observe.report_records.RunView` into the page: a header
with what the run was and its phases, the step-time timeline and per-rank heat map
(:mod:`.report_svg`), the validation evidence (greyhound 4.3), the actions with estimated against
measured effect (5.2), and checkpoints and hot updates (byterobust 6); a simulation's policies and
actions come from :mod:`.report_sim`. A section without data says so in one line. The page's
stylesheet, script and building blocks are :mod:`.report_style`'s.
"""

from __future__ import annotations

import json
import math
from html import escape
from typing import TYPE_CHECKING, Any

from failslow.observe import report_svg
from failslow.observe.report_evidence import diagnosis_card, rounds_table
from failslow.observe.report_records import when
from failslow.observe.report_sim import simulation_sections
from failslow.observe.report_style import legend, none_recorded, page, section, table
from failslow.observe.report_svg import COLORS, PHASE_COLORS, fmt_s

if TYPE_CHECKING:
    from failslow.observe.report_records import Action, RunView

MAX_HOVER_STEPS = 20_000
"""Longer runs get no hover read-out (its data would dominate the file)."""


def render(view: RunView) -> str:
    """The report page for ``view``."""
    if view.source == "simulate":
        body = [_header(view), *simulation_sections(view)]
    else:
        body = [
            _header(view),
            _timeline(view),
            _heatmap(view),
            _validation(view),
            _actions(view),
            _checkpoints(view),
        ]
    return page(view.title, body, f"failslow report of {view.run_dir}")


# ---- header -----------------------------------------------------------------------------------
def _header(view: RunView) -> str:
    kind = {"demo": "failslow demo run", "run": "failslow run ring directory",
            "simulate": "failslow simulate output"}[view.source]  # fmt: skip
    stamp = "results written" if view.source == "simulate" else "started"
    facts = [*view.facts, (stamp, when(view.started))]
    out = [
        f"<header><h1>{escape(view.title)}</h1>",
        f'<p class="sub">{kind} &middot; <code>{escape(str(view.run_dir))}</code></p>',
        '<dl class="facts">'
        + "".join(f"<div><dt>{escape(k)}</dt><dd>{escape(v)}</dd></div>" for k, v in facts)
        + "</dl>",
    ]
    if view.source != "simulate":
        out.append(_cards(view))
        out.append("<h3>Phases</h3>")
        out.append(_phases(view))
    out += [f'<p class="note">{escape(n)}</p>' for n in view.notes]
    return "\n".join(out) + "</header>"


def _cards(view: RunView) -> str:
    phases = {p.name: p for p in view.phases}
    worst = max(
        (p for p in view.phases if p.vs_healthy), key=lambda p: p.vs_healthy or 0, default=None
    )
    paused = sum(r.paused_s or 0.0 for r in view.rounds)
    cards = [
        (
            f"{view.step_unit}s",
            str(view.end_step - view.first_step) if view.step_times is not None else "-",
        ),
        ("healthy step", fmt_s(phases["healthy"].median_s) if "healthy" in phases else "-"),
        (
            "worst phase",
            f"{worst.vs_healthy:.2f}x ({worst.name})" if worst and worst.vs_healthy else "-",
        ),
        ("diagnoses", str(len(view.diagnoses))),
        (
            f"validation rounds, {fmt_s(paused)} paused" if view.rounds else "validation rounds",
            str(len(view.rounds)) if view.rounds else "-",
        ),
        ("actions", str(len(view.actions))),
    ]
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="v">{escape(v)}</div>'
            f'<div class="k">{escape(k)}</div></div>'
            for k, v in cards
        )
        + "</div>"
    )


def _phases(view: RunView) -> str:
    if not view.phases:
        return none_recorded("Phases: none recorded (no step times).")
    rows = []
    for p in view.phases:
        color = PHASE_COLORS.get(p.name, COLORS["after"])
        swatch = f'<span class="sw" style="background:{color}"></span>'
        ratio = f"{p.vs_healthy:.2f}x" if p.vs_healthy else "-"
        rows.append([swatch + escape(p.name), f"{p.start}-{p.end}", fmt_s(p.median_s), ratio])
    return table(["phase", f"{view.step_unit}s", "median step time", "x healthy"], rows, "phases")


# ---- charts -----------------------------------------------------------------------------------
def _timeline(view: RunView) -> str:
    title = "Step-time timeline"
    if view.step_times is None or not len(view.step_times):
        return section("timeline", title, none_recorded("No step times recorded in this run."))
    kinds = {w[2] for w in view.windows} | {m.kind for m in view.marks}
    items = [("line", COLORS["line"], f"job step time per {view.step_unit}")]
    items += [(s, COLORS[k], label) for k, s, label in (
        ("injected", "box", "injected fail-slow"), ("onset", "box", "fail-slow: onset to relief"),
        ("diagnosis", "dash", "diagnosis (D<n>)"), ("healthy", "dot", "validated healthy"),
        ("apply", "bar", "plan applied"), ("replan", "bar", "plan re-planned"),
        ("revert", "bar", "plan reverted"), ("rollback", "bar", "plan rolled back (not in effect)"),
    ) if k in kinds]  # fmt: skip
    if "onset" in {o[1] for o in view.onsets}:
        items += [
            ("up", COLORS["injected"], "onset reported"),
            ("down", COLORS["relief"], "relief"),
        ]
    if view.transients:
        items.append(("box", COLORS["transient"], "transient: over before it persisted"))
    data = ""
    if len(view.step_times) <= MAX_HOVER_STEPS:
        values = [None if not math.isfinite(v) else round(float(v), 5) for v in view.step_times]
        data = f'<script type="application/json" id="step-data">{json.dumps(values)}</script>'
    caption = (
        f"The job's step time (the slowest rank's) per {view.step_unit}. Bars above the plot: "
        "phases with their median. Diagnoses sit at the step closest to their wall time, plans "
        "at the step they took effect; the spikes there are the validation pauses (rare ones above "
        "the scale: a mark at the top with the value). Triangles on the axis: the nodes' onsets "
        "and reliefs, at the iteration they placed them."
    )
    if view.transients:
        ranks = sorted({t[2] for t in view.transients})
        caption += (
            f" Grey bars above the axis: {len(view.transients)} transient slowdown"
            f"{'s' if len(view.transients) != 1 else ''} on rank{'s' if len(ranks) > 1 else ''} "
            f"{_few_ranks(ranks)} - verified, but over before they persisted, so not fail-slows "
            "and no validation pause (hover for each one's iterations and level)."
        )
    return section(
        "timeline", title, legend(items), report_svg.timeline(view), data,
        f'<p class="caption">{escape(caption)}</p>',
    )  # fmt: skip


def _few_ranks(ranks: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def _heatmap(view: RunView) -> str:
    title = "Per-rank heat map"
    if view.rank_ratio is None or not view.rank_ratio.size:
        return section(
            "heatmap", title, none_recorded("No per-rank step times recorded in this run.")
        )
    svg, notes = report_svg.heatmap(view)
    unit = view.rank_unit
    caption = (
        f"Each cell: a rank's {unit} time over the median of all ranks for that {unit} (the "
        f"bucket's median). A rank's {unit} time counts from the {unit}'s start, the first "
        "rank's previous boundary, to this rank's boundary: in a synchronous job every rank "
        "waits for the slowest in the collectives, so the straggler is the rank that reaches the "
        "boundary last. Right: each rank's mean over the fail-slow's steps (or the whole run)."
    )
    parts = [svg, f'<p class="verdict">{escape(notes[0])}</p>']
    parts += [f'<p class="note">{escape(n)}</p>' for n in notes[1:]]
    parts.append(f'<p class="caption">{escape(caption)}</p>')
    return section("heatmap", title, *parts)


# ---- validation, actions, checkpoints -----------------------------------------------------------
def _validation(view: RunView) -> str:
    parts = [diagnosis_card(d) for d in view.diagnoses]
    if not parts:
        parts.append(none_recorded("No diagnoses recorded."))
    parts.append("<h3>Validation rounds</h3>")
    parts.append(
        rounds_table(view.rounds)
        if view.rounds
        else none_recorded("Validation rounds: none recorded (they come from events.jsonl).")
    )
    return section("validation", "Validation evidence", *parts)


def _gain(before: float | None, after: float | None) -> str:
    if not before or not after:
        return ""
    return f"{before / after:.2f}x faster" if after <= before else f"{after / before:.2f}x slower"


def _estimated(a: Action) -> str:
    if a.estimated_s is None:
        return "not recorded" if a.committed is None else "-"
    text = f"{fmt_s(a.estimated_s)}"
    if a.baseline_s:
        text += f" vs {fmt_s(a.baseline_s)} baseline: {_gain(a.baseline_s, a.estimated_s)}"
    if a.overhead_s:
        text += f"; overhead {fmt_s(a.overhead_s)}"
    return escape(text)


def _measured(a: Action, unit: str) -> str:
    if a.before is None or a.after is None:
        return "-"
    (b0, b1, before), (a0, a1, after) = a.before, a.after
    text = f"{fmt_s(before)} ({unit}s {b0}-{b1}) \u2192 {fmt_s(after)} ({unit}s {a0}-{a1})"
    gain = _gain(before, after)
    return escape(text) + (f": <b>{escape(gain)}</b>" if gain else "")


def _effect(a: Action) -> str:
    if a.effect is None:
        return "-" if a.committed else "not recorded" if a.committed is None else "-"
    text = a.effect + (f": {a.effect_detail}" if a.effect_detail else "")
    outcome = a.outcome
    if outcome and outcome.get("measured_s") is not None:
        predicted = outcome.get("predicted_s")
        text += f"; measured {fmt_s(outcome['measured_s'])}"
        text += f" vs {fmt_s(predicted)} predicted" if predicted is not None else ""
        text += f" ({outcome.get('verdict')})"
    elif outcome and outcome.get("verdict") == "not measured":
        why = outcome.get("reason")
        text += "; outcome not measured" + (f": {why}" if why else "")
    if a.drift:
        text += f"; later stopped paying ({fmt_s(a.drift.get('measured_s'))}): {a.drift['then']}"
    tag = "ok" if a.effect == "in effect" and not a.drift else "bad"
    return f'<span class="tag {tag}">{escape(text)}</span>'


def _actions(view: RunView) -> str:
    if not view.actions:
        return section(
            "actions", "Actions", none_recorded("No actions: no plan was applied or reverted.")
        )
    rows, attrs = [], []
    for i, a in enumerate(view.actions, 1):
        committed = {True: "yes", False: "no", None: "not recorded"}[a.committed]
        rows.append([
            str(i), f'<span class="tag {escape(a.action)}">{escape(a.action)}</span>',
            escape(a.strategy), escape(a.what), "-" if a.apply_step is None else str(a.apply_step),
            committed, _effect(a), escape(a.reason), _estimated(a), _measured(a, view.step_unit),
        ])  # fmt: skip
        fields = {
            "action": a.action, "strategy": a.strategy, "apply-step": a.apply_step,
            "estimated": a.estimated_s, "baseline": a.baseline_s, "effect": a.effect,
            "before": a.before[2] if a.before else None, "after": a.after[2] if a.after else None,
        }  # fmt: skip
        attrs.append("".join(
            f' data-{k}="{escape(v if isinstance(v, str) else f"{v:.6g}")}"'
            for k, v in fields.items() if v is not None
        ))  # fmt: skip
    caption = (
        "Effect: what every rank reported running after the apply step (a plan is in effect only "
        "when every rank ran it; one that is not is rolled back), then the step time the "
        "controller measured a few steps later against the plan's prediction. "
        "Estimated: the planner's model - the step time with the plan against the same model's "
        "baseline (it judges a plan by that ratio). Measured: the median step time from the apply "
        "step to the next action, against the steps before it (since the previous action or the "
        "fail-slow's start, at most 20)."
    )
    head = ["#", "action", "strategy", "what", f"apply {view.step_unit}", "committed", "effect",
            "reason", "estimated (model)", "measured"]  # fmt: skip
    return section(
        "actions",
        "Actions",
        table(head, rows, "sortable actions", attrs),
        f'<p class="caption">{escape(caption)}</p>',
    )


def _checkpoints(view: RunView) -> str:
    parts = ["<h3>Hot updates</h3>"]
    if not view.updates:
        where = (
            "no update history (updates.sqlite) in the run directory"
            if view.updates is None
            else "the update history is empty"
        )
        parts.append(none_recorded(f"Hot updates: none recorded ({where})."))
    else:
        rows = [[
            str(u["id"]), escape(str(u["kind"])), escape(u["what"]), escape(str(u["urgency"])),
            escape(when(u.get("submitted_at"))),
            f'<span class="tag">{escape(str(u["outcome"]))}</span>',
            escape(str(u.get("trigger") or "-")),
            escape(_applied(u)),
            escape(" ".join(x for x in (u.get("note") or "", u.get("detail") or "") if x) or "-"),
        ] for u in view.updates]  # fmt: skip
        head = [
            "#",
            "kind",
            "what",
            "urgency",
            "submitted",
            "outcome",
            "trigger",
            "applied",
            "note",
        ]
        parts.append(table(head, rows, "sortable"))
    parts.append("<h3>In-memory snapshots</h3>")
    if not view.snapshots:
        parts.append(
            none_recorded(
                "Snapshots: none recorded (no snapshot directory with committed snapshots)."
            )
        )
    else:
        rows = [[
            str(s["rank"]), "backup held" if s["backup"] else "own", str(s["step"]),
            f"{s['bytes'] / 2**20:.1f} MiB", f"<code>{escape(s['dir'])}</code>",
        ] for s in view.snapshots]  # fmt: skip
        parts.append(table(["rank", "kind", "newest step", "size", "directory"], rows, "sortable"))
    return section("checkpoints", "Checkpoints and updates", *parts)


def _applied(update: dict[str, Any]) -> str:
    if not update.get("applied_at"):
        return "-"
    return f"{when(update['applied_at'])}, step {update.get('applied_step')}"
