"""The page of ``failslow report`` and its building blocks: the inline stylesheet and script,
sections, tables and legends (:mod:`.report_html`, :mod:`.report_sim`).

The stylesheet and script are Python strings, not package data files, so the page needs nothing
but the wheel's modules. The script is plain ES5 with no dependency: table sorting, the
timeline's hover read-out, and ``document.body.dataset.rendered = "1"`` as its last statement.
"""

from __future__ import annotations

from html import escape

CSS = """
:root { --fg:#111827; --muted:#6b7280; --line:#e5e7eb; --bg:#ffffff; --soft:#f9fafb; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
main { max-width: 1240px; margin: 0 auto; padding: 20px 24px 40px; }
h1 { font-size: 24px; margin: 0 0 2px; }
h2 { font-size: 19px; margin: 30px 0 10px; padding-bottom: 4px;
  border-bottom: 2px solid var(--line); }
h3 { font-size: 15px; margin: 16px 0 6px; }
code { font: 12.5px ui-monospace, "DejaVu Sans Mono", monospace; background: var(--soft);
  padding: 0 3px; border-radius: 3px; }
.sub { color: var(--muted); margin: 0 0 12px; }
.facts { display: grid; grid-template-columns: repeat(auto-fill, minmax(230px, 1fr));
  gap: 6px 18px; margin: 8px 0 14px; }
.facts div { border-left: 3px solid #cbd5e1; padding: 1px 8px; }
.facts dt { color: var(--muted); font-size: 12px; }
.facts dd { margin: 0; font-weight: 600; }
.cards { display: grid; grid-template-columns: repeat(6, 1fr); gap: 10px; margin: 8px 0 4px; }
.card { background: var(--soft); border: 1px solid var(--line);
  border-radius: 8px; padding: 8px 12px; }
.card .v { font-size: 19px; font-weight: 700; }
.card .k { color: var(--muted); font-size: 12px; }
table { border-collapse: collapse; margin: 6px 0 10px; font-variant-numeric: tabular-nums; }
th, td { border-bottom: 1px solid var(--line); padding: 5px 10px;
  text-align: left; vertical-align: top; }
th { background: #f3f4f6; font-weight: 600; font-size: 13px; white-space: nowrap; }
table.sortable th { cursor: pointer; }
table.sortable th:hover { background: #e5e7eb; }
table.inner { margin: 0; font-size: 12.5px; }
table.inner th, table.inner td { padding: 2px 8px; }
table.actions td:nth-child(7) { max-width: 230px; }
table.evidence td:first-child { font-weight: 600; white-space: nowrap; }
.sw { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
.tag { display: inline-block; padding: 0 7px;
  border-radius: 9px; background: #e5e7eb; font-size: 12px; }
.tag.apply { background: #dbeafe; color: #1e40af; }
.tag.revert { background: #ede9fe; color: #5b21b6; }
.tag.replan { background: #dbeafe; color: #1e40af; }
.tag.rollback { background: #fee2e2; color: #991b1b; }
.tag.ok { background: #dcfce7; color: #166534; }
.tag.bad { background: #fee2e2; color: #991b1b; }
.hot { color: #b91c1c; font-weight: 700; }
.none { color: var(--muted); font-style: italic; }
.note { color: #92400e; background: #fffbeb; border: 1px solid #fde68a;
  padding: 6px 10px; border-radius: 6px; }
.caption { color: var(--muted); font-size: 12.5px; margin: 2px 0 8px; max-width: 1100px; }
.diagnosis { border: 1px solid var(--line); border-radius: 8px;
  padding: 2px 14px 6px; margin: 10px 0; }
.verdict { margin: 2px 0 6px; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; font-size: 12.5px; margin: 4px 0 2px; }
.legend i { display: inline-block; width: 18px; height: 10px;
  margin-right: 6px; vertical-align: middle; }
.legend i.line { height: 2px; background: var(--c); }
.legend i.box { background: var(--c); opacity: .3; }
.legend i.bar { width: 3px; height: 14px; background: var(--c); }
.legend i.dash { width: 16px; height: 0; border-top: 2px dashed var(--c); }
.legend i.dot { width: 16px; height: 0; border-top: 2px dotted var(--c); }
.legend i.up, .legend i.down { width: 0; height: 0; border-left: 6px solid transparent;
  border-right: 6px solid transparent; }
.legend i.up { border-bottom: 10px solid var(--c); }
.legend i.down { border-top: 10px solid var(--c); }
svg { width: 100%; height: auto; display: block; font-family: inherit; }
svg text { font-size: 12px; fill: #374151; }
svg .title { font-weight: 600; font-size: 13px; }
svg .axis { stroke: #9ca3af; }
svg .grid { stroke: #eef0f3; }
svg .mark-label { font-weight: 700; font-size: 12px; }
svg .on-dark { fill: #fff; font-size: 11px; font-weight: 600; }
svg .off { font-size: 11px; font-weight: 600; }
svg .strong { font-weight: 700; fill: #b91c1c; }
svg .hover { stroke: #111827; stroke-dasharray: 3 3; }
details { margin: 4px 0; }
summary { cursor: pointer; }
footer { margin-top: 36px; color: var(--muted); font-size: 12px; }
#tip { position: fixed; pointer-events: none; background: #111827; color: #fff; font-size: 12px;
  padding: 3px 8px; border-radius: 4px; }
@media (max-width: 900px) { .cards { grid-template-columns: repeat(3, 1fr); } }
"""

