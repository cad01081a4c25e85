"""Invariant 3 (DESIGN.md): a topology swap never changes the training result (greyhound 5.2,
S3: roles move to other hosts, in place).

The ``swap`` run rotates every role to the next rank's host at a step boundary (each rank is
its own host in the suite's world); each rank then trains the role it received. The check is by
role: a rank's parameters after the run must equal, bitwise, those of the reference run's rank
that held the same coordinates (TP, DP, PP) - only the placement changed, so the same
operations run on the same values in the same order (process groups keep the roles' order).
Tolerance 0; a state move that dropped anything (optimizer moments, schedule, data position,
RNG), a group built in another rank order or a replica reading another's data shows up. That
the swap was real is checked apart: every rank holds another role afterwards, in the same
process, and the session's step count went on without a gap. A plan that places every role on
one host is refused before anything changes. Where the adapter also snapshots, a restart in
place after the swap (the job built afresh, every process in its launch role) resumes the
swapped placement from the newest snapshot and finishes with the same parameters (bitwise).
"""

from __future__ import annotations

import numpy as np

from failslow.conformance.fixtures import ConformanceFixtures, require
from failslow.conformance.world import LayoutRun


def _reference_rank_of(layout_run: LayoutRun) -> dict[tuple[int, ...], int]:
    coords = layout_run.ranks[0].result["topology"]["coords"]
    return {tuple(c): rank for rank, c in enumerate(coords)}


class AbstractTopologySwapTests(ConformanceFixtures):
    def test_swap_gives_each_role_the_reference_parameters(self, layout_run: LayoutRun) -> None:
        require(layout_run, "topology_plans")
        holder = _reference_rank_of(layout_run)
        for rank_run in layout_run.ranks:
            role = tuple(rank_run.result["swap"]["coords_after"])
            want = layout_run.ranks[holder[role]].parameters("reference")
            got = rank_run.parameters("swap")
            assert sorted(got) == sorted(want), (
                f"rank {rank_run.rank} now runs role {role}, but its parameter names differ "
                f"from that role's in the reference run"
            )
            for name in want:
                assert np.array_equal(got[name], want[name]), (
                    f"layout {layout_run.layout!r}, rank {rank_run.rank} (role {role}, held by "
                    f"rank {holder[role]} in the reference), {name}: differs after the swap"
                )

    def test_swap_moves_every_role_in_place(self, layout_run: LayoutRun) -> None:
        require(layout_run, "topology_plans")
        coords = layout_run.ranks[0].result["topology"]["coords"]
        for rank_run in layout_run.ranks:
            record = rank_run.result["swap"]
            plan, hosts = record["plan"], record["hosts"]
            # the role of the rank whose host this rank's host took in the rotation
            expected = coords[plan.index(hosts[rank_run.rank])]
            assert record["coords_after"] == list(expected), (
                f"rank {rank_run.rank} runs {record['coords_after']} after the swap, the plan "
                f"gave it {expected}"
            )
            assert record["same_process"], f"rank {rank_run.rank} restarted"
            got_steps = rank_run.run("swap")["session_steps"]
            assert got_steps == rank_run.run("reference")["session_steps"], (
                f"rank {rank_run.rank}: session steps {got_steps} with the swap"
            )

    def test_every_rank_reports_the_swap_in_effect(self, layout_run: LayoutRun) -> None:
        """Invariant 7: at the boundary after the swap each rank read its role from the
        framework's own rebuilt groups or mesh (``failslow_observed_coord``) and found the one
        the plan gave it."""
        require(layout_run, "topology_plans")
        from failslow.conformance.scenarios import SWAP_STEP

        for rank_run in layout_run.ranks:
            said = [[o, d] for o, s, d in rank_run.result["effects"]["swap"] if s == SWAP_STEP]
            assert said == [["applied", ""], ["in effect", ""]], (
                f"rank {rank_run.rank}: the swap was reported {said}"
            )

    def test_a_plan_that_crowds_one_host_is_refused(self, layout_run: LayoutRun) -> None:
        require(layout_run, "topology_plans")
        for rank_run in layout_run.ranks:
            crowded = rank_run.result["swap"]["crowded"]
            assert crowded["raised"] == "ConfigError", crowded
            assert "roles but has" in crowded["message"], crowded["message"]

    def test_a_restart_after_a_swap_resumes_the_swapped_placement(
        self, layout_run: LayoutRun
    ) -> None:
        require(layout_run, "topology_plans")
        require(layout_run, "snapshots")
        holder = _reference_rank_of(layout_run)
        steps = len(layout_run.ranks[0].run("reference")["windows"])
        for rank_run in layout_run.ranks:
            record = rank_run.result["swap"]
            assert record["resumed"] == steps - 1, f"rank {rank_run.rank}: {record}"
            assert record["coords_resumed"] == record["coords_after"], (
                f"rank {rank_run.rank} resumed as {record['coords_resumed']}, it ran "
                f"{record['coords_after']} when the snapshot was taken"
            )
            role = tuple(record["coords_after"])
            want = layout_run.ranks[holder[role]].parameters("reference")
            got = rank_run.parameters("swap_resumed")
            for name in want:
                assert np.array_equal(got[name], want[name]), (
                    f"layout {layout_run.layout!r}, rank {rank_run.rank} (role {role}), {name}: "
                    "differs after resuming the swapped placement"
                )
