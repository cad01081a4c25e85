"""What several end-to-end modules share: the DeepSpeed demo job run once without faults."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from failslow.demo.rank_launch import COMPARED
from failslow.demo.worker_io import launch_env

REFERENCE_STEPS = 120
"""The DeepSpeed jobs compared with the reference end after fewer steps than this (by their
stop file or their step count); one reference run of the same job without faults serves them
all."""


@pytest.fixture(scope="session")
def deepspeed_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Any]:
    """The parameters of the DeepSpeed demo job (4 ranks, ZeRO-1, micro-batches of 32, the
    :data:`COMPARED` settings) run without faults, after a given number of steps: one run,
    started by the first test that asks, saves rank 0's parameters after every step
    (``$FAILSLOW_DEMO_SAVE_EVERY_STEP``); a job longer than :data:`REFERENCE_STEPS` gets a
    longer run. The job's math does not depend on how long it runs, where its ranks' hosts are
    or how they were launched (``failslow run --nproc-per-node``, torchrun, several nodes), so
    step N of a long run is the end of any N-step one."""
    runs: list[tuple[int, Path]] = []

    def parameters(steps: int) -> Any:
        for have, out in runs:
            if steps <= have:
                return np.load(out / f"parameters-step{steps}.npz")
        tmp = tmp_path_factory.mktemp("reference")
        n = max(steps, REFERENCE_STEPS)
        out = tmp / "out"
        out.mkdir()
        env = launch_env(
            out, n, FAILSLOW_DEMO_CONFIG=json.dumps(COMPARED), FAILSLOW_DEMO_MICRO_BATCH_SIZE="32",
            FAILSLOW_DEMO_SAVE_EVERY_STEP="1",
        )  # fmt: skip
        command = [
            sys.executable, "-m", "failslow.cli", "run", "--no-shim", "--no-warm",
            "--ring-dir", str(tmp / "rings"), "--state-dir", str(tmp / "state"),
            "--snapshot-dir", str(tmp / "snapshots"), "--nproc-per-node", "4",
            "--preload", "deepspeed", "--", "-m", "failslow.demo.ds_worker",
        ]  # fmt: skip
        log = tmp / "reference.log"
        with log.open("w") as f:
            done = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=900, check=False)  # fmt: skip
        assert done.returncode == 0, log.read_text()[-3000:]
        final, last = np.load(out / "parameters.npz"), np.load(out / f"parameters-step{n}.npz")
        assert all(np.array_equal(final[k], last[k]) for k in final.files)
        runs.append((n, out))
        return np.load(out / f"parameters-step{steps}.npz")

    return parameters
