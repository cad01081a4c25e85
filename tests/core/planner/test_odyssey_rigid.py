"""Reroute or reconfigure on a rigid grid (failslow.core.planner.odyssey.rigid)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.planner.odyssey.rigid import (
    RigidJob,
    choose_rigid_layout,
    rigid_job_from_notes,
)
from failslow.core.topology import megatron_rank
from failslow.errors import ConfigError, FailslowError


def _job(tp: int = 1, dp: int = 2, pp: int = 2, layers: int = 4, m: int = 8) -> RigidJob:
    coords = tuple((t, d, p) for p in range(pp) for d in range(dp) for t in range(tp))
    return RigidJob(
        tp=tp, dp=dp, pp=pp, num_layers=layers, micro_batches=m, coords=coords,
        per_microbatch_s=0.1, post_s=0.02,
    )  # fmt: skip


def test_pp2_dp2_losing_a_rank_reconfigures_to_pp1_dp3_when_the_model_fits() -> None:
    choice = choose_rigid_layout(_job(), {2})
    # reroute PP2xDP1: 8 micro-batches through 2 stages of 2 layers, (8 + 1) * 0.1 s;
    # PP1xDP3: 3 micro-batches of 4 layers, 3 * 0.2 s; the optimizer holds 4 layers, not 2
    assert choice.alternatives == pytest.approx({"PP2xDP1": 0.92, "PP1xDP3": 0.64})
    assert (choice.choice, choice.name, choice.counts) == ("reconfigure", "PP1xDP3", (3, 3, 2))
    assert choice.keep == (0, 1, 3)
    assert choice.before_s == pytest.approx(0.52)  # (4 + 1) * 0.1 + 0.02


def test_with_no_step_measured_the_layout_that_keeps_the_most_ranks_wins() -> None:
    """Ranks lost right after a restart, before anyone measured a step: every estimate is 0,
    which must not make the reroute (it stands rank 3's replica partner by) win the tie."""
    unmeasured = RigidJob(
        tp=1, dp=2, pp=2, num_layers=4, micro_batches=8, coords=_job().coords,
    )  # fmt: skip
    choice = choose_rigid_layout(unmeasured, {2})
    assert choice.alternatives == {"PP2xDP1": 0.0, "PP1xDP3": 0.0}
    assert (choice.choice, choice.name, choice.keep) == ("reconfigure", "PP1xDP3", (0, 1, 3))
    # what memory allows still bounds it: then the reroute is the only layout
    assert choose_rigid_layout(unmeasured, {2}, max_stage_layers=2).name == "PP2xDP1"


def test_when_a_rank_holds_at_most_a_stage_s_layers_the_lost_pipeline_is_dropped() -> None:
    choice = choose_rigid_layout(_job(), {2}, max_stage_layers=2)
    assert (choice.choice, choice.name, choice.counts) == ("reroute", "PP2xDP1", (8,))
    # rank 2 was (dp 0, pp 1): replica 1 (ranks 1 and 3) goes on, stages kept
    assert choice.keep == (1, 3)


def test_min_ranks_and_memory_can_leave_no_layout() -> None:
    with pytest.raises(FailslowError, match="admit no 4-layer layout"):
        choose_rigid_layout(_job(), {2}, max_stage_layers=2, min_ranks=3)
    with pytest.raises(ConfigError, match="not ranks of the old layout"):
        choose_rigid_layout(_job(), {7})


@settings(max_examples=200, deadline=None)
@given(
    tp=st.sampled_from([1, 2]),
    dp=st.integers(1, 6),
    pp=st.sampled_from([1, 2, 4]),
    m_per=st.integers(1, 4),
    lost=st.sets(st.integers(0, 47), min_size=1, max_size=4),
    cap=st.sampled_from([None, 1, 2, 4, 8]),
)
def test_every_choice_is_a_grid_the_survivors_fill(tp, dp, pp, m_per, lost, cap) -> None:
    job = _job(tp=tp, dp=dp, pp=pp, layers=8, m=m_per * dp)
    lost = {r % (tp * dp * pp) for r in lost}
    try:
        choice = choose_rigid_layout(job, lost, max_stage_layers=cap)
    except FailslowError:
        return
    assert len(choice.keep) == choice.tp * choice.dp * choice.pp
    assert not set(choice.keep) & lost and len(set(choice.keep)) == len(choice.keep)
    assert sum(choice.counts) == job.micro_batches and min(choice.counts) >= 1
    assert 8 % choice.pp == 0 and (cap is None or 8 // choice.pp <= cap)
    assert choice.step_time_s == min(choice.alternatives.values())
    if choice.choice == "reroute":  # each survivor keeps its stage and TP rank
        assert choice.pp == pp
        for new, old in enumerate(choice.keep):
            t, _, p = job.coords[old]
            assert new == megatron_rank((t, new // tp % choice.dp, p), tp=tp, dp=choice.dp)


def _notes(ranks, tp=1, dp=2, pp=2, coords=None):
    grid = [(t, d, p) for p in range(pp) for d in range(dp) for t in range(tp)]
    coords = coords or grid
    return [
        {"rank": r, "tp": tp, "dp": dp, "pp": pp, "layers": 4, "micro_batches": 8,
         "coord": list(coords[r]), "profile": {"spacing": 0.1 * (r + 1), "post_low": 0.01}}
        for r in ranks
    ]  # fmt: skip


def test_the_old_layout_is_read_back_from_the_survivors_notes() -> None:
    job = rigid_job_from_notes(_notes([0, 1, 3]), 4)
    assert job is not None
    assert job.coords == ((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1))
    assert job.per_microbatch_s == pytest.approx(0.4) and job.post_s == pytest.approx(0.01)
    # a swapped placement: the one missing rank takes the one free cell
    swapped = [(0, 1, 0), (0, 0, 0), (0, 1, 1), (0, 0, 1)]
    job = rigid_job_from_notes(_notes([0, 1, 2], coords=swapped), 4)
    assert job is not None and job.coords == tuple(swapped)
    # two missing off Megatron's order: unknown; notes of another world size: unknown
    assert rigid_job_from_notes(_notes([0, 1], coords=swapped), 4) is None
    assert rigid_job_from_notes(_notes([0, 1, 2]), 3) is None
    assert rigid_job_from_notes([{"rank": 0}], 4) is None
