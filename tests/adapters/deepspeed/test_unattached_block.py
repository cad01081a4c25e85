"""Issue 45, no silent no-ops: under ``failslow run`` a DeepSpeed engine built by the plain
``deepspeed.initialize`` from a config with a ``"failslow"`` block, that nothing attaches
failslow to, gets one line saying what to add - as the Trainer's DeepSpeed path builds it.
One real rank (gloo, world 1) with the ``sitecustomize`` that ``failslow run`` installs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from failslow.adapters.deepspeed.unattached import ADVICE
from failslow.runtime import SITE_DIR

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.multiprocess, pytest.mark.untimed, pytest.mark.timeout(240)]


def test_a_block_no_engine_reads_is_named_once_and_only_then(
    tmp_path: Path, unused_port: int
) -> None:
    path = os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, FAILSLOW_CAPTURE="1", FAILSLOW_RING_DIR=str(tmp_path),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(unused_port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # fmt: skip
    proc = subprocess.run([sys.executable, str(HERE / "_unattached_job.py")], env=env,
                          capture_output=True, text=True, timeout=220)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen.pop("watched") is True, seen  # the sitecustomize wrapped deepspeed.initialize
    assert seen == {
        "plain, with a block": [f"failslow: {ADVICE}"],  # once, though it trained two steps
        "plain, no block": [],
        "plain, then attach": [],
        "failslow.deepspeed.initialize": [],
    }, seen
