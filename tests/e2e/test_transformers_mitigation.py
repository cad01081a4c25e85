"""End to end, as users start a job: a Hugging Face Trainer job's straggler found, diagnosed and
mitigated (S2 by size) inside an unchanged ``trainer.train()``, with one line of failslow
(issue 45).

``failslow demo --framework transformers``'s job: 4 ranks started by ``failslow run --controller
4 -- torchrun --standalone --nproc-per-node 4 -m failslow.demo.transformers_worker`` (the
reference run: ``accelerate launch``), a small GPT-2 trained by ``Trainer(...).train()`` (DDP
over gloo, gradient accumulation 4, per-device batch 8), failslow registered by
``failslow.transformers.attach(trainer)``. Rank 2 is SIGSTOP/SIGCONT-cycled from outside (75%
stopped) from step 40 until the plan has been in effect 12 steps, and the job runs until the
revert has been in effect 12 steps. The control plane in the launcher must by itself detect,
validate, name rank 2, buy S2 - fewer of each step's samples for rank 2, its 4 micro-batches
smaller - verified in effect on every rank at one step boundary, and revert to the even split
after the release.

Correctness: the parameters at the end equal those of the same job with no slowdown and no
control plane: fp32, <= 1e-6 relative - the same samples of every step, the token losses
divided by the global batch's token count (the Trainer's ``num_items_in_batch``) summed in
another grouping (1.7e-8 measured in tests/adapters/transformers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _s2_checks import a_straggler_is_mitigated

pytest.importorskip("transformers", reason="needs the transformers extra")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_trainer_straggler_is_mitigated_by_size_and_the_model_is_unchanged(
    tmp_path: Path,
) -> None:
    a_straggler_is_mitigated("transformers", tmp_path)


def test_a_trainer_straggler_on_deepspeed_zero1_is_mitigated_by_size(tmp_path: Path) -> None:
    """The same job on the Trainer's DeepSpeed path, ZeRO stage 1 (``TrainingArguments(
    deepspeed=...)``), failslow enabled as a DeepSpeed user would: its settings in the DeepSpeed
    config's ``"failslow"`` block and ``callbacks=[FailslowCallback()]``. Accelerate's engine
    wrapper sets DeepSpeed's accumulation boundary itself, so only the size form can take
    effect; the plan must be verified in effect (what the ranks ran), not just applied."""
    pytest.importorskip("deepspeed", reason="needs the deepspeed extra")
    a_straggler_is_mitigated("transformers", tmp_path, zero=1)
