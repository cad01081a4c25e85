"""The demo's job-level events from per-rank detector reports (quorum, late ranks, compounds)."""

from __future__ import annotations

from types import SimpleNamespace

from failslow.demo.launcher import DemoOptions, DemoState, _merge_event


def _event(kind: str, change: float) -> SimpleNamespace:
    return SimpleNamespace(type=kind, change=change, before_s=0.17, after_s=0.17 * (1 + change))


def _feed(state: DemoState, reports: list[tuple[int, str, int, int, float]]) -> None:
    for rank, kind, at, seen, change in reports:
        _merge_event(state, rank, _event(kind, change), at, seen)


def test_a_step_up_on_top_of_an_open_onset_is_a_compound_job_onset() -> None:
    # what a CI run printed: the machine slowed every rank at iteration 40, the injection began
    # at 60 on top of it, the ranks that had reported 40 reported a further step at 59-60
    state = DemoState(DemoOptions())
    _feed(state, [
        (1, "onset", 40, 44, 0.157), (0, "onset", 40, 45, 0.172),  # quorum: the job onset
        (2, "onset", 48, 52, 0.255),  # a late rank joins it
        (0, "onset", 59, 62, 0.264),  # one rank's further step: not yet a quorum
        (1, "onset", 60, 63, 0.321),  # two: a compound job onset
        (3, "onset", 49, 64, 0.204),  # a rank that had not reported joins the compound
        (0, "relief", 109, 113, -0.107), (3, "relief", 109, 114, -0.085),
    ])
    kinds = [(e.type, e.iteration, e.reported_at, e.ranks) for e in state.detected]
    assert kinds == [
        ("onset", 40, 45, [0, 1, 2]),
        ("onset", 60, 63, [0, 1, 3]),
        ("relief", 109, 114, [0, 3]),
    ]


def test_one_rank_alone_opens_nothing_and_a_relief_needs_an_open_onset() -> None:
    state = DemoState(DemoOptions())
    _feed(state, [
        (3, "onset", 28, 30, 0.133),
        (2, "relief", 35, 36, -0.1),  # nothing is open: not a vote
        (1, "onset", 60, 62, 0.2),  # 32 iterations after rank 3's vote: the window has passed
    ])
    assert state.detected == []
    _feed(state, [(2, "onset", 61, 64, 0.25)])
    assert [(e.type, e.ranks) for e in state.detected] == [("onset", [1, 2])]
    # the ranks of the open onset repeating it at once is not a further step until a quorum
    _feed(state, [(1, "relief", 110, 112, -0.2), (2, "onset", 111, 113, 0.1)])
    assert [e.type for e in state.detected] == ["onset"]
    _feed(state, [(2, "relief", 111, 114, -0.2)])
    assert [e.type for e in state.detected] == ["onset", "relief"]
