"""A controller and a node publisher in one process (``failslow run`` hosts both): the
controller's loop ticks as soon as the publisher has written an onset, not a tick later."""

from __future__ import annotations

import threading
import time

import pytest

from failslow.core.control.controller import Controller
from failslow.core.control.store import open_store

pytestmark = pytest.mark.timeout(60)


def test_the_controller_ticks_at_once_when_woken() -> None:
    store = open_store("tcp://127.0.0.1:0?master=1")
    try:
        controller = Controller(store, world_size=1)
        ticks: list[float] = []
        controller.tick = lambda: ticks.append(time.monotonic()) or controller.state  # type: ignore[method-assign]
        thread = threading.Thread(target=controller.run, args=(lambda: len(ticks) >= 2, 30.0))
        thread.start()
        while not ticks:
            time.sleep(0.01)
        time.sleep(0.2)  # the loop waits its tick (30 s) now
        woken = time.monotonic()
        controller.wake.set()
        while len(ticks) < 2 and time.monotonic() - woken < 10:
            time.sleep(0.01)
        assert len(ticks) == 2, "the loop slept through the wake-up"
        assert ticks[1] - woken < 5.0
        time.sleep(0.1)
        assert not controller.wake.is_set()  # consumed: the next wait is a whole tick again
        controller.wake.set()  # end the loop's wait: stop() is true now
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        store.close()
