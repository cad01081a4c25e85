"""The controller's cooldown after a round: onsets in it are absorbed, but not lost after a
false alarm (seen in the Accelerate demo: a noisy onset 10 steps before the injected fail-slow
was validated healthy, the real onsets came within the 30 s cooldown, and the fail-slow was
never validated)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from failslow.core.control import keys
from failslow.core.control.controller import Controller, State
from failslow.core.control.store import Store, open_store
from failslow.core.diagnosis.record import Diagnosis, Kind, SlowRank
from failslow.core.localize.config import DetectionConfig

pytestmark = pytest.mark.timeout(60)
COOLDOWN_S = 0.5


@pytest.fixture
def store() -> Iterator[Store]:
    master = open_store("tcp://127.0.0.1:0?master=1")
    try:
        yield master
    finally:
        master.close()


def _report(store: Store, kind: str, iteration: int) -> None:
    n = store.add(f"{keys.NODE}/onsets", 1)
    record: dict[str, Any] = {"type": kind, "rank": 0, "iteration": iteration, "wall": time.time()}
    store.set_json(f"{keys.NODE}/onsets/{n}", record)


def _after_round(store: Store, *, healthy: bool) -> Controller:
    controller = Controller(store, world_size=1, detection=DetectionConfig(cooldown_s=COOLDOWN_S))
    slow = Diagnosis(Kind.COMPUTE, slow_ranks=(SlowRank(0, 3.0),))
    controller._pending = None if healthy else slow
    controller._publish()  # the round ends now (DIAGNOSED -> TRACKING)
    assert controller.state is State.TRACKING
    return controller


def test_onsets_in_the_cooldown_after_a_healthy_round_are_validated_when_it_ends(
    store: Store,
) -> None:
    controller = _after_round(store, healthy=True)
    _report(store, "onset", 60)
    assert controller.tick() is State.TRACKING  # absorbed: too soon after the round
    time.sleep(COOLDOWN_S + 0.1)
    assert controller.tick() is State.PROFILING  # no relief came: the job is still slow
    assert [o["iteration"] for o in controller._onsets] == [60]


def test_a_relief_in_the_cooldown_drops_the_held_onsets(store: Store) -> None:
    controller = _after_round(store, healthy=True)
    _report(store, "onset", 60)
    assert controller.tick() is State.TRACKING
    _report(store, "relief", 64)
    controller.tick()
    time.sleep(COOLDOWN_S + 0.1)
    assert controller.tick() is State.TRACKING


def test_onsets_in_the_cooldown_after_a_diagnosis_stay_absorbed(store: Store) -> None:
    controller = _after_round(store, healthy=False)
    _report(store, "onset", 60)  # the diagnosed fail-slow's own ladder
    assert controller.tick() is State.TRACKING
    time.sleep(COOLDOWN_S + 0.1)
    assert controller.tick() is State.TRACKING
