"""End to end, no human step: a Megatron-core job's straggler found, diagnosed and mitigated (S2).

A 4-rank Megatron-core GPT on CPU/gloo (``failslow demo --framework megatron``'s job: TP1 x PP2
x DP2, Megatron DDP, Adam, 1F1B), trained by the Megatron-LM loop with
``failslow.megatron.attach`` and ``fs.forward_backward`` over the loop's own data iterator
(``iter(DataLoader(..., batch_sampler=<Megatron-LM's pretraining sampler>))``: no
``fs.data_iterator``; failslow re-cuts it per plan); rank 2 (pipeline stage 1 of replica
0) is SIGSTOP/SIGCONT-cycled from outside (75% stopped) from step 40 until the plan has been in
effect 12 steps, and the job runs until the revert has been in effect 12 steps (90 at least;
``_s2_checks.STEPS``), started as users start it: ``failslow run --controller 4 -- torchrun
--standalone --nproc-per-node 4 -m failslow.demo.megatron_worker``. (It once failed beside a
1-core CPU hog when the throttle was a thread of this test's process: rank 2 ran up to 19-36 ms
between two stops, a 12 ms validation GEMM ran unslowed in them, and validation saw rank 2 at
full speed; the throttle is now a real-time process of its own,
``benchmarks/throttle_fidelity.py``.)
No group of this job spans every rank, so the validation pause lands at a step boundary. The
control plane must, by itself: detect the onset, pause and validate, name rank 2, buy S2 and
have every rank switch to fewer micro-batches on replica 0 (both of its stages) at one step
boundary; after the release, find every rank healthy again and switch back to the even split.

Correctness: every tensor of the model at the end equals that of the same job on the same data
with no slowdown and no control plane, reading its data the same way (invariant 2; a reference
run of the job over its own iterator, ``tests/e2e/conftest.py``: the job over
``fs.data_iterator`` reads the same samples per step but rounds otherwise, 1.02e-6 apart after
91 fault-free steps - which this test once mistook for the plan's. Why: ``fs.data_iterator``
gives each replica a contiguous block of the step's global batch, the Megatron-LM sampler
interleaves - global micro-batch ``j``'s slice ``r`` - so the same samples' gradients are summed
per replica in another grouping before the all-reduce; seen directly in the samplers' output,
``adapters/common/data.py``): fp32, <= 1e-6 relative to the tensor's largest value - the same
per-sample gradients summed in another grouping (rounding only).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _s2_checks import END, LAUNCHER, SLOW, START, STEPS, UNTIL

from failslow.demo.mitigation import MitigationDemoOptions, rank_record, run_mitigation_demo

pytest.importorskip(
    "megatron.core", reason="needs the Megatron extra: pip install failslow[megatron]"
)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

WORLD = 4


def _options(out: Path, **kw: object) -> MitigationDemoOptions:
    kw.setdefault("steps", STEPS)
    return MitigationDemoOptions(
        framework="megatron",
        slow_start=START,
        slow_end=END,
        slow_rank=SLOW,
        out_dir=out,
        live=False,
        loader="own",  # the loop's own Megatron-LM data iterator, re-cut by failslow
        failslow={"validation": {"recheck_every_s": 8.0}, "detection": {"cooldown_s": 8.0}},
        **kw,  # type: ignore[arg-type]
    )


def test_a_megatron_straggler_is_mitigated_and_the_model_is_unchanged(
    tmp_path: Path, megatron_own_loader_reference: Callable[[int], Any]
) -> None:
    summary = run_mitigation_demo(
        _options(tmp_path / "mitigated", until_mitigated=UNTIL, launcher=LAUNCHER)
    )
    steps_run = summary["steps_run"]
    injected_start, injected_end = summary["injected"]
    context = json.dumps({k: summary[k] for k in ("actions", "injected", "steps_run")})

    slow = {r for d in summary["diagnoses"] for r, _ in d["slow_ranks"]}
    assert SLOW in slow, summary["diagnoses"]
    targets = [d["evidence"]["target"] for d in summary["diagnoses"]]
    assert all("step" in t for t in targets), targets  # every pause between two steps
    applied = [a for a in summary["actions"] if a["action"] == "apply"]
    assert applied, context
    first = applied[0]
    assert first["strategy"] == "S2 micro-batches", context
    assert first["effect"] == "in effect", context  # every rank ran its share of the plan
    counts = first["counts"]  # replica 0 holds rank 2 (stage 1) and rank 0 (stage 0)
    assert sum(counts) == 8 and counts[0] == min(counts) < 4, context
    assert START <= injected_start < first["apply_step"] < injected_end, context
    reverts = [a for a in summary["actions"] if a["action"] == "revert"]
    assert reverts and reverts[-1]["counts"] == [4, 4], context
    assert END <= injected_end <= reverts[-1]["apply_step"] < steps_run, context
    records = [rank_record(tmp_path / "mitigated", r) for r in range(WORLD)]
    assert len({tuple(tuple(a) for a in rec["applied"]) for rec in records}) == 1
    assert all(rec["counts"] == [4, 4] for rec in records)

    reference = megatron_own_loader_reference(steps_run)  # each rank's model, layout-free names
    for rank in range(WORLD):
        got = np.load(tmp_path / "mitigated" / f"model-rank{rank}.npz")
        want = reference.parts[rank]
        assert sorted(got.files) == sorted(want.files)
        for name in want.files:
            scale = float(np.abs(want[name]).max())
            diff = float(np.abs(got[name] - want[name]).max())
            assert diff <= 1e-6 * scale, (  # the run's plans and length: what moves rounding
                f"rank {rank} {name}: {diff / scale:.3g} relative after {steps_run} steps; "
                f"{context}"
            )
