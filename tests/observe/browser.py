"""Render an HTML file in headless Chromium: its console, its DOM after scripts, a screenshot.

For tests of ``failslow report`` (and the demo's end-to-end test): :func:`render_in_chromium`
runs ``chromium --headless`` twice on a ``file://`` URL - once with ``--dump-dom`` (the DOM
after every script ran, on stdout; every console message, a ``console.error`` or an uncaught
exception, on stderr as a line containing ``:INFO:CONSOLE``), once with ``--screenshot`` - each
with its own empty profile directory and nothing that reaches the network. Without a
``chromium`` (or ``chromium-browser``, ``google-chrome``) on PATH the calling test fails saying
what to install (``./dev test`` installs it), unless ``FAILSLOW_SKIP_CHROMIUM=1`` skips it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
)
TIMEOUT_S = 120


def find_chromium() -> str:
    """The browser's path; fails the calling test when there is none (skips it with
    ``FAILSLOW_SKIP_CHROMIUM=1``)."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    why = (
        "no headless browser on PATH (looked for chromium, chromium-browser, google-chrome): "
        "apt-get install -y chromium (./dev test does), or set FAILSLOW_SKIP_CHROMIUM=1"
    )
    if os.environ.get("FAILSLOW_SKIP_CHROMIUM") == "1":
        pytest.skip(why)
    pytest.fail(why)


def _run(browser: str, args: list[str], url: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="failslow-chromium-") as profile:
        return subprocess.run(
            [browser, *FLAGS, f"--user-data-dir={profile}", *args, url],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )


def console_lines(stderr: str) -> list[str]:
    """The browser's console messages among its log lines."""
    return [line for line in stderr.splitlines() if ":INFO:CONSOLE" in line]


def render_in_chromium(
    html_path: Path, out_dir: Path, *, window: tuple[int, int] = (1280, 2400)
) -> tuple[list[str], str, Path]:
    """(console lines, the DOM after scripts ran, the screenshot's path in ``out_dir``) of
    ``html_path`` rendered in headless Chromium at ``window`` (width, height)."""
    browser = find_chromium()
    url = Path(html_path).absolute().as_uri()
    dumped = _run(browser, ["--dump-dom"], url)
    assert dumped.returncode == 0, f"chromium --dump-dom failed: {dumped.stderr[-2000:]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    shot = out_dir / f"{Path(html_path).stem}.png"
    taken = _run(browser, [f"--screenshot={shot}", f"--window-size={window[0]},{window[1]}"], url)
    assert taken.returncode == 0 and shot.is_file(), (
        f"chromium --screenshot failed: {taken.stderr[-2000:]}"
    )
    return console_lines(dumped.stderr) + console_lines(taken.stderr), dumped.stdout, shot


def keep_artifact(*paths: Path) -> None:
    """Copy ``paths`` to ``$FAILSLOW_TEST_ARTIFACTS`` (``./dev test`` sets it to
    ``test-artifacts/``), where a CI run keeps them; nothing when it is unset."""
    artifacts = os.environ.get("FAILSLOW_TEST_ARTIFACTS")
    if not artifacts:
        return
    Path(artifacts).mkdir(parents=True, exist_ok=True)
    for path in paths:
        shutil.copy2(path, Path(artifacts) / path.name)
