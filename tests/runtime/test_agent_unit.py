"""RankAgent and validation_round logic against a real in-process TCPStore (no torch job)."""

from __future__ import annotations

import time

import pytest

from failslow.core.control.store import open_store
from failslow.core.control.validator import PauseMissed, validation_round
from failslow.runtime.agent import RankAgent


@pytest.fixture
def store():
    s = open_store("tcp://127.0.0.1:0?master=1")
    yield s
    s.close()


def test_agent_arms_its_trap_ahead_of_its_position_and_reports_a_missed_target(store):
    words: dict[str, int] = {}
    position = [7, 40]  # group key 7, next call_index 40
    agent = RankAgent(
        store,
        rank=0,
        set_header_word=words.__setitem__,
        position=lambda: (position[0], position[1]),
    )
    store.set_json("failslow/validate/pause", {"epoch": 1, "group_key": 7, "call_index": 45})
    assert agent.check_request()
    assert words == {"pause_group": 7, "pause_call": 45, "control": 1}
    words.clear()
    store.set_json("failslow/validate/pause", {"epoch": 2, "group_key": 7, "call_index": 39})
    assert not agent.check_request() and words == {}  # passed already: never parks elsewhere
    assert store.add("failslow/validate/2/missed", 0) == 1


def test_round_with_a_missed_target_is_released_at_once(store):
    agents = []
    for rank, next_index in enumerate((10, 30)):  # rank 1 is past any target below 30
        words: dict[str, int] = {}
        agents.append(
            RankAgent(
                store,
                rank=rank,
                set_header_word=words.__setitem__,
                position=lambda n=next_index: (3, n),
                poll_s=0.02,
            ).start()
        )
    started = time.monotonic()
    with pytest.raises(PauseMissed, match="past call 20"):
        validation_round(store, world_size=2, group_key=3, call_index=20, tasks=[], timeout_s=20)
    assert time.monotonic() - started < 5
    epoch = store.add("failslow/validate/epoch", 0)
    assert store.get(f"failslow/validate/{epoch}/release") is not None
    for agent in agents:
        agent.stop()


def test_a_restarted_rank_ignores_a_round_that_already_ended(store):
    """A process restarted in place (hot update) must not park for a pause request left in
    the store by a round that was released before it started."""
    words: dict[str, int] = {}
    store.set_json("failslow/validate/pause", {"epoch": 3, "group_key": 7, "call_index": 45})
    store.set("failslow/validate/3/release", b"1")
    agent = RankAgent(store, rank=0, set_header_word=words.__setitem__, position=lambda: (7, 0))
    assert not agent.check_request() and words == {}
    store.set_json("failslow/validate/pause", {"epoch": 4, "group_key": 7, "call_index": 45})
    assert agent.check_request() and words["control"] == 4  # a new round still arms it


def test_an_agent_with_a_job_token_ignores_pause_requests_without_it(store):
    words: dict[str, int] = {}
    agent = RankAgent(
        store, rank=0, set_header_word=words.__setitem__, position=lambda: (7, 40), token="tok"
    )
    store.set_json("failslow/validate/pause", {"epoch": 1, "group_key": 7, "call_index": 45})
    assert not agent.check_request() and words == {}
    request = {"epoch": 2, "group_key": 7, "call_index": 45, "token": "nope"}
    store.set_json("failslow/validate/pause", request)
    assert not agent.check_request() and words == {}
    store.set_json("failslow/validate/pause", {**request, "epoch": 3, "token": "tok"})
    assert agent.check_request() and words["control"] == 3


