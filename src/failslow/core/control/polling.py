"""The background poll loop of the rank-side control pieces (agent, plan receiver).

A daemon thread calls ``tick`` every ``poll_s`` seconds until stopped. A failing tick is logged
and the loop goes on: monitoring and mitigation must never take a training rank down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class PollingThread:
    def __init__(self, tick: Callable[[], None], *, name: str, poll_s: float) -> None:
        self._tick = tick
        self._name = name
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self._tick()
            except Exception:
                log.warning("failslow: %s poll failed", self._name, exc_info=True)
