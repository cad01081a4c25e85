"""Issue 45: S2 inside an unchanged ``trainer.train()`` - the Hugging Face Trainer's own loop,
loader and loss, four DDP ranks over gloo under torchrun, with
``failslow.transformers.attach(trainer)``. Plans are scheduled on every rank
(``session.schedule``), as the plan channel would commit them.

Correctness is equality: attached without a plan, the Trainer trains bitwise the model it
trains without failslow (the re-cut loader hands out its own batches); with plans, within 1e-6
relative - the same samples of every step, the per-item losses summed over other groupings
(fp32 rounding, measured 1.7e-8; the conformance suite's bound). A model whose loss is a mean
per micro-batch gets plans refused with the reason, and so does a run resumed from the
Trainer's own checkpoint (not re-cut yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers", reason="needs the transformers extra")

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.multiprocess, pytest.mark.untimed, pytest.mark.timeout(400)]


def _check_plans(rank: int, plain: dict[str, Any], plans: dict[str, Any]) -> None:
    """``plans`` (the run with the scheduled plans) trained ``plain``'s model within 1e-6,
    reported every plan applied and in effect, and read the planned samples per step (4 per
    count unit)."""
    assert plans["capabilities"]["microbatch_plans"] == "", plans["capabilities"]
    for name, want in plain["parameters"].items():
        want_a = np.asarray(want, dtype=np.float32)
        got = np.asarray(plans["parameters"][name], dtype=np.float32)
        err = float(np.abs(got - want_a).max()) / float(np.abs(want_a).max())
        assert err <= 1e-6, (rank, name, err)
    said = [(o, s, d) for o, s, d in plans["effects"]]
    for step in (2, 5, 12):
        assert ("applied", step, "") in said and ("in effect", step, "") in said, said
    reads = {int(s): n for s, n in plans["reads"].items()}
    for step, c in {4: (5, 5, 2, 4), 5: (6, 6, 1, 3), 6: (6, 6, 1, 3)}.items():
        assert reads[step] == c[rank] * 4, (rank, step, reads)
    assert reads[13] == 16  # the even split again


def test_the_trainer_runs_s2_by_size_and_trains_the_same_model(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAILSLOW_", "ACCELERATE_"))}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", str(HERE / "_size_job.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, seen in enumerate(ranks):
        plain, attached, plans = seen["plain"], seen["attached"], seen["plans"]
        assert plain["global_step"] == attached["global_step"] == plans["global_step"] == 14
        assert attached["capabilities"]["microbatch_plans"] == "", attached["capabilities"]
        for name, want in plain["parameters"].items():  # attached, no plan: bitwise
            assert attached["parameters"][name] == want, name
        assert attached["effects"] == []
        _check_plans(r, plain, plans)
        # a loss that is a mean per micro-batch: replicas of unequal sizes would not be exact
        reason = seen["mean"]["capabilities"]["microbatch_plans"]
        assert reason.startswith("the model's forward takes no num_items_in_batch"), reason
        # resumed from the Trainer's checkpoint: not re-cut (yet), said
        reason = seen["resumed"]["capabilities"]["microbatch_plans"]
        assert reason.startswith("the Trainer resumed from its checkpoint at step 3"), reason
        # FailslowCallback added after the Trainer was built: train() says so, trains nothing
        assert "added after the Trainer was built" in seen["late"]["error"], seen["late"]


def test_the_trainers_deepspeed_zero2_path_runs_s2_by_size_and_trains_the_same_model(
    tmp_path: Path,
) -> None:
    """The Trainer's DeepSpeed path, ZeRO-2 (gradients reduce-scattered inside every
    micro-step's backward, so a count plan cannot run): by size every replica still runs the
    Trainer's 4 micro-steps. Attached with the same plans, within 1e-6 of the plain Trainer's
    model (8.4e-9 measured); every plan in effect on every rank; the samples read as
    planned."""
    pytest.importorskip("deepspeed", reason="needs the deepspeed extra")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAILSLOW_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", str(HERE / "_engine_job.py"), str(tmp_path), "2"]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(4):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        plain, plans = seen["plain"], seen["plans"]
        assert plain["global_step"] == plans["global_step"] == 14
        assert plain["stage"] == plans["stage"] == 2
        _check_plans(r, plain, plans)
