"""The FSDP2, Accelerate and Hugging Face Trainer examples run as their docstrings say:
``failslow run --controller 4`` around the framework's own launcher (``torchrun``, ``accelerate
launch``), unmodified.

Short runs (12 steps): the point is that the command users copy works end to end - the control
plane beside the job, every rank's session started and closed, a clean exit - not mitigation,
which the conformance suites and the demo tests cover. One longer FSDP run evaluates every 25
steps, as training loops do: its eval steps must be found by the calls they make (tracking v2,
:mod:`failslow.core.tracking.special`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(tmp_path: Path, launcher: list[str], script: str, *args: str, steps: int = 12) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "failslow.cli", "run", "--no-shim", "--controller", "4",
            "--ring-dir", str(tmp_path / "rings"), "--"]  # fmt: skip
    argv += [*launcher, str(EXAMPLES / script), "--steps", str(steps), *args]
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


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "4"]  # fmt: skip


@pytest.mark.parametrize("layout", [[], ["--hsdp"]], ids=["fsdp", "hsdp"])
def test_the_fsdp_example_under_torchrun(tmp_path: Path, layout: list[str]) -> None:
    stdout = _run(tmp_path, TORCHRUN, "fsdp_train.py", *layout)
    assert "step 0: loss" in stdout and "step 10: loss" in stdout, stdout


def test_the_fsdp_examples_eval_steps_are_found_by_the_calls_they_make(tmp_path: Path) -> None:
    """120 steps with an eval after every 25th (64 forward batches per rank and a loss
    all-reduce: ~1.5-2x a step on an idle machine). ``failslow export`` + ``analyze`` of the
    run's rings count one more call in exactly the iterations that evaluated - what the node's
    analyzer feeds its detector, which leaves such steps out.

    Whether an alarm is raised is not asserted: beside other load (CI's), the job's own step
    time really changes - CPU contention is a fail-slow - and the detector rightly reports it
    (one run beside a 2-process CPU hog had three onsets; idle runs had none)."""
    stdout = _run(tmp_path, TORCHRUN, "fsdp_train.py", "--eval-every", "25", steps=120)
    evals = [24, 49, 74, 99]  # the iteration between step S's marker and S+1's holds eval S
    assert all(f"eval after step {s}: loss" in stdout for s in evals), stdout

    trace = tmp_path / "trace.jsonl"
    cli = [sys.executable, "-m", "failslow.cli"]
    subprocess.run([*cli, "export", str(tmp_path / "rings"), "-o", str(trace)], check=True,
                   timeout=120)  # fmt: skip
    from failslow.analyze import job_steps
    from failslow.traceio import read_trace

    times, period, calls = job_steps(read_trace(trace))
    assert calls is not None and len(times) == 119, (len(times), calls)
    usual = int(np.bincount(calls).argmax())
    assert usual == period, (usual, period)
    assert np.flatnonzero(calls != usual).tolist() == evals, _odd_iterations(trace, evals)
    assert (calls[evals] == usual + 1).all(), calls.tolist()  # the eval loss's all-reduce

    out = subprocess.run(
        [*cli, "analyze", str(trace), "--json"], check=True, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    analysis = json.loads(out.stdout)[str(trace)]
    assert analysis["iterations"] == 119 and analysis["period_calls"] == usual, analysis
    # an eval step is left out unless the iteration after it is slow as well (then it is fed:
    # an onset may begin in one)
    assert analysis["special_steps"] <= min(len(evals), analysis["left_out"]), analysis


def _odd_iterations(trace: Path, evals: list[int]) -> str:
    """Every rank's iterations whose call count is not the usual one and is not an eval, each
    with the ops and start times of its records: what a failure needs to be read (once in a
    suite run beside load, iteration 87 of the lowest rank was odd and nothing else was kept)."""
    from failslow.core.tracking.iteration import iteration_times
    from failslow.traceio import read_trace

    lines = []
    for rank, records in sorted(read_trace(trace).records_by_rank.items()):
        result = iteration_times(records)
        assert result.calls is not None
        usual = int(np.bincount(result.calls).argmax())
        odd = [i for i in np.flatnonzero(result.calls != usual).tolist() if i not in evals]
        lines.append(f"rank {rank}: {len(result.calls)} iterations, usual {usual} calls, "
                     f"odd {odd}: {result.calls[odd].tolist()}")  # fmt: skip
        for i in odd[:3]:
            first = result.end_ns[i - 1] if i > 0 else records["t_start_ns"].min()
            inside = records[(records["t_start_ns"] >= first)
                             & (records["t_start_ns"] <= result.end_ns[i])]  # fmt: skip
            ops = [(int(r["op"]), int(r["nbytes"]), int(r["t_start_ns"] - first)) for r in inside]
            lines.append(f"  iteration {i}: {ops}")
    return "\n".join(lines)


def test_the_accelerate_example_under_accelerate_launch(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="needs the Accelerate extra")
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
              "--multi_gpu", "--num_processes", "4", "--num_machines", "1",
              "--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1",
              "--main_process_port", "0"]  # fmt: skip
    stdout = _run(tmp_path, launch, "accelerate_train.py")
    assert "step 0: loss" in stdout and "step 10: loss" in stdout, stdout


def test_the_trainer_example_under_torchrun(tmp_path: Path) -> None:
    """The Trainer example: ``failslow run --controller 4 -- torchrun ...``, unmodified."""
    pytest.importorskip("transformers", reason="needs the transformers extra")
    stdout = _run(tmp_path, TORCHRUN, "trainer_train.py", "--out", str(tmp_path / "out"))
    assert "step 10: loss" in stdout, stdout


def test_the_lightning_example_under_torchrun(tmp_path: Path) -> None:
    """The Lightning example: ``failslow run --controller 4 -- torchrun ...``, unmodified."""
    pytest.importorskip("lightning", reason="needs the lightning extra")
    stdout = _run(tmp_path, TORCHRUN, "lightning_train.py", steps=30)
    assert "step 30: loss" in stdout, stdout
