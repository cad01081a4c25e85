"""The layering of DESIGN.md is a checked contract (import-linter; contracts in pyproject.toml).

The first test is the check itself: an upward import anywhere in ``src/failslow`` fails the
suite. The second shows the check can fail: the same contracts over a copy of the package with
one upward import added (the capture layer reaching into the rank runtime) are broken, and the
report names the import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "pyproject.toml"

pytestmark = pytest.mark.timeout(180)


def _lint(pythonpath: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys, importlinter.cli as c; "
        f"sys.exit(c.lint_imports(config_filename={str(CONFIG)!r}, no_cache=True, no_logo=True))"
    )
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_import_contracts_are_kept() -> None:
    result = _lint(ROOT / "src", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    copy = tmp_path / "src"
    shutil.copytree(
        ROOT / "src" / "failslow",
        copy / "failslow",
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    trap = copy / "failslow" / "nccl_hook" / "trap.py"
    trap.write_text(
        trap.read_text() + "\n\ndef _upward():\n    from failslow.runtime import session\n"
    )
    result = _lint(copy, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "failslow.nccl_hook.trap -> failslow.runtime.session" in result.stdout
