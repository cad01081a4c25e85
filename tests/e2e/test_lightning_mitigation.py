"""End to end: a PyTorch Lightning job's straggler found, diagnosed and mitigated (S2 by size)
inside an unchanged ``Trainer.fit()``, with one line of failslow (issue 45).

``failslow demo --framework lightning``'s job: 4 ranks (started by ``failslow run --controller 4
-- torchrun --standalone --nproc-per-node 4 -m failslow.demo.lightning_worker``), a
``LightningModule`` (an MLP, its loss a mean over its batch) trained by
``Trainer(strategy="ddp", accumulate_grad_batches=4,
callbacks=[failslow.lightning.FailslowCallback()]).fit(module, loader)`` over the user's own
shuffled DataLoader (Lightning puts its DistributedSampler under it). Rank 2 is
SIGSTOP/SIGCONT-cycled from outside (75% stopped) from step 40 until the plan has been in effect
12 steps, and the job runs until the revert has been in effect 12 steps. The control plane in
the launcher must by itself detect, validate, name rank 2, buy S2 - fewer of each step's samples
for rank 2, its 4 micro-batches smaller - verified in effect on every rank at one step boundary,
and revert to the even split after the release.

Correctness: the parameters at the end equal those of the same job with no slowdown and no
control plane: fp32, <= 1e-6 relative - the same samples of every step, each micro-loss weighted
by its samples over the batch size, summed in another grouping (0 measured on the small model of
tests/adapters/lightning).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _s2_checks import a_straggler_is_mitigated

pytest.importorskip("lightning", reason="needs the lightning extra")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_lightning_straggler_is_mitigated_by_size_and_the_model_is_unchanged(
    tmp_path: Path,
) -> None:
    a_straggler_is_mitigated("lightning", tmp_path)
