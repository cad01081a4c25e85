"""LocalAnalyzer over real ring files: iteration times, onset/relief, restarted ranks."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from failslow.core.events import OpCode
from failslow.core.ring import RingWriter, ring_path
from failslow.core.tracking.analyzer import LocalAnalyzer


def _write_steps(writer: RingWriter, durations: np.ndarray, t0: int = 0) -> int:
    t = t0
    for d in durations:
        step = int(d * 1e9)
        for k, nbytes in enumerate((4 << 20, 1 << 20)):
            start = t + (k + 1) * step // 3
            writer.write(
                t_start_ns=start,
                t_end_ns=start + step // 10,
                nbytes=nbytes,
                group_key=11,
                op=OpCode.ALLREDUCE,
            )
        t += step
    return t


def test_detects_onset_and_relief_per_rank(tmp_path) -> None:
    rng = np.random.default_rng(4)
    times = 0.3 * (1 + 0.02 * rng.standard_normal(300))
    times[120:200] *= 1.5
    writers = [
        RingWriter(ring_path(tmp_path, r, 100 + r), capacity=1 << 12, global_rank=r)
        for r in range(2)
    ]
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


def _restart(tmp_path, after: np.ndarray, carry: bool) -> list[str]:
    """A rank's 80 iterations at 0.2 s (2% noise), then its restarted process's ``after``,
    polled as the node publisher does; the events of the restarted rank."""
    rng = np.random.default_rng(7)
    before = 0.2 * (1 + 0.02 * rng.standard_normal(80))
    first = RingWriter(ring_path(tmp_path, 0, 1), capacity=1 << 12, global_rank=0)
    analyzer = LocalAnalyzer(tmp_path, keep_history=False)
    t = 0
    for chunk in np.array_split(before, 8):
        t = _write_steps(first, chunk, t0=t)
        analyzer.poll()
    assert analyzer.ranks[0].iterations >= 70 and not analyzer.ranks[0].events
    analyzer.carry_over(carry)  # what the launcher says before it relaunches
    first.path.unlink()
    second = RingWriter(ring_path(tmp_path, 0, 2), capacity=1 << 12, global_rank=0)
    events = []
    for chunk in np.array_split(after, 10):
        t = _write_steps(second, chunk, t0=t + int(3e9))
        for update in analyzer.poll():
            events += [e.type for e in update.events]
    assert analyzer.ranks[0].reader.path == second.path
    analyzer.close()
    return events


@pytest.mark.parametrize("carry", [True, False])
def test_a_slower_standby_is_seen_when_the_launcher_carries_the_detector_over(
    tmp_path, carry: bool
) -> None:
    """After a restart of the same job (a fail-stop onto a standby), the rank's detector goes
    on: a standby 30% slower is an onset. A fresh detector (a new layout, an update) would learn
    the slow level as the job's own and never see it."""
    rng = np.random.default_rng(8)
    after = 0.26 * (1 + 0.02 * rng.standard_normal(60))
    after[:2] = 0.6  # the restart's first iterations (restore, lazy allocations): left out
    events = _restart(tmp_path, after, carry)
    assert events == (["onset"] if carry else [])


def test_a_restart_carried_over_at_the_same_speed_raises_nothing(tmp_path) -> None:
    rng = np.random.default_rng(9)
    after = 0.2 * (1 + 0.02 * rng.standard_normal(60))
    after[:2] = 0.6
    assert _restart(tmp_path, after, carry=True) == []


def test_an_idle_poll_does_not_list_the_directory(tmp_path, monkeypatch) -> None:
    """A poll with nothing new costs a stat of the ring directory, not a listing; a ring
    created later is still found on the next poll."""
    import failslow.core.tracking.analyzer as analyzer_module

    listings = []
    real = analyzer_module.find_rings
    monkeypatch.setattr(analyzer_module, "find_rings", lambda d: listings.append(d) or real(d))
    writer = RingWriter(ring_path(tmp_path, 0, 1), capacity=1 << 10, global_rank=0)
    _write_steps(writer, np.full(40, 0.2))
    settled = time.time() - 5  # a directory last changed 5 s ago
    os.utime(tmp_path, (settled, settled))
    analyzer = LocalAnalyzer(tmp_path)
    analyzer.poll()
    assert analyzer.records_seen == 80 and len(listings) == 1
    for _ in range(5):
        analyzer.poll()
    assert analyzer.records_seen == 0 and len(listings) == 1
    RingWriter(ring_path(tmp_path, 1, 2), capacity=1 << 10, global_rank=1)
    analyzer.poll()
    assert len(listings) == 2 and set(analyzer.ranks) == {0, 1}
    analyzer.poll()  # the change is under a second old: listed again, in case of a same-tick
    assert len(listings) == 3  # creation that left the directory time unchanged
    analyzer.close()


