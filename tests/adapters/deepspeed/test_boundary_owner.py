"""Issue 45, no silent no-ops: a DeepSpeed engine whose training loop sets the accumulation
boundary itself - Accelerate's DeepSpeed wrapper does before every backward, under the Hugging
Face Trainer and ``accelerator.backward`` - cannot run a replica's own micro-batch count, so
the adapter refuses micro-batch plans from that loop's first backward on, with the reason (the
rank's prepare is what the plan channel sends back; the mitigator then disables S2 with it,
tests/core/control). The loop DeepSpeed's tutorials teach keeps them. One real rank each (gloo,
world 1), real Accelerate and DeepSpeed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.multiprocess, pytest.mark.untimed, pytest.mark.timeout(240)]


def test_a_loop_that_sets_the_boundary_itself_gets_micro_batch_plans_refused(
    tmp_path: Path, unused_port: int
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAILSLOW_", "ACCELERATE_"))}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(unused_port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               FAILSLOW_RING_DIR=str(tmp_path))  # fmt: skip
    proc = subprocess.run([sys.executable, str(HERE / "_boundary_job.py")], env=env,
                          capture_output=True, text=True, timeout=220)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    accelerate, deepspeed = seen["accelerate"], seen["deepspeed"]
    assert accelerate["before"] == "prepared", accelerate  # nothing called it yet
    assert accelerate["after"] == (
        "refused: microbatch_plans is not supported here: the training loop sets DeepSpeed's "
        "gradient accumulation boundary itself (first from accelerate.utils.deepspeed; "
        "Accelerate's DeepSpeed wrapper does before every backward, under the Hugging Face "
        "Trainer and accelerator.backward), so a plan cannot change how many micro-batches "
        "this replica runs per step"
    ), accelerate
    assert accelerate["restored"] == "True", accelerate  # close() gave the engine its method
    assert deepspeed["after"] == "prepared", deepspeed  # failslow sets the boundary: kept
    # bad input: one line naming what was passed (it was an AttributeError deep inside)
    assert deepspeed["not an engine"] == (
        "failslow.deepspeed.attach expects the DeepSpeed engine deepspeed.initialize returns "
        "(with Accelerate, the model prepared under a DeepSpeed plugin); got Linear"
    ), deepspeed
