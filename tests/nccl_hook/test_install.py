"""install()/auto without a world: ring placement, errors, idempotence, env-driven install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _run(code: str, env: dict[str, str]) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_install_places_ring_and_is_idempotent(tmp_path: Path) -> None:
    code = (
        "import os, failslow.nccl_hook as h\n"
        "from failslow.core.ring import ring_path\n"
        "c = h.install()\n"
        "assert h.install() is c\n"
        "assert c.ring_path == ring_path(os.environ['FAILSLOW_RING_DIR'], 3, os.getpid())\n"
        "assert c.ring_path.exists() and c.writer is not None\n"
        "h.uninstall(); assert h.current() is None\n"
        "try:\n    h.install('/nonexistent-other-dir-but-inactive')\nexcept Exception as e:\n"
        "    raise SystemExit(repr(e))\n"
        "print('ok')\n"
    )
    assert "ok" in _run(code, {"FAILSLOW_RING_DIR": str(tmp_path), "RANK": "3"})


def test_install_without_ring_dir_is_a_clear_error() -> None:
    code = (
        "import failslow.nccl_hook as h\n"
        "try:\n    h.install()\nexcept ValueError as e:\n    print('ERR', e)\n"
    )
    assert "FAILSLOW_RING_DIR" in _run(code, {})


def test_auto_installs_from_env(tmp_path: Path) -> None:
    code = "import failslow.nccl_hook.auto as a; print(a.capture is not None)"
    assert "True" in _run(code, {"FAILSLOW_RING_DIR": str(tmp_path), "FAILSLOW_CAPTURE": "1",
                                  "RANK": "0"})
    assert "False" in _run(code, {"FAILSLOW_RING_DIR": str(tmp_path)})


def test_a_bad_native_hook_setting_is_a_clear_error(tmp_path: Path) -> None:
    code = (
        "import failslow.nccl_hook as h\n"
        "try:\n    h.install()\nexcept ValueError as e:\n    print('ERR', e)\n"
    )
    out = _run(code, {"FAILSLOW_RING_DIR": str(tmp_path), "RANK": "0",
                      "FAILSLOW_NATIVE_HOOK": "yes"})
    assert out.startswith("ERR") and "FAILSLOW_NATIVE_HOOK='yes'" in out and "\n" == out[-1]


def test_build_hook_names_the_built_kernel_and_install_uses_it(tmp_path: Path) -> None:
    """``failslow build-hook`` (run by ./dev setup) leaves the C++ kernel where install()
    finds it; without a compiler on the machine there is nothing to build."""
    from _worlds import require_native_hook

    require_native_hook()
    out = subprocess.run([sys.executable, "-m", "failslow.cli", "build-hook"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_file()
    code = "import failslow.nccl_hook as h\nprint(h.install().native is not None)\n"
    assert "True" in _run(code, {"FAILSLOW_RING_DIR": str(tmp_path), "RANK": "0"})
    assert "False" in _run(code, {"FAILSLOW_RING_DIR": str(tmp_path), "RANK": "0",
                                  "FAILSLOW_NATIVE_HOOK": "0"})
