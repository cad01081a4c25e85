"""End to end, no human step: a congested link inside an HSDP shard group swapped away (S3).

``failslow demo --framework fsdp --fault link``'s job: FSDP2 HSDP on 4 ranks (2 replicas x 2
shards, ``failslow.fsdp.attach(..., model_factory=build)``), each rank in its own network
namespace and host on one bridge. From step 30 the link between ranks 0 and 1 - the two shards
of replica 0, whose per-layer all-gathers and reduce-scatters cross it every micro-batch - is
shaped with tc until the swap has been in effect 12 steps. The control plane must by itself
detect, validate, name the link 0-1, buy S3 (the planner knows the job is sharded:
shard-group traffic outweighs the replicas' one all-reduce per step) and have every rank take
its new mesh role at one step boundary, in place.

Correctness: the full parameters at the end equal, bitwise, those of the same job with no fault
and no control plane (invariant 3: only the placement changed; every shard group has two ranks,
so each reduction adds the same two numbers either way).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _netns import require_network_namespaces
from _s2_checks import UNTIL

from failslow.demo.mitigation import MitigationDemoOptions, run_mitigation_demo

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, START, WORLD = 70, 30, 4


def _options(out: Path, **kw: object) -> MitigationDemoOptions:
    kw.setdefault("steps", STEPS)
    return MitigationDemoOptions(
        framework="fsdp",
        slow_start=START,
        slow_end=START + 10,
        out_dir=out,
        live=False,
        failslow={"validation": {"recheck_every_s": 8.0}, "detection": {"cooldown_s": 8.0}},
        **kw,  # type: ignore[arg-type]
    )


def test_a_congested_shard_link_is_swapped_away_and_the_model_is_unchanged(
    tmp_path: Path,
) -> None:
    require_network_namespaces()
    summary = run_mitigation_demo(
        _options(tmp_path / "swapped", fault="link", until_mitigated=UNTIL)
    )
    run_mitigation_demo(
        _options(tmp_path / "reference", mitigate=False, inject=False, steps=summary["steps_run"])
    )
    context = json.dumps({k: summary[k] for k in ("actions", "injected", "steps_run")})
    links = {tuple(sorted(link[:2])) for d in summary["diagnoses"] for link in d["slow_links"]}
    assert (0, 1) in links, summary["diagnoses"]
    applied = [a for a in summary["actions"] if a["action"] == "apply"]
    assert applied and applied[0]["strategy"] == "S3 topology", context
    injected_start, injected_end = summary["injected"]
    assert START <= injected_start < applied[0]["apply_step"] < injected_end, context

    records = [
        json.loads((tmp_path / "swapped" / f"steps-rank{r}.json").read_text()) for r in range(WORLD)
    ]
    assert len({tuple(tuple(a) for a in rec["applied"]) for rec in records}) == 1
    before = [
        json.loads((tmp_path / "reference" / f"steps-rank{r}.json").read_text())["coords"]
        for r in range(WORLD)
    ]
    after = [rec["coords"] for rec in records]
    assert sorted(after) == sorted(before) and after != before, (before, after)
    assert after[0][1] != after[1][1], after  # the link's ends are no longer one shard group

    got = np.load(tmp_path / "swapped" / "parameters.npz")
    want = np.load(tmp_path / "reference" / "parameters.npz")
    assert sorted(got.files) == sorted(want.files)
    for name in want.files:
        assert np.array_equal(got[name], want[name]), name
