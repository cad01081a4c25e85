"""How ``failslow top`` draws a frame of :class:`failslow.observe.top.TopReader` (rich).

One frame: the job (world size, TP/PP/DP layout, hosts, framework, mitigations it supports) and
the controller (state and for how long, diagnoses, newest step); the K slowest ranks by median
iteration time with their ratio to the median of all ranks read (slow ones in red) and their
transients (slowdowns over before they persisted: not fail-slows, issue 47), and the aggregate
line; the last diagnosis, the plan in effect and the last action; rank 0's recent step
times. :func:`watch` redraws it in place (rich ``Live``) until Ctrl-C; on a file or a pipe it
prints one frame after the other instead, as ``top -b`` does.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from failslow.core.control.mitigator import CAPABILITY_OF
from failslow.core.control.store import StoreUnavailable
from failslow.observe.top import MALFORMED, TopReader, malformed

STALE_S = 10.0
"""A rank record older than this is shown in yellow (its publisher writes about once a second)."""


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def printable(text: str) -> str:
    """``text`` with every non-printable character (an escape sequence, a newline) as ``?``:
    whoever can reach the store writes what this shows (shown as text, never as rich markup)."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _few(values: Sequence[Any], limit: int = 16, sep: str = " ") -> str:
    shown = sep.join(str(v) for v in values[:limit])
    return shown if len(values) <= limit else f"{shown} ... ({len(values)} in all)"


def _micro_batches(counts: list[int], weights: list[float]) -> str:
    """S2's counts per DP replica: all of them for a few replicas, else those off the usual."""
    text = "S2 micro-batches per DP replica: "
    if len(counts) <= 16:
        return text + f"{_few(counts)} (loss weights {_few([f'{w:.2f}' for w in weights])})"
    usual = collections.Counter(counts).most_common(1)[0][0]
    off = [(r, c, w) for r, (c, w) in enumerate(zip(counts, weights, strict=False)) if c != usual]
    shown = [f"replica {r}: {c} (weight {w:.2f})" for r, c, w in off]
    return text + f"{usual} each of {len(counts)}, except " + _few(shown, 8, ", ")


def describe_plan(plan: dict[str, Any] | None) -> str:
    """The plan in effect in one line (None: the job's own split)."""
    if not plan:
        return "none: the job's own even split"
    kind = plan.get("type")
    if kind == "MicroBatchPlan":
        return _micro_batches(plan.get("counts") or [], plan.get("weights") or [])
    if kind == "TopologyPlan":
        moves = plan.get("moves") or []
        shown = ", ".join(f"role {m['role']} {m['src_host']}->{m['dst_host']}" for m in moves[:6])
        more = f", ... ({len(moves)} in all)" if len(moves) > 6 else ""
        text = f"S3 new placement on {len(set(plan.get('hosts') or []))} hosts"
        text += f", {len(moves)} roles moved" + (f": {shown}{more}" if moves else "")
        return text + (f" ({plan['reason']})" if plan.get("reason") else "")
    if kind == "RestartPlan":
        return f"S4 restart without {', '.join(plan.get('evict') or []) or 'no host'}"
    if kind == "RerouteOrReconfigure":
        return f"{plan.get('choice')}: DP {plan.get('dp')} x PP {plan.get('pp')}"
    return str(kind)


def _job_line(job: dict[str, Any] | None) -> str:
    if not job:
        return "no job record yet (failslow/job: rank 0 writes it)"
    parts = [f"{job.get('world_size')} ranks"]
    if "tp" in job:
        parts += [f"TP {job['tp']} PP {job['pp']} DP {job['dp']}", f"{job['hosts']} hosts"]
    if job.get("framework"):
        parts.append(str(job["framework"]))
    supported = [s for s, cap in CAPABILITY_OF.items() if job["capabilities"].get(cap) == ""]
    parts.append(f"mitigations {' '.join(supported) or 'none'}")
    return ", ".join(parts)


def _control_line(status: dict[str, Any] | None, diagnoses: int, now: float) -> str:
    if not status:
        return "no control-plane status yet (failslow/status)"
    since = status.get("since")
    text = f"{status.get('state')} for {duration(now - since if since else None)}"
    text += f", {diagnoses} diagnos{'is' if diagnoses == 1 else 'es'}"
    if status.get("step") is not None:
        text += f", step {status['step']} ({secs(status.get('step_s'))})"
    return text


def _diagnosis_line(last: dict[str, Any] | None, now: float) -> str:
    if not last:
        return "none yet"
    parts = [str(last.get("kind"))]
    if last.get("wall"):
        parts[0] += f" ({duration(now - last['wall'])} ago)"
    ranks = last.get("slow_ranks") or []
    links = last.get("slow_links") or []
    if ranks:
        parts.append("ranks " + _few([f"{r}(x{s:.2f})" for r, s in ranks], 8))
    if links:
        parts.append("links " + _few([f"{a}-{b}(x{s:.2f})" for a, b, s in links], 8))
    return ", ".join(parts)


def _action_line(action: dict[str, Any] | None) -> str:
    if not action:
        return "none yet"
    text = f"{action.get('action')} {action.get('strategy')}"
    if action.get("apply_step") is not None:
        text += f" at step {action['apply_step']}"
    text += ", committed" if action.get("committed") else ", not committed"
    if action.get("effect"):
        text += f", {action['effect']}"
        if action.get("effect_detail"):
            text += f" ({action['effect_detail']})"
    if action.get("measured_s") is not None:
        predicted = action.get("predicted_s")
        text += f", measured {action['measured_s']:.3f} s/step"
        text += f" vs {predicted:.3f} s predicted" if predicted is not None else ""
    return text + (f": {action['reason']}" if action.get("reason") else "")


