"""Invariant 6 (DESIGN.md): pausing for validation and resuming loses no step and changes no
result (greyhound 4.3: "training is paused at the next iteration boundary", validated, resumed).

The ``pause`` run stops every rank between step ``HOLD`` and the next one; the test process
requests the pause trap on every ring, lets the ranks go and sees each park at its next
collective, keeps them parked, then releases them (:mod:`failslow.conformance.world`). The
run's parameters must equal the unpaused reference's bitwise: the same operations run on the
same values in the same order, only later.
"""

from __future__ import annotations

from failslow.conformance.capture import captured
from failslow.conformance.fixtures import ConformanceFixtures
from failslow.conformance.scenarios import HOLD
from failslow.conformance.world import LayoutRun, World


class AbstractPauseResumeTests(ConformanceFixtures):
    def test_pause_parks_every_rank_at_its_next_collective(
        self, layout_run: LayoutRun, conformance_world: World
    ) -> None:
        obs = layout_run.pause
        assert obs, "the ranks never reached the pause handshake together"
        assert "error" not in obs, obs.get("error")
        n = len(layout_run.ranks)
        assert obs["parked_before"] == [0] * n, "a rank was parked before the pause request"
        assert obs["parked"] == [True] * n, f"not every rank parked: {obs['parked']}"
        assert obs["write_index_after_pause"] == obs["write_index_at_park"], (
            "records were written while every rank was parked"
        )
        assert all(word > 0 for word in obs["parked_word"]), "a rank left the trap by itself"
        assert all(n == 0 for n in conformance_world.self_releases.values()), (
            f"a trap timed out instead of being released: {conformance_world.self_releases}"
        )
        for rank_run in layout_run.ranks:
            run = rank_run.run("pause")
            assert run["released"], f"rank {rank_run.rank} never got the go-ahead"
            held = HOLD + 1
            assert run["step_s"][held] >= 0.8 * obs["pause_s"], (
                f"rank {rank_run.rank}: step {held} took {run['step_s'][held]:.3f} s, "
                f"so it was not held by the {obs['pause_s']} s pause"
            )
            events = rank_run.window("pause", held)
            assert events, f"rank {rank_run.rank}: step {held} issued no call to park at"
            early = [e for e in events if e.t_start_ns < obs["t_release_ns"]]
            assert not early, (
                f"rank {rank_run.rank}: calls of step {held} started before the release - the "
                f"park must come before a call's t_start, never inside it: {early}"
            )

    def test_pause_loses_no_step(self, layout_run: LayoutRun) -> None:
        for rank_run in layout_run.ranks:
            ref, paused = rank_run.run("reference"), rank_run.run("pause")
            steps = list(range(len(ref["windows"])))
            assert ref["session_steps"] == steps, (
                f"rank {rank_run.rank}: the session saw steps {ref['session_steps']}"
            )
            assert paused["session_steps"] == steps, (
                f"rank {rank_run.rank}: with a pause the session saw {paused['session_steps']}"
            )
            assert paused["micro_batches"] == ref["micro_batches"]
            for step in steps:
                want = captured(rank_run, "reference", step)
                got = captured(rank_run, "pause", step)
                assert got == want, (
                    f"rank {rank_run.rank}, step {step}: the paused run issued other calls: "
                    f"missing {list((want - got).elements())}, "
                    f"extra {list((got - want).elements())}"
                )

    def test_pause_changes_no_result(self, layout_run: LayoutRun) -> None:
        for rank_run in layout_run.ranks:
            want = rank_run.parameters("reference")
            got = rank_run.parameters("pause")
            assert sorted(got) == sorted(want)
            differ = sorted(
                name
                for name in want
                if got[name].dtype != want[name].dtype
                or got[name].tobytes() != want[name].tobytes()
            )
            assert not differ, (
                f"rank {rank_run.rank}: parameters not bitwise equal after pause/resume: {differ}"
            )
