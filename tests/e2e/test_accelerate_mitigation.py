"""End to end, as users start a job: an FSDP2 job's straggler found, diagnosed and mitigated
(S2) in Accelerate's own loop, with one line of failslow.

``failslow demo --framework accelerate``'s job, 4 ranks started by ``failslow run --controller 4
-- torchrun --standalone --nproc-per-node 4 -m failslow.demo.accelerate_worker`` (the reference
run: ``accelerate launch``): the loop Accelerate's tutorials teach (``with
accelerator.accumulate(model)``, ``accelerator.backward``, ``optimizer.step``) over the job's own
``accelerator.prepare``d DataLoader (no ``fs.loader``: failslow re-cuts its sampler per plan),
the model FSDP2 over every rank with ``unshard_once`` (Accelerate's FSDP path switched on for
this CPU-only machine, demo-only), failslow registered by
``failslow.accelerate.attach(accelerator)``. Rank 2 is SIGSTOP/SIGCONT-cycled from outside (75%
stopped) from step 40 until the plan has been in effect 12 steps (step 70 at the earliest), and
the job runs until the revert has been in effect 12 steps (``_s2_checks.STEPS``). The control
plane in the launcher must by itself detect, validate, name rank 2, buy S2 (fewer micro-batches
for rank 2) at one step boundary on every rank and revert to the even split after the release.

Correctness: the parameters at the end equal those of the same job with no slowdown and no
control plane: fp32, <= 1e-6 relative - the same per-sample gradients summed in another
grouping (the conformance suite measured 7.5e-8 for this path).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _s2_checks import a_straggler_is_mitigated

pytest.importorskip(
    "accelerate", reason="needs the Accelerate extra: pip install failslow[accelerate]"
)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]


def test_an_accelerate_straggler_is_mitigated_and_the_model_is_unchanged(tmp_path: Path) -> None:
    a_straggler_is_mitigated("accelerate", tmp_path)
