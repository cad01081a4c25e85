"""The report of the demo fixture in a real headless Chromium: no console message, the inline
script ran to its end, every section is there, and a screenshot (kept as a test artifact: in
pytest's tmp dir and, when ``FAILSLOW_TEST_ARTIFACTS`` names a directory, copied there)."""

from __future__ import annotations

from pathlib import Path

from browser import keep_artifact, render_in_chromium

from failslow.observe.report import write_report

DEMO = Path(__file__).parents[1] / "data" / "report" / "deepspeed_demo"
HEADINGS = (
    "Phases",
    "Step-time timeline",
    "Per-rank heat map",
    "Validation evidence",
    "Actions",
    "Checkpoints and updates",
)
PNG = b"\x89PNG\r\n\x1a\n"


def test_the_demo_report_renders_in_chromium_without_console_errors(tmp_path: Path) -> None:
    report = write_report(DEMO, tmp_path / "deepspeed-demo-report.html")
    console, dom, shot = render_in_chromium(report, tmp_path / "shots", window=(1280, 4400))

    assert console == [], "console messages:\n" + "\n".join(console)
    assert 'data-rendered="1"' in dom, "the inline script did not run to its end"
    for heading in HEADINGS:
        assert f">{heading}</h" in dom, heading
    assert 'id="timeline"' in dom and 'id="heatmap"' in dom
    data = shot.read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000, f"{shot}: {len(data)} bytes"

    keep_artifact(shot, report)
