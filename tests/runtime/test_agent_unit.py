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
