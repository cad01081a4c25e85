"""ReorderBuffer: completion-ordered records come out in issue order, nothing silently lost."""

from __future__ import annotations

import numpy as np

from failslow.core.events import RECORD_DTYPE
from failslow.core.tracking.reorder import ReorderBuffer


def _recs(pairs: list[tuple[int, int]]) -> np.ndarray:
    out = np.zeros(len(pairs), dtype=RECORD_DTYPE)
    out["t_start_ns"] = [a for a, _ in pairs]
    out["t_end_ns"] = [b for _, b in pairs]
    return out


def test_overlapping_calls_are_released_in_issue_order() -> None:
    rng = np.random.default_rng(0)
    starts = np.cumsum(rng.integers(1, 50, 2000))
    ends = starts + rng.integers(1, 400, 2000)  # long calls overlap many later ones
    order = np.argsort(ends, kind="stable")  # the ring's (completion) order
    buf = ReorderBuffer()
    out = []
    for chunk in np.array_split(order, 200):
        out.append(buf.push(_recs(list(zip(starts[chunk], ends[chunk], strict=True)))))
    out.append(buf.flush())
    got = np.concatenate(out)["t_start_ns"]
    assert np.all(np.diff(got) >= 0)
    assert len(got) + buf.late == 2000
    assert buf.late <= 20  # only calls longer than any seen before can arrive too late


def test_records_without_completion_time_pass_through_in_order() -> None:
    buf = ReorderBuffer()
    first = buf.push(_recs([(10, 0), (20, 0), (30, 0)]))
    second = buf.push(_recs([(40, 0)]))
    released = np.concatenate([first, second, buf.flush()])["t_start_ns"]
    assert list(released) == [10, 20, 30, 40]


def test_a_late_record_is_dropped_and_counted_not_reordered() -> None:
    buf = ReorderBuffer()
    buf.push(_recs([(100, 110), (200, 210)]))
    buf.push(_recs([(300, 310), (400, 410)]))
    late = buf.push(_recs([(50, 5000)]))  # started long ago, completed just now
    assert 50 not in late["t_start_ns"]
    assert buf.late == 1


def test_the_writers_settled_word_releases_records_at_once() -> None:
    """One long call (a healthy rank's all-reduce waiting for a straggler) sizes the horizon;
    with the writer's word, records that started before it are final at once."""
    guessing, told = ReorderBuffer(), ReorderBuffer()
    history = _recs([(0, 1000)])  # a 1000 ns call seen once
    guessing.push(history)
    told.push(history, settled_ns=1001)
    batch = _recs([(1100, 1110), (1200, 1210), (1300, 1310)])
    assert len(guessing.push(batch)) == 0  # all within 1.5 x 1000 ns of the newest end
    got = told.push(batch, settled_ns=1311)
    assert list(got["t_start_ns"]) == [1100, 1200, 1300]


def test_a_settled_word_stuck_behind_a_call_that_never_completes_falls_back() -> None:
    buf = ReorderBuffer()
    out = [buf.push(_recs([(t, t + 10)]), settled_ns=50) for t in range(100, 2000, 100)]
    released = np.concatenate(out)["t_start_ns"]
    assert len(released) >= 15 and buf.late == 0  # the horizon keeps the stream going