JS = """
(function () {
  "use strict";
  function key(cell) {
    var text = cell.textContent.trim();
    var num = parseFloat(text.replace(/[^0-9.eE+-]/g, ""));
    return /^[-+]?[0-9.]/.test(text) && !isNaN(num) ? num : text.toLowerCase();
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
      th.title = "sort";
      th.addEventListener("click", function () {
        var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
        var dir = th.dataset.dir === "asc" ? -1 : 1;
        th.dataset.dir = dir > 0 ? "asc" : "desc";
        rows.sort(function (a, b) {
          var x = key(a.cells[col]), y = key(b.cells[col]);
          if (typeof x !== typeof y) { x = String(x); y = String(y); }
          return x < y ? -dir : x > y ? dir : 0;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
  var svg = document.getElementById("timeline"), data = document.getElementById("step-data");
  var tip = document.getElementById("tip"), line = document.getElementById("hover-line");
  if (svg && data && tip && line) {
    var times = JSON.parse(data.textContent), d = svg.dataset;
    var first = +d.first, n = +d.n, left = +d.left, plot = +d.plotWidth, width = +d.width;
    var hide = function () { tip.hidden = true; line.setAttribute("visibility", "hidden"); };
    svg.addEventListener("mousemove", function (e) {
      var box = svg.getBoundingClientRect(), vx = (e.clientX - box.left) * width / box.width;
      var i = Math.floor((vx - left) / plot * n);
      if (i < 0 || i >= n || times[i] === null) { hide(); return; }
      var px = left + (i + 0.5) * plot / n;
      line.setAttribute("x1", px); line.setAttribute("x2", px);
      line.setAttribute("visibility", "visible");
      tip.textContent = (d.unit || "step") + " " + (first + i) + ": " + times[i].toFixed(3) + " s";
      tip.style.left = (e.clientX + 12) + "px"; tip.style.top = (e.clientY + 12) + "px";
      tip.hidden = false;
    });
    svg.addEventListener("mouseleave", hide);
  }
})();
document.body.dataset.rendered = "1";
"""


def page(title: str, sections: list[str], footer: str) -> str:
    """The whole document: ``sections`` (HTML) with the stylesheet and the script inline."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body><main>\n"
        + "\n".join(sections)
        + f"\n<footer>{escape(footer)}</footer></main>\n"
        f'<div id="tip" hidden></div>\n<script>{JS}</script>\n</body></html>\n'
    )


def section(anchor: str, title: str, *parts: str) -> str:
    return f'<section id="{anchor}"><h2>{escape(title)}</h2>\n' + "\n".join(parts) + "</section>"


def none_recorded(what: str) -> str:
    return f'<p class="none">{escape(what)}</p>'


def table(
    head: list[str], rows: list[list[str]], cls: str = "", row_attrs: list[str] | None = None
) -> str:
    """A table from already-escaped cells; ``sortable`` tables sort by a header click."""
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    attrs = row_attrs or [""] * len(rows)
    body = "".join(
        f"<tr{a}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>"
        for row, a in zip(rows, attrs, strict=True)
    )
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def legend(items: list[tuple[str, str, str]]) -> str:
    return (
        '<div class="legend">'
        + "".join(
            f'<span><i class="{shape}" style="--c:{color}"></i>{escape(label)}</span>'
            for shape, color, label in items
        )
        + "</div>"
    )
