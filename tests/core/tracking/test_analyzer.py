"""LocalAnalyzer over real ring files: iteration times, onset/relief, restarted ranks."""

from __future__ import annotations

import numpy as np

from failslow.core.events import OpCode
from failslow.core.ring import RingWriter, ring_path
from failslow.core.tracking.analyzer import LocalAnalyzer


def _write_steps(writer: RingWriter, durations: np.ndarray, t0: int = 0) -> int:
    t = t0
    for d in durations:
        step = int(d * 1e9)
        for k, nbytes in enumerate((4 << 20, 1 << 20)):
            start = t + (k + 1) * step // 3
            writer.write(t_start_ns=start, t_end_ns=start + step // 10, nbytes=nbytes,
                         group_key=11, op=OpCode.ALLREDUCE)
        t += step
    return t


def test_detects_onset_and_relief_per_rank(tmp_path) -> None:
    rng = np.random.default_rng(4)
    times = 0.3 * (1 + 0.02 * rng.standard_normal(300))
    times[120:200] *= 1.5
    writers = [RingWriter(ring_path(tmp_path, r, 100 + r), capacity=1 << 12, global_rank=r)
               for r in range(2)]
    analyzer = LocalAnalyzer(tmp_path)
    events = {0: [], 1: []}
    for chunk in np.array_split(np.arange(300), 30):  # training progresses between polls
        for w in writers:
            _write_steps(w, times[chunk], t0=int(times[: chunk[0]].sum() * 1e9))
        for update in analyzer.poll():
            events[update.rank].extend(e.type for e in update.events)
    assert events == {0: ["onset", "relief"], 1: ["onset", "relief"]}
    state = analyzer.ranks[0]
    assert 290 <= state.iterations <= 300
    np.testing.assert_allclose(np.median(state.iteration_times[:100]), 0.3, rtol=0.02)
    assert analyzer.dropped() == 0
    analyzer.close()


def test_restarted_rank_gets_a_fresh_state(tmp_path) -> None:
    first = RingWriter(ring_path(tmp_path, 0, 1), capacity=1 << 10, global_rank=0)
    _write_steps(first, np.full(60, 0.2))
    analyzer = LocalAnalyzer(tmp_path)
    analyzer.poll()
    assert analyzer.ranks[0].iterations > 0
    first.path.unlink()  # the old process is gone; its replacement writes a new ring
    second = RingWriter(ring_path(tmp_path, 0, 2), capacity=1 << 10, global_rank=0)
    analyzer.poll()
    assert analyzer.ranks[0].reader.path == second.path
    assert analyzer.ranks[0].iterations == 0
    analyzer.close()
