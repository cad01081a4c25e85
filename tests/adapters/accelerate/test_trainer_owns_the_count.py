"""Issue 45, no silent no-ops: a Hugging Face ``Trainer`` job with
``failslow.accelerate.attach(trainer.accelerator)`` - what a user tried first. The Trainer
accumulates its own micro-batches and sets Accelerate's ``sync_gradients`` for each, so no
micro-batch plan can take effect; before, the slow rank was diagnosed and nothing was planned,
with nothing said. Now every rank refuses micro-batch plans with that reason from the first
micro-batch, rank 0 says it once, and the job record the controller plans from carries it (so
the controller journals S2 as unavailable, with the reason). Real transformers, Accelerate
and DDP over gloo, under ``failslow run --controller 2 -- torchrun``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the transformers extra")

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.multiprocess, pytest.mark.untimed, pytest.mark.timeout(300)]

REASON = (
    "the training loop sets Accelerate's sync_gradients itself (first from transformers.trainer; "
    "the Hugging Face Trainer accumulates its own micro-batches and decides each one's sync, "
    "without accelerator.accumulate), so a plan cannot change how many micro-batches this "
    "replica runs per step"
)


def test_the_trainers_own_accumulation_refuses_micro_batch_plans_and_says_so(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAILSLOW_", "ACCELERATE_"))}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "failslow.cli", "run", "--no-shim", "--controller", "2",
            "--ring-dir", str(tmp_path / "rings"), "--", sys.executable, "-m",
            "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(HERE / "_trainer_job.py"), str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=280)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    seen = json.loads(line.removeprefix("RESULT "))
    assert seen["prepare"] == f"refused: microbatch_plans is not supported here: {REASON}", seen
    assert seen["job record"] == REASON, seen  # published again by rank 0
    # said once on rank 0, though every micro-batch of 20 steps set it
    assert seen["warnings"] == [
        f"failslow: micro-batch plans (S2) cannot take effect in this job: {REASON}"
    ], seen
