"""Megatron-core passes the conformance suite (:mod:`failslow.conformance`; DESIGN.md
invariants 1-6 plus declared capabilities) on TP1/PP2/DP2 and TP2/PP1/DP2, with
and without the distributed optimizer, in one spawned 4-rank gloo world
(``_conformance_harness.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "megatron.core", reason="needs the Megatron extra: pip install failslow[megatron]"
)

from failslow.conformance import AbstractAdapterTests

from ._conformance_harness import MegatronHarness

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]


class TestMegatronConformance(AbstractAdapterTests, MegatronHarness):
    REL_TOL = 5e-6
    """Uneven plans vs the even split, fp32 (invariant 2). Measured on an AVX-512 Xeon,
    2026-11-24: 1.45e-6 on the PP2 layouts (``decoder.layers.0.mlp.linear_fc2.weight`` of
    stage 0, about 7,500 of its 16,384 elements differ), 6.0e-7 on TP2; the same code gave
    <= 1e-6 on earlier machines. Adam divides each element's update by that element's own
    gradient scale, so the rounding of a gradient that is a near-cancelling sum (regrouped
    across replicas and micro-steps by the plan) shows in the parameter at ``lr`` times its
    relative error. The pause run, which does not regroup, matches the reference bitwise. A
    data-share bug gives >= 1.9e-3 (the suite's mutation check): 5e-6 keeps a 380x margin."""