def test_a_ring_created_in_the_same_timestamp_tick_is_found(tmp_path) -> None:
    """Two rings created within one tick of a coarse file-system clock: the directory time
    does not change for the second, which is still found on a later poll."""
    RingWriter(ring_path(tmp_path, 0, 1), capacity=1 << 10, global_rank=0)
    stamp = os.stat(tmp_path).st_mtime_ns
    analyzer = LocalAnalyzer(tmp_path)
    analyzer.poll()
    RingWriter(ring_path(tmp_path, 1, 2), capacity=1 << 10, global_rank=1)
    os.utime(tmp_path, ns=(stamp, stamp))  # as if both were created in the same tick
    analyzer.poll()
    assert set(analyzer.ranks) == {0, 1}
    analyzer.close()


def test_the_publisher_backs_off_while_nothing_arrives(tmp_path, monkeypatch) -> None:
    """Between steps or before the job starts, the node publisher's wait doubles up to
    ``idle_s``; records bring it back to ``poll_s`` while no iteration time is known, and to
    three iterations while every rank is calm, one as soon as the newest iteration is slow
    (within ``poll_s`` .. ``idle_s``): a poll's cost is mostly per poll."""
    from failslow.core.control.store import open_store
    from failslow.node import publisher as publisher_module

    store = open_store("tcp://127.0.0.1:0?master=1")
    writer = RingWriter(ring_path(tmp_path, 0, 1), capacity=1 << 10, global_rank=0)
    pub = publisher_module.NodePublisher(LocalAnalyzer(tmp_path), store)
    assert pub.step_time() is None  # no iteration yet
    waits: list[float] = []
    t = 0

    def sleep(s: float) -> None:
        nonlocal t
        waits.append(s)
        if len(waits) == 6:  # training resumes: too few calls for the period yet
            t = _write_steps(writer, np.full(5, 0.08))
        if len(waits) == 9:  # enough calls: iterations of 0.08 s
            t = _write_steps(writer, np.full(60, 0.08), t)
        if len(waits) == 11:  # two slower steps: the newest iteration is 1.5x
            t = _write_steps(writer, np.full(2, 0.12), t)
        if len(waits) == 13:  # iterations of 0.5 s
            _write_steps(writer, np.full(20, 0.5), t)

    monkeypatch.setattr(pub.wake, "wait", sleep)  # the wait between polls
    try:
        pub.run(lambda: len(waits) >= 15, poll_s=0.05, idle_s=0.2)
    finally:
        store.close()
    assert waits[:9] == [0.1, 0.2, 0.2, 0.2, 0.2, 0.2, 0.05, 0.1, 0.2]
    assert waits[9] == pytest.approx(0.24, rel=0.01)  # calm: three iterations
    assert waits[10] == 0.2  # nothing new: doubled, at most idle_s
    assert waits[11] == pytest.approx(0.08, rel=0.01)  # the newest is slow: one iteration
    assert waits[12] == pytest.approx(0.16, rel=0.01)  # nothing new: doubled
    assert waits[13] == 0.2  # one iteration, at most idle_s
    assert pub.iterations[0] > 60
    assert pub.step_time() == pytest.approx(0.5, rel=0.01)  # the node's step time now
    # Calm with 0.5 s iterations: three of them, at most calm_s (another node's controller
    # waits 0.75 s for the summaries), never less than the wait while not calm.
    monkeypatch.setattr(LocalAnalyzer, "quiet", property(lambda self: True))
    assert pub.next_wait(0.05, 0.2) == 0.45
    assert pub.next_wait(0.05, 30.0) == pytest.approx(1.5, rel=0.01)
    pub._iteration_s = 0.1
    assert pub.next_wait(0.05, 0.2) == pytest.approx(0.3, rel=0.01)


def test_the_publisher_tells_its_process_when_it_wrote_an_event(tmp_path) -> None:
    """``on_event`` (a controller in the same process wakes on it) is called after each poll
    that wrote onsets or reliefs, and after no other."""
    from failslow.core.control.store import open_store
    from failslow.node.publisher import NodePublisher

    times = np.full(240, 0.2)
    times[120:200] *= 1.6
    writer = RingWriter(ring_path(tmp_path, 0, 1), capacity=1 << 12, global_rank=0)
    store = open_store("tcp://127.0.0.1:0?master=1")
    try:
        pub = NodePublisher(LocalAnalyzer(tmp_path), store)
        calls: list[int] = []
        pub.on_event = lambda: calls.append(len(polls_with_events))
        polls_with_events: list[int] = []
        for chunk in np.array_split(np.arange(240), 24):
            _write_steps(writer, times[chunk], t0=int(times[: chunk[0]].sum() * 1e9))
            if any(u.events for u in pub.poll()):
                polls_with_events.append(1)
        assert len(polls_with_events) == 2  # the onset's poll and the relief's
        assert calls == [0, 1]  # once each, during that poll
    finally:
        store.close()


