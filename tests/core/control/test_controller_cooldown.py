"""The controller's cooldown after a round: onsets in it are absorbed, but not lost after a
false alarm (seen in the Accelerate demo: a noisy onset 10 steps before the injected fail-slow
was validated healthy, the real onsets came within the 30 s cooldown, and the fail-slow was
never validated)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
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


def _report(
    store: Store, kind: str, iteration: int, before_s: float = 0.2, after_s: float = 0.3
) -> None:
    n = store.add(f"{keys.NODE}/onsets", 1)
    record: dict[str, Any] = {
        "type": kind, "rank": 0, "iteration": iteration, "wall": time.time(),
        "before_s": before_s, "after_s": after_s,
    }  # fmt: skip
    store.set_json(f"{keys.NODE}/onsets/{n}", record)


def _after_round(
    store: Store, *, healthy: bool, mitigating: Callable[[], bool] | None = None
) -> Controller:
    """A controller whose round on an onset from 0.2 s to 0.3 s just ended."""
    controller = Controller(
        store, world_size=1, detection=DetectionConfig(cooldown_s=COOLDOWN_S),
        mitigation_active=mitigating,
    )  # fmt: skip
    slow = Diagnosis(Kind.COMPUTE, slow_ranks=(SlowRank(0, 3.0),))
    controller._onsets = [{"type": "onset", "rank": 0, "before_s": 0.2, "after_s": 0.3}]
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


def test_an_onset_from_the_diagnosed_slow_level_is_localized_at_once(store: Store) -> None:
    """A step up on top of the diagnosed fail-slow (a ladder's next rung, a second fault) is
    new: a round starts in the cooldown, the line moves to the new level, and the onsets of
    the diagnosed change that other ranks report late (from the healthy 0.2 s) stay absorbed."""
    controller = _after_round(store, healthy=False)
    _report(store, "onset", 61, before_s=0.21, after_s=0.3)  # the same change, reported late
    assert controller.tick() is State.TRACKING
    _report(store, "onset", 70, before_s=0.3, after_s=0.6)  # from the slow level: new
    assert controller.tick() is State.PROFILING
    assert [o["iteration"] for o in controller._onsets] == [70]
    controller._pending = Diagnosis(Kind.COMPUTE, slow_ranks=(SlowRank(0, 3.0),))
    controller._publish()  # that round ends: its onsets started from 0.3 s
    _report(store, "onset", 75, before_s=0.31, after_s=0.4)  # under 1.1 x 0.3: absorbed
    assert controller.tick() is State.TRACKING


def test_while_a_plan_is_bought_a_compound_onset_revalidates_and_a_relief_clears_the_line(
    store: Store,
) -> None:
    """With a mitigation active, a step up from the diagnosed level re-validates before the
    periodic round is due; after a relief no onset is a compound one."""
    controller = _after_round(store, healthy=False, mitigating=lambda: True)
    _report(store, "onset", 61, before_s=0.2, after_s=0.3)
    assert controller.tick() is State.TRACKING  # not due, not compound
    _report(store, "onset", 70, before_s=0.3, after_s=0.6)
    assert controller.tick() is State.PROFILING
    assert controller.history[-1].detail == {"recheck": "compound"}

    controller = _after_round(store, healthy=False, mitigating=lambda: True)
    _report(store, "relief", 80, before_s=0.3, after_s=0.2)
    assert controller.tick() is State.TRACKING  # the relief came within the cooldown
    assert controller._slow_from is None
    _report(store, "onset", 90, before_s=0.3, after_s=0.6)  # a new fail-slow, not a rung
    assert controller.tick() is State.PROFILING
    assert "recheck" not in controller.history[-1].detail


def test_a_healthy_round_an_onset_started_while_a_plan_is_in_effect_is_a_relief(
    store: Store,
) -> None:
    """Seen in the DeepSpeed demo: after the release, a relief reset the cooldown, the next
    onset's round (not a periodic re-validation) found every rank healthy - and the S2 split
    stayed in effect, since only a re-validation told the mitigator. Any healthy round while a
    mitigation is active does now; without one, a healthy round is a false alarm only."""
    healthy: list[bool] = []

    def round_on_an_onset(mitigating: bool) -> None:
        controller = Controller(
            store, world_size=1, detection=DetectionConfig(cooldown_s=COOLDOWN_S),
            mitigation_active=lambda: mitigating, on_healthy=lambda: healthy.append(mitigating),
        )  # fmt: skip
        controller._onsets = [{"type": "onset", "rank": 0, "before_s": 0.2, "after_s": 0.3}]
        controller._pending = None  # every rank measured healthy
        controller._publish()

    round_on_an_onset(mitigating=False)
    assert healthy == []
    round_on_an_onset(mitigating=True)
    assert healthy == [True]
