"""End to end under ``accelerate launch``: a Hugging Face Trainer job's straggler found,
diagnosed and mitigated (S2 by size) inside an unchanged ``trainer.train()``, with one line of
failslow (issue 45).

``failslow demo --framework transformers``'s job: 4 ranks started by ``accelerate launch``, a
small GPT-2 trained by ``Trainer(...).train()`` (DDP over gloo, gradient accumulation 4,
per-device batch 8), failslow registered by ``failslow.transformers.attach(trainer)``. Rank 2 is
SIGSTOP/SIGCONT-cycled from outside (75% stopped) from step 50 until the plan has been in
effect 20 steps, and the job runs until the revert has been in effect 20 steps. The control
plane must by itself detect, validate, name rank 2, buy S2 - fewer of each step's samples for
rank 2, its 4 micro-batches smaller - verified in effect on every rank at one step boundary,
and revert to the even split after the release.

Correctness: the parameters at the end equal those of the same job with no slowdown and no
control plane: fp32, <= 1e-6 relative - the same samples of every step, the token losses
divided by the global batch's token count (the Trainer's ``num_items_in_batch``) summed in
another grouping (1.7e-8 measured in tests/adapters/transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from failslow.demo.mitigation import MitigationDemoOptions, run_mitigation_demo

pytest.importorskip("transformers", reason="needs the transformers extra")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

# STEPS is only the earliest end: the job runs on until the revert has been in effect 20 steps
STEPS, START, END, SLOW = 140, 50, 100, 2


def _options(out: Path, **kw: object) -> MitigationDemoOptions:
    kw.setdefault("steps", STEPS)
    return MitigationDemoOptions(
        framework="transformers",
        slow_start=START,
        slow_end=END,
        slow_rank=SLOW,
        out_dir=out,
        live=False,
        failslow={"validation": {"recheck_every_s": 8.0}, "detection": {"cooldown_s": 8.0}},
        **kw,  # type: ignore[arg-type]
    )


def test_a_trainer_straggler_is_mitigated_by_size_and_the_model_is_unchanged(
    tmp_path: Path,
) -> None:
    summary = run_mitigation_demo(_options(tmp_path / "mitigated", until_mitigated=20))
    steps_run = summary["steps_run"]
    run_mitigation_demo(
        _options(tmp_path / "reference", mitigate=False, inject=False, steps=steps_run)
    )
    injected_start, injected_end = summary["injected"]

    slow = {r for d in summary["diagnoses"] for r, _ in d["slow_ranks"]}
    assert SLOW in slow, summary["diagnoses"]
    applied = [a for a in summary["actions"] if a["action"] == "apply"]
    assert applied, (summary["actions"], summary.get("unavailable"))
    first = applied[0]
    assert first["strategy"] == "S2 micro-batches" and first["effect"] == "in effect", first
    counts = first["counts"]
    assert sum(counts) == 16 and counts[SLOW] == min(counts) < 4
    assert START <= injected_start < first["apply_step"] < injected_end
    reverts = [a for a in summary["actions"] if a["action"] == "revert"]
    assert reverts and reverts[-1]["counts"] == [4, 4, 4, 4]
    assert END <= injected_end <= reverts[-1]["apply_step"] < steps_run
    records = [
        json.loads((tmp_path / "mitigated" / f"steps-rank{r}.json").read_text()) for r in range(4)
    ]
    assert len({tuple(tuple(a) for a in rec["applied"]) for rec in records}) == 1
    assert all(rec["counts"] == [4, 4, 4, 4] for rec in records)

    got = np.load(tmp_path / "mitigated" / "parameters.npz")
    want = np.load(tmp_path / "reference" / "parameters.npz")
    assert sorted(got.files) == sorted(want.files)
    for name in want.files:
        scale = float(np.abs(want[name]).max())
        assert float(np.abs(got[name] - want[name]).max()) <= 1e-6 * scale, name