def test_a_transient_publishes_no_event_and_is_counted(tmp_path) -> None:
    """Issue 47: a noisy neighbour's seven iterations at 1.7x pass verification but are over
    before they persisted - no onset in the store (no profiling round, no validation pause),
    and the rank's state (``failslow top``, ``failslow_rank_transients_total``) counts it."""
    from failslow.core.control.store import open_store
    from failslow.node.publisher import NodePublisher

    times = 0.2 * np.exp(0.01 * np.random.default_rng(3).standard_normal(240))
    times[150:157] *= 1.7
    writer = RingWriter(ring_path(tmp_path, 0, 1), capacity=1 << 12, global_rank=0)
    store = open_store("tcp://127.0.0.1:0?master=1")
    try:
        pub = NodePublisher(LocalAnalyzer(tmp_path), store)
        t = 0
        for chunk in np.array_split(times, 12):
            t = _write_steps(writer, chunk, t0=t)
            assert not any(u.events for u in pub.poll())
        assert store.add(f"{pub.prefix}/onsets", 0) == 0
        assert pub.rank_states()[0]["transients"] == 1
    finally:
        store.close()


def test_summaries_are_published_when_the_controller_asks_and_only_then(tmp_path) -> None:
    """No group summary is made while nobody profiles (they were a quarter of the node's
    tracking CPU). A request is answered with the summaries of that moment and the number of
    ranks answered, which is what the controller waits for: by a publisher in the controller's
    process at once (asked directly, its long wait cut short), by one on another node at its
    next poll (it reads the request counter). Nobody answering ends the wait too."""
    import threading

    from failslow.core.control import keys
    from failslow.core.control.controller import Controller
    from failslow.core.control.store import open_store
    from failslow.node.publisher import NodePublisher

    writers = [RingWriter(ring_path(tmp_path, r, 1 + r), capacity=1 << 12, global_rank=r)
               for r in range(2)]  # fmt: skip
    for w in writers:
        _write_steps(w, np.full(60, 0.2))
    store = open_store("tcp://127.0.0.1:0?master=1")
    done = threading.Event()
    pub = NodePublisher(LocalAnalyzer(tmp_path), store)
    node = threading.Thread(target=lambda: None)
    try:
        pub.poll()
        assert store.keys(f"{keys.NODE}/summaries/") == []
        assert store.keys(f"{keys.NODE}/ranks/") == [f"{keys.NODE}/ranks/{r}" for r in range(2)]
        controller = Controller(store, world_size=2)
        controller.summary_wait_s = 5.0
        for here, idle_s in ((True, 30.0), (False, 0.2)):
            pub.asked_here = here
            controller.wake_publisher = pub.ask if here else None
            done.clear()
            node = threading.Thread(target=pub.run, args=(done.is_set,), kwargs={"idle_s": idle_s})
            node.start()
            time.sleep(0.3)  # the publisher waits between polls now
            store.delete(f"{keys.NODE}/summaries/0")
            t0 = time.monotonic()
            assert controller.request_summaries() == 2, here  # both ranks answered
            assert time.monotonic() - t0 < 2.0, here  # not after a 30 s wait
            for r in range(2):
                summaries = store.get_json(f"{keys.NODE}/summaries/{r}")
                assert summaries and {s["rank"] for s in summaries} == {r}, here
            done.set()
            pub.wake.set()
            node.join(10)
        controller.summary_wait_s = 0.2
        assert controller.request_summaries() == 0  # nobody answers: the wait ends
        pub._answered = 50  # as if the store restarted: its counter is lower than answered
        n = store.add(f"{keys.NODE}/{keys.PROFILE}", 0)
        pub.poll()
        assert store.add(f"{keys.NODE}/{keys.PROFILE}/{n}/ranks", 0) == 2
    finally:
        done.set()
        pub.wake.set()
        node.join(10)
        store.close()
        for w in writers:
            w.close()


