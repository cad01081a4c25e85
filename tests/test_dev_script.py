"""`./dev setup`: when it sets the virtualenv up and when it skips, the repo's real script.

CI runs `./dev test` on a clean clone, where the venv and its setup stamp do not exist yet; a
developer's machine always has them. This test runs the real script in a copy of the repo's build
files, with a stand-in interpreter that records what it was asked to do instead of installing
gigabytes, so the first run on a clean machine is tested on every machine.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# `python -m venv DIR` makes DIR/bin/python and DIR/bin/failslow, both logging their arguments
FAKE_PY = """#!/usr/bin/env bash
log={log}
echo "python $*" >> "$log"
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin"
  for tool in python failslow; do
    printf '#!/usr/bin/env bash\\necho "%s $*" >> %s\\n' "$tool" "$log" > "$3/bin/$tool"
    chmod +x "$3/bin/$tool"
  done
fi
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """The script with the files its stamp is compared against: pyproject, setup.py, a C source."""
    repo = tmp_path / "repo"
    (repo / "src" / "pkg").mkdir(parents=True)
    for name in ("dev", "pyproject.toml", "setup.py"):
        shutil.copy2(REPO / name, repo / name)
    (repo / "src" / "pkg" / "kernel.c").write_text("int f(void) { return 0; }\n")
    return repo


def _setup(repo: Path, tmp_path: Path) -> list[str]:
    """Run `./dev setup test` once; return the commands it ran through the venv's tools."""
    log = tmp_path / "calls.log"
    log.write_text("")
    fake = tmp_path / "python3.11"
    _executable(fake, FAKE_PY.format(log=log))
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "FAILSLOW_VENV": str(tmp_path / "venv"),
        # the test is about the venv, not the Debian packages
        "FAILSLOW_SKIP_REDIS": "1",
        "FAILSLOW_SKIP_CHROMIUM": "1",
    }
    done = subprocess.run(
        ["bash", str(repo / "dev"), "setup", "test"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, f"./dev setup test failed: {done.stderr.strip()}"
    return log.read_text().splitlines()


def _installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("python -m pip install")]


def test_a_fresh_venv_is_set_up_then_left_alone_until_a_native_source_changes(repo_copy, tmp_path):
    first = _setup(repo_copy, tmp_path)
    assert first[0].startswith("python -m venv"), first
    assert any("-e .[" in c for c in _installs(first)), first
    assert first[-1] == "failslow build-hook", "the hook is built after the install"

    again = _setup(repo_copy, tmp_path)
    assert _installs(again) == [], "nothing changed: no install"
    assert again == ["failslow build-hook"]

    # a native source newer than the stamp means the extension must be rebuilt
    later = time.time() + 5
    os.utime(repo_copy / "src" / "pkg" / "kernel.c", (later, later))
    rebuilt = _setup(repo_copy, tmp_path)
    assert any("-e .[" in c for c in _installs(rebuilt)), rebuilt
