"""The simulation's part of ``failslow report``: a ``failslow simulate --out DIR`` directory.

The simulator (:mod:`failslow.sim`) replays a scenario - the fail-slows and fail-stops of
greyhound 7.5, odyssey's or a 16k-GPU cluster's - under several policies; its directory holds
``results.json`` (per policy: steps, ratio to no mitigation and to the hindsight oracle, lost
steps, pauses) and ``actions.json`` (per policy: each action's simulated time and label). The
report shows the policies as a table and bars, and the actions as one lane per policy over the
scenario's fail-slows (shaded when the directory's name names a shipped scenario).
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING, Any

from failslow.observe.report_style import legend, none_recorded, section, table
from failslow.observe.report_svg import (
    COLORS,
    LEFT,
    PLOT_W,
    WIDTH,
    Scale,
    nice_max,
    nice_ticks,
    tick_label,
)

if TYPE_CHECKING:
    from failslow.observe.report_records import RunView


def simulation_sections(view: RunView) -> list[str]:
    return [_policies(view), _sim_actions(view)]


def _policies(view: RunView) -> str:
    results = view.sim_results or []
    if not results:
        return section("policies", "Policies", none_recorded("results.json lists no policy."))
    cols = [("steps", "steps", "{:g}"), ("steps_per_min", "steps/min", "{:.2f}"),
            ("vs_none", "vs none", "{:.3f}x"), ("vs_oracle", "vs oracle", "{:.3f}"),
            ("lost_steps", "lost steps", "{:g}"),
            ("paused_s", "paused (s)", "{:.0f}"), ("actions", "actions", "{:g}"),
            ("wall_s", "sim wall (s)", "{:.2f}")]  # fmt: skip
    rows = [
        [escape(r["policy"])] + [_num(r.get(key), spec) for key, _, spec in cols] for r in results
    ]
    attrs = [f' data-policy="{escape(r["policy"])}"' for r in results]
    return section(
        "policies", "Policies",
        table(["policy", *(c[1] for c in cols)], rows, "sortable policies", attrs),
        policy_bars(results),
    )  # fmt: skip


def _num(value: Any, spec: str) -> str:
    return spec.format(value) if isinstance(value, (int, float)) else escape(str(value or "-"))


def _sim_actions(view: RunView) -> str:
    actions = view.sim_actions or {}
    if not any(actions.values()):
        return section("actions", "Actions", none_recorded("No actions recorded (actions.json)."))
    items = [("bar", COLORS["apply"], "plan applied (S2, S3, S4, ...)"),
             ("bar", COLORS["revert"], "plan reverted")]  # fmt: skip
    if view.sim_scenario is not None:
        items += [
            ("box", COLORS["onset"], "GPU fail-slow"),
            ("box", COLORS["injected"], "link fail-slow"),
            ("bar", "#4b5563", "fail-stop"),
        ]
    parts = [legend(items), action_lanes(actions, view.sim_scenario)]
    for policy, rows in actions.items():
        if rows:
            cells = [[f"{t / 60:.2f}", escape(label)] for t, label in rows[:500]]
            more = f" (first 500 of {len(rows)})" if len(rows) > 500 else ""
            parts.append(
                f"<details><summary>{escape(policy)}: {len(rows)} actions{more}</summary>"
                + table(["time (min)", "action"], cells, "sortable")
                + "</details>"
            )
    return section("actions", "Actions", *parts)


def policy_bars(results: list[dict[str, Any]]) -> str:
    """Steps each policy completed (horizontal bars), labelled with the gain over ``none``."""
    row_h, top = 30, 10
    hi = max((float(r.get("steps", 0)) for r in results), default=1.0) or 1.0
    x = Scale(0, nice_max(hi), LEFT + 40, LEFT + PLOT_W - 160)  # room for the bar's label
    bottom = top + row_h * len(results)
    svg = [f'<svg id="policies-chart" viewBox="0 0 {WIDTH} {bottom + 48}" role="img">']
    for i, r in enumerate(results):
        ry = top + i * row_h
        steps = float(r.get("steps", 0))
        gain = r.get("vs_none")
        svg.append(
            f'<text x="{LEFT + 32}" y="{ry + 19}" text-anchor="end">'
            f"{escape(str(r['policy']))}</text>"
            f'<rect x="{x(0):.1f}" y="{ry + 4}" width="{x(steps) - x(0):.1f}" height="{row_h - 8}" '
            f'fill="{COLORS["apply"]}" fill-opacity="0.8"><title>{escape(str(r["policy"]))}: '
            f"{steps:g} steps</title></rect>"
            f'<text x="{x(steps) + 6:.1f}" y="{ry + 19}">{steps:g} steps'
            + (f" ({float(gain):.3f}x none)" if isinstance(gain, (int, float)) else "")
            + "</text>"
        )
    svg += _scaled_axis(x, bottom, "steps completed")
    svg.append("</svg>")
    return "\n".join(svg)


def _scaled_axis(x: Scale, y_px: float, title: str) -> list[str]:
    out = [f'<line x1="{x.px0}" x2="{x.px1}" y1="{y_px}" y2="{y_px}" class="axis"/>']
    for t in nice_ticks(x.lo, x.hi, 8):
        out.append(
            f'<text x="{x(t):.1f}" y="{y_px + 16}" text-anchor="middle">{tick_label(t)}</text>'
        )
    out.append(
        f'<text x="{(x.px0 + x.px1) / 2}" y="{y_px + 36}" text-anchor="middle" class="title">'
        f"{escape(title)}</text>"
    )
    return out


def action_lanes(actions: dict[str, list[tuple[float, str]]], scenario: Any) -> str:
    """One lane per policy, a tick per action over simulated minutes; the scenario's fail-slows
    shaded (orange GPU, red link) and fail-stops as grey lines when the scenario is known."""
    lanes = list(actions)
    times = [t for rows in actions.values() for t, _ in rows]
    end = max([scenario.duration_s if scenario is not None else 60.0, *times])
    row_h, top = 26, 10
    bottom = top + row_h * max(len(lanes), 1)
    x = Scale(0, end / 60, LEFT + 40, LEFT + PLOT_W)
    svg = [f'<svg id="actions-chart" viewBox="0 0 {WIDTH} {bottom + 48}" role="img">']
    for event in getattr(scenario, "events", ()):
        if hasattr(event, "start_s"):
            color = COLORS["injected"] if getattr(event, "link", None) else COLORS["onset"]
            a, b = x(event.start_s / 60), x(event.end_s / 60)
            svg.append(
                f'<rect x="{a:.1f}" y="{top}" width="{max(b - a, 1):.1f}" height="{bottom - top}" '
                f'fill="{color}" fill-opacity="0.14"><title>{escape(event.label or "fail-slow")}: '
                f"{event.start_s / 60:.1f}-{event.end_s / 60:.1f} min</title></rect>"
            )
        elif hasattr(event, "time_s"):
            px = x(event.time_s / 60)
            svg.append(
                f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{top}" y2="{bottom}" stroke="#4b5563" '
                'stroke-opacity="0.4"/>'
            )
    for i, policy in enumerate(lanes):
        ry = top + i * row_h
        svg.append(
            f'<text x="{LEFT + 32}" y="{ry + 17}" text-anchor="end">{escape(policy)}</text>'
            f'<line x1="{x.px0}" x2="{x.px1}" y1="{ry + row_h / 2}" y2="{ry + row_h / 2}" '
            'class="grid"/>'
        )
        for t, label in actions[policy]:
            color = COLORS["revert"] if label.startswith("revert") else COLORS["apply"]
            svg.append(
                f'<rect x="{x(t / 60) - 1.5:.1f}" y="{ry + 5}" width="3" height="{row_h - 10}" '
                f'fill="{color}"><title>{escape(policy)}: {escape(label)} at {t / 60:.1f} min'
                "</title></rect>"
            )
    svg += _scaled_axis(x, bottom, "simulated time (min)")
    svg.append("</svg>")
    return "\n".join(svg)