def test_the_shim_ring_and_the_hook_ring_of_one_process_are_read_as_one(tmp_path) -> None:
    """Under the C shim the Python hook writes its step markers (and non-NCCL calls) into a
    second ring of the same process: the rank's iterations come from both rings together."""
    durations = np.full(80, 0.2)
    shim = RingWriter(ring_path(tmp_path, 0, 7), capacity=1 << 10, global_rank=0)
    hook = RingWriter(ring_path(tmp_path, 0, 7, "py"), capacity=1 << 10, global_rank=0)
    _write_steps(shim, durations)
    for k in range(1, durations.size + 1):  # each step's end, shortly before the next starts
        t = int(k * 0.2e9) - 1000
        hook.write(t_start_ns=t, t_end_ns=t, nbytes=0, group_key=5, op=OpCode.STEP)
    analyzer = LocalAnalyzer(tmp_path)
    analyzer.poll()
    assert list(analyzer.ranks) == [0]
    state = analyzer.ranks[0]
    assert sorted(r.path for r in state.readers) == sorted([shim.path, hook.path])
    assert state.tracker.marked
    np.testing.assert_allclose(state.iteration_times, 0.2, rtol=1e-6)
    assert state.iterations >= durations.size - 3  # the last ones wait for the reorder horizon
    assert analyzer.dropped() == 0
    analyzer.close()


def test_a_ring_that_keeps_its_settled_word_is_tracked_without_the_horizon_lag(tmp_path) -> None:
    """The Python hook's rings say which calls can still arrive (``settled_ns``): iterations
    reach the detector as soon as they are written, even after a call long enough to hold
    everything behind the reorder horizon of a ring that does not say."""

    def steps(writer: RingWriter, keep_settled: bool) -> None:
        for i in range(60):
            for k, nbytes in enumerate((4 << 20, 1 << 20)):
                token, t = writer.begin() if keep_settled else (None, time.monotonic_ns())
                long = i == 5 and k == 0  # one all-reduce that waited 30 s for a straggler
                writer.write(
                    t_start_ns=t, t_end_ns=t + (30 * 10**9 if long else 1000), nbytes=nbytes,
                    group_key=11, op=OpCode.ALLREDUCE, token=token,
                )

    told = RingWriter(ring_path(tmp_path, 0, 1), capacity=1 << 10, global_rank=0)
    guessing = RingWriter(ring_path(tmp_path, 1, 2), capacity=1 << 10, global_rank=1)
    steps(told, True)
    steps(guessing, False)
    analyzer = LocalAnalyzer(tmp_path)
    analyzer.poll()
    assert analyzer.ranks[0].iterations >= 58  # every step but the open last one
    assert analyzer.ranks[1].iterations < 10  # held behind a 45 s horizon
    assert analyzer.dropped() == 0
    analyzer.close()


@pytest.mark.parametrize("eval_calls", [0, 3])
def test_the_first_eval_step_is_left_out_by_the_calls_it_made(tmp_path, eval_calls) -> None:
    """Tracking v2 (issue 19): the job's first eval step (three iterations at 1.6x) with a GC
    pause right after it is four slow points at one level - a verified change on times alone,
    and since issue 47 a transient (over before it persisted), never an onset. Where the eval
    made its own calls (three all-reduces per iteration, between the step markers), the
    analyzer leaves its iterations out and sees nothing at all."""
    rng = np.random.default_rng(5)
    durations = 0.2 * np.exp(0.01 * rng.standard_normal(300))
    durations[150:154] *= 1.6
    writer = RingWriter(ring_path(tmp_path, 0, 3), capacity=1 << 12, global_rank=0)
    t = 0
    for i, d in enumerate(durations):
        step = int(d * 1e9)
        extra = eval_calls if 150 <= i < 153 else 0
        for k in range(2 + extra):
            start = t + (k + 1) * step // (4 + extra)
            writer.write(
                t_start_ns=start, t_end_ns=start + 1000, nbytes=4 << 20 if k < 2 else 8,
                group_key=11, op=OpCode.ALLREDUCE,
            )  # fmt: skip
        t += step
        writer.write(t_start_ns=t - 1000, t_end_ns=t - 1000, nbytes=0, group_key=5, op=OpCode.STEP)
    analyzer = LocalAnalyzer(tmp_path)
    analyzer.poll()
    state = analyzer.ranks[0]
    assert state.tracker.marked and state.iterations >= 290
    assert state.events == []
    transients = [(t.start, t.end) for t in state.detector.transients]
    if eval_calls:
        assert transients == []
    else:  # the candidate may begin a point early (a slowdown that ramps up)
        [(start, end)] = transients
        assert 149 <= start <= 150 and 153 <= end <= 154
    assert state.detector.skipped == (3 if eval_calls else 0)
    analyzer.close()
