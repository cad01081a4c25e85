"""Issue 45: S2 over the loader an Accelerate user prepared - the loop of Accelerate's docs
(``accelerator.prepare(model, optimizer, loader)``, ``with accelerator.accumulate(model)``), no
``fs.loader``. Four DDP ranks over gloo under torchrun; plans are scheduled on every rank
(``session.schedule``), as the plan channel would commit them.

Correctness is equality, 1e-6 relative to the job without failslow: attached without a plan
the re-cut loader hands out Accelerate's own batches, and only DDP's bucket layout differs
(failslow pins the construction layout at attach, so a restart from a snapshot sums as the
uninterrupted run; plain DDP rebuilds it in gradient-ready order: float rounding, measured
~4e-7 here); with plans, the same micro-batches of every step, each micro-loss still divided
by the accumulation, summed over other groupings. The epoch's short last step (2 micro-batches
per rank) runs Accelerate's own batches on every replica whatever the plan, and syncs at the
end of the loader as Accelerate's own loop does. A share bug (a replica reading another
step's or replica's samples) moves the parameters by >= 1e-3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("accelerate", reason="needs the Accelerate extra")

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.multiprocess, pytest.mark.untimed, pytest.mark.timeout(400)]


def test_s2_by_count_over_the_users_prepared_loader_trains_the_same_model(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAILSLOW_", "ACCELERATE_"))}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", str(HERE / "_prepared_job.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    worst = {"attached": 0.0, "plans": 0.0}
    for rank in range(4):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        plain, attached, plans = seen["plain"], seen["attached"], seen["plans"]
        even = [4] * 9 + [2]  # an epoch: 9 full steps and a short one, twice
        assert plain["ran"] == attached["ran"] == even * 2 and plain["left"] == 0, plain
        for run in ("attached", "plans"):
            for name, want in plain["parameters"].items():
                want_a = np.asarray(want, dtype=np.float32)
                got = np.asarray(seen[run]["parameters"][name], dtype=np.float32)
                err = float(np.abs(got - want_a).max()) / float(np.abs(want_a).max())
                worst[run] = max(worst[run], err)
                assert err <= 1e-6, (rank, run, name, err)
        assert attached["effects"] == [] and attached["reads"] == even * 2
        assert attached["capabilities"]["microbatch_plans"] == "", attached["capabilities"]
        # with plans: this replica's count from each plan's step; Accelerate's own batches in
        # the short last step of the epoch; the even split again from step 12
        a, b = PLAN_2[rank], PLAN_5[rank]
        want_ran = [4, 4, a, a, a, b, b, b, b, 2, b, b, 4, 4, 4, 4, 4, 4, 4, 2]
        assert plans["ran"] == want_ran and plans["left"] == 0, (rank, plans["ran"])
        assert plans["reads"] == want_ran, (rank, plans["reads"])
        said = [tuple(x) for x in plans["effects"]]
        for step in (2, 5, 12):
            assert ("applied", step, "") in said and ("in effect", step, "") in said, said
    print(f"largest relative difference to the plain run: {worst}")


PLAN_2, PLAN_5 = (5, 5, 2, 4), (6, 6, 1, 3)
