"""The validation evidence of ``failslow report``: each diagnosis and every validation round.

greyhound 4.3 validates a suspected fail-slow by pausing the job and timing a GEMM on every
suspect rank and a pass over the links; a diagnosis records what that found (``kind``,
``slow_ranks``, ``slow_links``) and why (``evidence``: the profiling suspects, the onsets that
triggered it, the GEMM and link times, the pause). Here each becomes a readable table; keys
this module does not know are shown as compact JSON.
"""

from __future__ import annotations

import json
import statistics
from html import escape
from typing import TYPE_CHECKING, Any

from failslow.observe.report_records import when
from failslow.observe.report_style import table
from failslow.observe.report_svg import fmt_s

if TYPE_CHECKING:
    from failslow.observe.report_records import Diagnosed, Round

SUSPECT_FIELDS = (
    ("lateness_s", "lateness", fmt_s),
    ("busy_fraction", "busy", lambda v: f"{v:.0%}"),
    ("peer_busy_fraction", "peers busy", lambda v: f"{v:.0%}"),
    ("lead_share", "lead share", lambda v: f"{v:.0%}"),
    ("last_fraction", "last to arrive", lambda v: f"{v:.0%}"),
    ("iteration_s", "iteration", fmt_s),
)


def diagnosis_card(d: Diagnosed) -> str:
    at = f"{d.step}" if d.step is not None else "unknown"
    stamp = f" ({when(d.wall)})" if d.wall else ""
    ranks = ", ".join(f"<b>rank {r}</b> {s:.2f}x" for r, s in d.slow_ranks) or "none"
    links = ", ".join(f"<b>link {a}-{b}</b> {s:.2f}x" for a, b, s in d.slow_links) or "none"
    rows = [[escape(key), _value(key, d.evidence[key])] for key in _ordered(d.evidence)]
    return (
        f'<div class="diagnosis" data-number="{d.number}" data-kind="{escape(d.kind)}">'
        f"<h3>D{d.number}: {escape(d.kind)} fail-slow, at step {at}{escape(stamp)}</h3>"
        f'<p class="verdict">slow ranks: {ranks} &middot; slow links: {links}</p>'
        + (
            table(["evidence", "value"], rows, "evidence")
            if rows
            else "<p>no evidence recorded</p>"
        )
        + "</div>"
    )


def _ordered(evidence: dict[str, Any]) -> list[str]:
    first = ["round", "paused_s", "target", "onsets", "suspects", "gemm_s", "link_s"]
    return [k for k in first if k in evidence] + sorted(k for k in evidence if k not in first)


def _value(key: str, value: Any) -> str:
    try:
        if key == "paused_s":
            return escape(f"{fmt_s(float(value))} (the job paused for the tests)")
        if key == "target" and isinstance(value, dict):
            return escape(", ".join(f"{k} {v}" for k, v in value.items()))
        if key == "onsets" and isinstance(value, list):
            return _onsets(value)
        if key == "suspects" and isinstance(value, list):
            return _suspects(value)
        if key == "gemm_s" and isinstance(value, dict):
            return _per_rank(value)
        if key == "link_s" and isinstance(value, list):
            return _links(value)
        if key == "links_explained_by_slow_ranks" and isinstance(value, list):
            return escape(", ".join(f"{a}-{b}" for a, b in value) or "none")
    except (TypeError, ValueError, KeyError, statistics.StatisticsError):
        pass  # not the shape this module knows: shown as JSON
    if isinstance(value, (int, float, str)) or value is None:
        return escape(str(value))
    text = json.dumps(value, sort_keys=True, default=str)
    return f"<code>{escape(text if len(text) <= 400 else text[:400] + ' ...')}</code>"


def _onsets(onsets: list[dict[str, Any]]) -> str:
    if not onsets:
        return "none (a periodic re-validation)"
    items = []
    for o in onsets:
        before, after = o.get("before_s"), o.get("after_s")
        change = f" ({after / before:.2f}x)" if before and after else ""
        items.append(
            f"rank {o.get('rank')} {o.get('type', 'onset')} at iteration {o.get('iteration')}: "
            f"{fmt_s(before)} \u2192 {fmt_s(after)}{change}"
        )
    return "<br>".join(escape(i) for i in items)


def _suspects(suspects: list[dict[str, Any]]) -> str:
    if not suspects:
        return "none (profiling named no rank; every rank was tested)"
    rows = []
    for s in suspects:
        ev = s.get("evidence") or {}
        rows.append(
            [escape(", ".join(map(str, s.get("ranks", [])))), escape(str(s.get("kind", "-")))]
            + [escape(fmt(ev[k])) if isinstance(ev.get(k), (int, float)) else "-"
               for k, _, fmt in SUSPECT_FIELDS]
        )  # fmt: skip
    return table(["ranks", "kind"] + [label for _, label, _ in SUSPECT_FIELDS], rows, "inner")


def _per_rank(gemm: dict[str, Any]) -> str:
    median = statistics.median(float(v) for v in gemm.values())
    parts = []
    for rank, seconds in sorted(gemm.items(), key=lambda kv: int(kv[0])):
        ratio = float(seconds) / median if median else 1.0
        text = escape(f"rank {rank}: {fmt_s(float(seconds))} ({ratio:.2f}x)")
        parts.append(f'<span class="hot">{text}</span>' if ratio >= 1.5 else text)
    return "GEMM time per rank (x the median): " + " &middot; ".join(parts)


def _links(links: list[list[Any]]) -> str:
    median = statistics.median(float(s) for _, _, s in links)
    parts = []
    for a, b, seconds in links:
        ratio = float(seconds) / median if median else 1.0
        text = escape(f"{a}-{b}: {fmt_s(float(seconds))} ({ratio:.1f}x)")
        parts.append(f'<span class="hot">{text}</span>' if ratio >= 3 else text)
    return "link test time (x the median): " + " &middot; ".join(parts)


def rounds_table(rounds: list[Round]) -> str:
    rows = []
    for i, r in enumerate(rounds, 1):
        result = {True: "healthy", False: "fail-slow confirmed", None: "-"}[r.healthy]
        rows.append([
            str(i), escape(when(r.wall)), "-" if r.step is None else str(r.step), escape(r.trigger),
            escape(", ".join(map(str, r.suspects)) or "none"),
            f'<span class="tag {"ok" if r.healthy else "bad"}">{result}</span>', fmt_s(r.paused_s),
        ])  # fmt: skip
    head = ["#", "time", "step", "trigger", "suspects", "result", "paused"]
    return table(head, rows, "sortable rounds")
