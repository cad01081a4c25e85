"""``failslow run --controller N -- torchrun ...``: capture, agents, node publisher and
controller all wired by the launcher, an unmodified training script, a real straggler.

The script uses nothing of failslow but its fault injector. From step ``SLOW_FROM`` on, rank 1
is duty-cycled with SIGSTOP/SIGCONT by a forked helper (``failslow.faults.throttle_self``: a
straggler slowed from outside its own code), and
the job trains on until a diagnosis file exists (at most 180 s; every rank stops at the same
step, agreed by a one-float all-reduce per step), so a loaded machine that detects and validates
slowly is waited for rather than outrun. The launcher's embedded controller must print a
diagnosis naming rank 1, kind compute, and leave a ``diagnosis-<n>.json`` beside the rings. The
ranks time the validation GEMM in turns and in fp32 (``FAILSLOW__VALIDATION__*``: CPU ranks on
shared cores; bf16 matmuls on this CPU take seconds and scatter with load). Threshold 2.0, not
greyhound's 1.1: with two ranks on two shared cores a healthy rank's GEMM scatters by up to
~1.5x against its peer; the throttled rank (75% stopped) measures ~3-4x.

Both endings users write are run: with ``destroy_process_group()`` and without it (as DeepSpeed's
tutorials end); either way the job that finished exits 0 with no abort at teardown (issue 13;
the long count beside plain torchrun is ``benchmarks/clean_exit.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(330), pytest.mark.multiprocess, pytest.mark.slow]

TRAIN = (
    textwrap.dedent(
        """\
    import os, sys, time
    import torch, torch.distributed as dist
    from failslow.faults import throttle_self
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    w = torch.randn(256, 256) / 16
    x = torch.randn(64, 256)
    bias = torch.zeros(1024)
    helper, step, started = None, 0, time.time()
    diagnoses = sys.argv[1]
    while True:
        if rank == 1 and step == SLOW_FROM:
            helper = throttle_self(0.75, 0.01)  # 75% of every 10 ms stopped
        for _ in range(10):
            y = torch.tanh(x @ w)
        grad = (y.T @ x) / 64
        dist.all_reduce(grad)
        dist.all_reduce(bias)
        w -= 1e-3 * grad / dist.get_world_size()
        time.sleep(0.01)
        step += 1
        done = step >= STEPS and (time.time() - started > 180 or (
            os.path.isdir(diagnoses) and bool(os.listdir(diagnoses))))
        flag = torch.tensor([1.0 if done else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            break
    if helper:
        helper.stop()
    dist.barrier()
    if sys.argv[2] == "destroy":
        dist.destroy_process_group()
    """
    )
    .replace("STEPS", "200")
    .replace("SLOW_FROM", "130")
)


@pytest.mark.parametrize("ending", ["destroy", "no-destroy"])
def test_run_with_embedded_controller_diagnoses_the_straggler(tmp_path: Path, ending: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ring_dir = tmp_path / "rings"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
    env.update(
        OMP_NUM_THREADS="1",
        FAILSLOW__VALIDATION__GEMM_SERIAL="true",
        FAILSLOW__VALIDATION__GEMM_DTYPES="float32",
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "failslow.cli",
            "run",
            "--no-shim",
            "--controller",
            "2",
            "--threshold",
            "2.0",
            "--ring-dir",
            str(ring_dir),
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(ring_dir / "diagnoses"),
            ending,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, log
    lines = [ln for ln in out.stderr.splitlines() if "failslow run: diagnosis " in ln]
    assert lines, log
    first = json.loads(lines[0].split("diagnosis ", 1)[1])
    assert first["kind"] == "compute" and [r for r, _ in first["slow_ranks"]] == [1], (first, log)
    assert list((ring_dir / "diagnoses").glob("diagnosis-*.json")), log
    # The job finished, so it ends clean (a validation round ran during it): a script that did
    # not destroy its group gets it destroyed at exit, one line per rank saying so.
    assert "terminate called" not in out.stdout + out.stderr, log
    notes = [ln for ln in out.stderr.splitlines() if "destroyed it" in ln]
    assert len(notes) == (0 if ending == "destroy" else 2), log
