"""End to end, as users start a job: a pure FSDP2 job's straggler found, diagnosed and
mitigated by S2's size form (issue 46).

``failslow demo --framework fsdp --mesh full``'s job: the MLP ``fully_shard``-ed over one group
of the 4 ranks (no ``unshard_once``: FSDP's usual sharded memory), ``failslow.fsdp.attach`` and
``fs.train_step`` over ``fs.loader``, started by ``failslow run --controller 4 -- torchrun
--standalone --nproc-per-node 4 -m failslow.demo.fsdp_worker`` (the reference run: the demo's
launcher, no control plane). Every rank all-gathers every layer in every micro-batch, so every
replica runs its 4 micro-batches and a plan changes how many samples they hold; each
micro-loss is weighed by its samples (``fs.loss_scale``). Rank 2 is SIGSTOP/SIGCONT-cycled from
outside (75% stopped) from step 40 until the plan has been in effect 12 steps; the control
plane must by itself detect, validate, name rank 2, buy S2 in the size form (a probe first,
then the split its measurements size), have every rank run it (its samples and weights checked
on every rank) and walk back to the even split - after the release, or during the slowdown
where the closed loop measured the plans short of their promise (a throttled rank joins every
per-layer collective of every micro-batch, which its fewer samples do not shorten:
benchmarks/README.md, "S2 by size on sharded data parallelism").

Correctness: the parameters at the end equal those of the same job with no slowdown and no
control plane: fp32, <= 1e-6 relative - the same per-sample gradients summed in another
grouping (the conformance suite measured 7.4e-8 for this layout).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _s2_checks import a_straggler_is_mitigated

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_pure_fsdp2_straggler_is_mitigated_by_size_and_the_model_is_unchanged(
    tmp_path: Path,
) -> None:
    a_straggler_is_mitigated("fsdp", tmp_path, mesh="full")
