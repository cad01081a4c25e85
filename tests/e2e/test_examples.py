"""The FSDP2 and Accelerate examples run as their docstrings say: ``failslow run --controller 4``
around the framework's own launcher (``torchrun``, ``accelerate launch``), unmodified.

Short runs (12 steps): the point is that the command users copy works end to end - the control
plane beside the job, every rank's session started and closed, a clean exit - not mitigation,
which the conformance suites and the demo tests cover.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(tmp_path: Path, launcher: list[str], script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "failslow.cli", "run", "--no-shim", "--controller", "4",
            "--ring-dir", str(tmp_path / "rings"), "--"]  # fmt: skip
    argv += [*launcher, str(EXAMPLES / script), "--steps", "12", *args]
    out = subprocess.run(
        argv,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    log = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, log
    assert "terminate called" not in out.stdout + out.stderr, log
    return out.stdout


@pytest.mark.parametrize("layout", [[], ["--hsdp"]], ids=["fsdp", "hsdp"])
def test_the_fsdp_example_under_torchrun(tmp_path: Path, layout: list[str]) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4"]  # fmt: skip
    stdout = _run(tmp_path, torchrun, "fsdp_train.py", *layout)
    assert "step 0: loss" in stdout and "step 10: loss" in stdout, stdout


def test_the_accelerate_example_under_accelerate_launch(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="needs the Accelerate extra")
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
              "--multi_gpu", "--num_processes", "4", "--num_machines", "1",
              "--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1",
              "--main_process_port", "0"]  # fmt: skip
    stdout = _run(tmp_path, launch, "accelerate_train.py")
    assert "step 0: loss" in stdout and "step 10: loss" in stdout, stdout