def test_step_pause_parks_every_rank_at_one_step_boundary_and_runs_the_tasks(store):
    """Session-driven ranks publish their step; a round aimed at step S parks each of them at
    the boundary of S (whatever group it last called), runs the tasks there, releases."""
    import threading

    class FakeRank:
        def __init__(self, rank: int, step: int) -> None:
            self.step, self.words, self.parked_at = step, {}, []
            self.agent = RankAgent(
                store,
                rank=rank,
                set_header_word=self.words.__setitem__,
                steps=lambda: self.step,
                park=self.park,
                poll_s=0.02,
                check_every_s=0.0,
            )
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self.train, daemon=True)

        def park(self) -> None:  # the trap's park: run the agent until released
            self.parked_at.append(self.step + 1)  # parked at the boundary of the next step
            while self.words.get("control") and not self.stop.is_set():
                self.agent.while_parked()
                time.sleep(0.005)

        def train(self) -> None:
            while not self.stop.is_set() and self.step < 10_000:
                self.agent.at_step(self.step + 1)  # the session's boundary, then the step
                self.step += 1
                time.sleep(0.01)

    ranks = [FakeRank(0, 5), FakeRank(1, 3)]  # rank 1 is two steps behind
    for r in ranks:
        r.agent.start()
    time.sleep(0.1)  # positions published before any rank trains
    progress = [store.get_json(f"failslow/validate/progress/{r}") for r in range(2)]
    assert [p["step"] for p in progress] == [5, 3]
    try:
        for r in ranks:
            r.thread.start()
        target = max(r.step for r in ranks) + 40
        result = validation_round(
            store,
            world_size=2,
            step=target,
            tasks=[{"kind": "gemm", "size": 32, "dtypes": ["float32"], "repetitions": 1}],
            timeout_s=20,
        )
        assert [r.parked_at for r in ranks] == [[target], [target]]
        (gemm,) = result.results
        assert sorted(gemm) == [0, 1] and all("ok" in v for v in gemm.values())
    finally:
        for r in ranks:
            r.stop.set()
            r.agent.stop()


def test_a_step_pause_behind_a_rank_is_missed_and_released_at_once(store):
    words: dict[str, int] = {}
    agent = RankAgent(
        store, rank=0, set_header_word=words.__setitem__, steps=lambda: 12, park=lambda: None,
        poll_s=0.02,
    ).start()  # fmt: skip
    with pytest.raises(PauseMissed, match="boundary of step 10"):
        validation_round(store, world_size=1, step=10, tasks=[], timeout_s=20)
    assert words == {}
    agent.stop()


def test_a_step_target_armed_by_an_older_round_does_not_park_for_a_newer_one(store):
    words: dict[str, int] = {}
    parks: list[int] = []
    agent = RankAgent(
        store, rank=0, set_header_word=words.__setitem__, steps=lambda: 3,
        park=lambda: parks.append(words["control"]), position=lambda: (7, 40),
    )  # fmt: skip
    store.set_json("failslow/validate/pause", {"epoch": 1, "step": 10})
    assert agent.check_request()
    store.set_json("failslow/validate/pause", {"epoch": 2, "group_key": 7, "call_index": 45})
    assert agent.check_request() and words["control"] == 2
    words.clear()
    agent.at_step(10)  # the old step target is gone: no park at this boundary
    assert parks == [] and words == {}
    store.set_json("failslow/validate/pause", {"epoch": 3, "step": 10})
    assert agent.check_request()
    agent.at_step(9)
    assert parks == []
    agent.at_step(10)
    assert parks == [3] and words["pause_group"] == 0


def test_the_published_step_rate_holds_between_step_changes(store):
    step = [5]
    agent = RankAgent(store, rank=0, set_header_word=lambda *_: None, steps=lambda: step[0],
                      park=lambda: None)  # fmt: skip
    agent.publish_position()
    time.sleep(0.1)
    step[0] = 6
    agent.publish_position()
    first = store.get_json("failslow/validate/progress/0")["step_rate"]
    assert 2.0 < first < 20.0  # one step in ~0.1 s
    agent.publish_position()  # the step has not moved since: the rate is still known
    assert store.get_json("failslow/validate/progress/0")["step_rate"] == first
