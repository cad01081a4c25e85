"""Invariants 4 and 5 (DESIGN.md): snapshot/restore is bitwise, and a restart in place resumes
at the same step with the same state (byterobust 6.3 in-memory checkpoints, 6.1 hot update).

The ``snapshot`` run is the reference run with an in-memory snapshot at every step boundary
(the copy overlaps the step; the optimizer step waits for it). The job is then closed and
built afresh over the same snapshot directory - what a hot update's restart does - and its
session resumes from the newest snapshot; the ``resumed`` run finishes the steps from there.
Tolerance 0: the same operations on the same values in the same order; a snapshot that missed
any state (optimizer momentum, learning-rate schedule, data position, RNG) shows up as a
difference. That a backup survives the eviction of the rank's whole pipeline group is the
placement's property (``tests/core/checkpoint``), independent of the adapter.
"""

from __future__ import annotations

import numpy as np

from failslow.conformance.fixtures import ConformanceFixtures, require
from failslow.conformance.world import LayoutRun


def _assert_bitwise(layout_run: LayoutRun, got_run: str, want_run: str) -> None:
    for rank_run in layout_run.ranks:
        want, got = rank_run.parameters(want_run), rank_run.parameters(got_run)
        assert sorted(got) == sorted(want), f"rank {rank_run.rank}: parameter names differ"
        for name in want:
            assert np.array_equal(got[name], want[name]), (
                f"layout {layout_run.layout!r}, rank {rank_run.rank}, {name}: the {got_run!r} "
                f"run differs from the {want_run!r} run"
            )


class AbstractSnapshotTests(ConformanceFixtures):
    def test_snapshots_change_nothing(self, layout_run: LayoutRun) -> None:
        require(layout_run, "snapshots")
        _assert_bitwise(layout_run, "snapshot", "reference")

    def test_a_restart_resumes_at_the_last_snapshotted_step(self, layout_run: LayoutRun) -> None:
        require(layout_run, "snapshots")
        steps = len(layout_run.ranks[0].run("reference")["windows"])
        for rank_run in layout_run.ranks:
            record = rank_run.result["snapshot"]
            assert record["sealed"] == steps - 1, f"rank {rank_run.rank}: {record}"
            assert record["resumed"] == steps - 1, (
                f"rank {rank_run.rank} resumed at {record['resumed']}, expected {steps - 1}"
            )
            assert rank_run.run("resumed")["session_steps"] == [steps - 1]

    def test_restored_state_is_bitwise(self, layout_run: LayoutRun) -> None:
        require(layout_run, "snapshots")
        _assert_bitwise(layout_run, "resumed", "reference")