def _unavailable_line(unavailable: dict[str, str]) -> str:
    return "; ".join(f"{name}: {why}" for name, why in sorted(unavailable.items()))


def _steps_line(steps: list[list[Any]]) -> str:
    if not steps:
        return "none yet"
    recent = steps[-10:]
    return f"{recent[0][0]}-{recent[-1][0]} (s): " + " ".join(f"{t:.3f}" for _s, t in recent)


def _ranks_table(frame: dict[str, Any]) -> RenderableType:
    agg = frame["aggregate"]
    rows = frame["ranks"]
    table = Table(
        title=f"the {len(rows)} slowest ranks by median iteration time", title_justify="left"
    )
    for name in ("rank", "iters", "last", "median", "x median", "slow", "transients", "age"):
        table.add_column(name, justify="left" if name == "slow" else "right")
    for r in rows:
        age = r["age_s"]
        table.add_row(
            str(r["rank"]),
            str(r["iterations"]),
            secs(r["last_s"]),
            secs(r["median_s"]),
            "-" if r["x_median"] is None else f"x{r['x_median']:.2f}",
            "SLOW" if r["slow"] else "",
            str(r["transients"]),
            Text(duration(age), style="yellow" if age is not None and age > STALE_S else ""),
            style="bold red" if r["slow"] else None,
        )
    if agg["sampled"]:
        scope = (
            f"{agg['reporting']} ranks known of {agg['world_size']} (sampled, {agg['read']} read)"
        )
    else:
        scope = f"{agg['reporting']} of {agg['world_size']} ranks reporting"
    line = Text(
        f"{scope}: median {secs(agg['median_s'])}, p99 {secs(agg['p99_s'])}, "
        f"max {secs(agg['max_s'])}, slow {agg['slow']}, transients {agg['transients']}"
    )
    return Group(table, line)


def _grid(rows: list[tuple[str, str]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for label, value in rows:
        grid.add_row(label, Text(printable(value)))
    return grid


def render(frame: dict[str, Any]) -> RenderableType:
    """One frame for the console; a record of another shape is a one-line FailslowError."""
    try:
        return _render(frame)
    except MALFORMED as exc:
        raise malformed(frame.get("store", "?"), exc) from None


def _render(frame: dict[str, Any]) -> RenderableType:
    now = frame.get("wall") or time.time()
    clock = time.strftime("%H:%M:%S", time.localtime(now))
    title = Text(printable(f"failslow top  {frame['store']}  {clock}"))
    parts: list[RenderableType] = [title]
    if frame.get("error"):
        parts.append(Text(printable(f"{frame['error']} (retrying)"), style="bold red"))
    if frame.get("waiting", True):
        parts.append(
            Text("waiting for the job: no failslow/status or failslow/job in the store yet")
        )
        return Group(*parts)
    status = frame["status"] or {}
    diagnoses = frame["diagnoses"]
    parts.append(
        _grid(
            [
                ("job", _job_line(frame["job"])),
                ("control", _control_line(frame["status"], diagnoses["count"], now)),
            ]
        )
    )
    parts.append(_ranks_table(frame))
    parts.append(
        _grid(
            [
                ("diagnosis", _diagnosis_line(diagnoses["last"], now)),
                ("plan", describe_plan(status.get("in_effect"))),
                ("action", _action_line(status.get("last_action"))),
                *(
                    [("unavailable", _unavailable_line(status["unavailable"]))]
                    if status.get("unavailable")
                    else []
                ),
                ("steps", _steps_line(frame["steps"])),
            ]
        )
    )
    return Group(*parts)


def print_frame(frame: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(render(frame))


def _next(
    reader: TopReader, reopen: Callable[[], None], last: dict[str, Any] | None, broken: bool
) -> tuple[dict[str, Any], bool]:
    """The next frame and whether the store is broken (then: the last frame, with the error)."""
    try:
        if broken:
            reopen()
        return reader.frame(), False
    except StoreUnavailable as exc:
        base = last or {"store": reader.url, "waiting": True}
        return {**base, "wall": time.time(), "error": str(exc)}, True


def fitted(frame: dict[str, Any], console: Console) -> RenderableType:
    """The frame with as many rank rows as the terminal has room for (rich's ``Live`` would
    cut the bottom off: the diagnosis and the plan)."""
    if not frame.get("ranks"):
        return render(frame)
    others = len(console.render_lines(render({**frame, "ranks": []}), pad=False))
    room = max(console.size.height - others - 1, 1)
    return render({**frame, "ranks": frame["ranks"][:room]})


def watch(reader: TopReader, interval_s: float, reopen: Callable[[], None]) -> None:
    """Redraw every ``interval_s`` until KeyboardInterrupt; a store that fails is reopened at
    each refresh, the last frame stays up with the error."""
    console = Console()
    frame, broken = _next(reader, reopen, None, False)
    if not console.is_terminal:
        while True:
            console.print(render(frame))
            console.print()
            console.file.flush()
            time.sleep(interval_s)
            frame, broken = _next(reader, reopen, frame, broken)
    with Live(fitted(frame, console), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval_s)
            frame, broken = _next(reader, reopen, frame, broken)
            live.update(fitted(frame, console), refresh=True)
