"""End to end under ``accelerate launch``: an FSDP2 job's straggler found, diagnosed and
mitigated (S2) in Accelerate's own loop, with one line of failslow.

``failslow demo --framework accelerate``'s job: 4 ranks started by ``accelerate launch``, the
loop Accelerate's tutorials teach (``with accelerator.accumulate(model)``, ``accelerator.
backward``, ``optimizer.step``) over ``fs.loader(dataset)``, the model FSDP2 over every rank with
``unshard_once`` (Accelerate's FSDP path switched on for this CPU-only machine, demo-only),
failslow registered by ``failslow.accelerate.attach(accelerator)``. Rank 2 is
SIGSTOP/SIGCONT-cycled from outside (75% stopped) from step 50 until the plan has been in
effect 20 steps (step 100 at the earliest), and the job runs until the revert has been in
effect 20 steps. The control plane must by itself detect, validate, name rank 2, buy S2 (fewer
micro-batches for rank 2) at one step boundary on every rank and revert to the even split
after the release.

Correctness: the parameters at the end equal those of the same job with no slowdown and no
control plane: fp32, <= 1e-6 relative - the same per-sample gradients summed in another
grouping (the conformance suite measured 7.5e-8 for this path).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from failslow.demo.mitigation import MitigationDemoOptions, run_mitigation_demo

pytest.importorskip(
    "accelerate", reason="needs the Accelerate extra: pip install failslow[accelerate]"
)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

# STEPS is only the earliest end: the job runs on until the revert has been in effect 20 steps
STEPS, START, END, SLOW = 140, 50, 100, 2


def _options(out: Path, **kw: object) -> MitigationDemoOptions:
    kw.setdefault("steps", STEPS)
    return MitigationDemoOptions(
        framework="accelerate",
        slow_start=START,
        slow_end=END,
        slow_rank=SLOW,
        out_dir=out,
        live=False,
        failslow={"validation": {"recheck_every_s": 8.0}, "detection": {"cooldown_s": 8.0}},
        **kw,  # type: ignore[arg-type]
    )


def test_an_accelerate_straggler_is_mitigated_and_the_model_is_unchanged(tmp_path: Path) -> None:
    summary = run_mitigation_demo(_options(tmp_path / "mitigated", until_mitigated=20))
    steps_run = summary["steps_run"]
    run_mitigation_demo(
        _options(tmp_path / "reference", mitigate=False, inject=False, steps=steps_run)
    )
    injected_start, injected_end = summary["injected"]

    slow = {r for d in summary["diagnoses"] for r, _ in d["slow_ranks"]}
    assert SLOW in slow, summary["diagnoses"]
    applied = [a for a in summary["actions"] if a["action"] == "apply"]
    assert applied, summary["actions"]
    first = applied[0]
    assert first["strategy"] == "S2 micro-batches"
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
