"""Rank 0's reports to the controller: the job record, then the recent step times.

The mitigator (:mod:`failslow.core.control.mitigator`) plans from the job's layout and the
adapter's capabilities (``failslow/job``, written once, and again when a topology swap moved the
roles) and observes the job's step times (``failslow/steps``: rank 0's recent steps - a
synchronous job has one step time), one read per tick. :class:`JobReport` writes both from one
thread every ``every_s``, never from the training thread: a step costs the session one deque
append.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from failslow.core.control import keys
from failslow.core.control.store import Store


class JobReport:
    def __init__(
        self,
        store: Store,
        job: dict[str, Any],
        step_times: collections.deque[tuple[int, float]],
        *,
        every_s: float = 0.5,
    ) -> None:
        self.store = store
        self.job = job
        self.step_times = step_times
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._job_version = 1
        """Bumped by :meth:`publish_job`; the thread writes until the store holds this one."""

    def start(self) -> JobReport:
        self._thread = threading.Thread(target=self._run, name="failslow-steps", daemon=True)
        self._thread.start()
        return self

    def publish_job(self, job: dict[str, Any]) -> None:
        """Write ``job`` as the job record (from the reporting thread, at its next tick)."""
        self.job = job
        self._job_version += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        published, job_published = -1, 0
        while not self._stop.wait(self.every_s):
            version = self._job_version
            if job_published != version:  # the store may still be connecting: until it holds it
                self.store.set_json(keys.JOB, self.job)
                if self.store.get(keys.JOB) is not None:
                    job_published = version
            recent = list(self.step_times)
            if not recent or recent[-1][0] == published:
                continue
            published = recent[-1][0]
            self.store.set_json(
                keys.STEPS, {"steps": [[s, t] for s, t in recent], "wall": time.time()}
            )
