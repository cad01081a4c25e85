"""Issue 45: S2 inside an unchanged ``Trainer.fit()`` - PyTorch Lightning's own loop, loader and
loss, four DDP ranks over gloo under torchrun, with ``callbacks=[failslow.lightning.
FailslowCallback()]``. Plans are scheduled on every rank (``session.schedule``), as the plan
channel would commit them.

Correctness is equality: attached without a plan, Lightning trains bitwise the model it trains
without failslow (the re-cut loader hands out its own batches, nothing is multiplied); with
plans, within 1e-6 relative of the plain run - the same samples of every step, each micro-loss
(a mean over its batch) weighted by its samples over the batch size, summed in other groupings
(fp32 rounding; the conformance suite's bound). The same for a loss that is a sum over its batch
(``loss_reduction="sum"``: nothing weighted). Where a plan cannot take effect (manual
optimization, ``limit_train_batches`` inside a step, an accumulation scheduled to change) the
capability says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lightning", reason="needs the lightning extra")

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.multiprocess, pytest.mark.untimed, pytest.mark.timeout(400)]


def _relative_error(want: dict[str, Any], got: dict[str, Any]) -> float:
    errors = []
    for name, value in want.items():
        a = np.asarray(value, dtype=np.float32)
        b = np.asarray(got[name], dtype=np.float32)
        errors.append(float(np.abs(b - a).max()) / float(np.abs(a).max()))
    return max(errors)


def _check_plans(rank: int, plain: dict[str, Any], plans: dict[str, Any]) -> None:
    """``plans`` trained ``plain``'s model within 1e-6, reported every plan applied and in
    effect, and read the planned samples per step (4 per count unit)."""
    assert plans["capabilities"]["microbatch_plans"] == "", plans["capabilities"]
    assert plain["global_step"] == plans["global_step"] == 14
    assert _relative_error(plain["parameters"], plans["parameters"]) <= 1e-6
    said = [(o, s, d) for o, s, d in plans["effects"]]
    for step in (2, 5, 12):
        assert ("applied", step, "") in said and ("in effect", step, "") in said, said
    reads = {int(s): n for s, n in plans["reads"].items()}
    for step, c in {4: (5, 5, 2, 4), 5: (6, 6, 1, 3), 8: (6, 6, 1, 3), 10: (6, 6, 1, 3)}.items():
        assert reads[step] == c[rank] * 4, (rank, step, reads)
    assert (
        reads[9] == 6
    )  # the epoch's short last step: Lightning's own 2 batches, whatever the plan
    assert reads[13] == 16  # the even split again
    assert plans["training_step_restored"]


def test_lightning_runs_s2_by_size_and_trains_the_same_model(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAILSLOW_", "PL_"))}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", str(HERE / "_fit_job.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(4):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        plain, attached = seen["plain"], seen["attached"]
        assert plain["global_step"] == attached["global_step"] == 14
        assert attached["capabilities"]["microbatch_plans"] == "", attached["capabilities"]
        assert attached["parameters"] == plain["parameters"]  # attached, no plan: bitwise
        assert attached["effects"] == []
        assert {int(s): n for s, n in attached["reads"].items()}[13] == 16
        _check_plans(r, plain, seen["plans"])
        _check_plans(r, seen["plain sum"], seen["sum"])
        reason = seen["manual"]["capabilities"]["microbatch_plans"]
        assert reason == "the LightningModule steps its optimizers itself (manual optimization)"
        reason = seen["limited"]["capabilities"]["microbatch_plans"]
        assert reason.startswith("limit_train_batches ends each epoch after 6 of its 38"), reason
        reason = seen["scheduled"]["capabilities"]["microbatch_plans"]
        assert reason.startswith("a GradientAccumulationScheduler changes"), reason
