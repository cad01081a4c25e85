"""Rank 0's job record on a real TCPStore: written at start, and again when a topology swap
moved the roles (the controller plans from it; a restarted controller reads the new layout)."""

from __future__ import annotations

import collections
import time

from failslow.core.control import keys
from failslow.core.control.store import open_store
from failslow.runtime.job_report import JobReport


def _wait_for(store, predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = store.get_json(keys.JOB)
        if record and predicate(record):
            return record
        time.sleep(0.02)
    raise AssertionError(f"job record never matched: {store.get_json(keys.JOB)}")


def test_the_job_record_is_written_again_after_a_swap() -> None:
    master = open_store("tcp://127.0.0.1:0?master=1")
    try:
        steps: collections.deque = collections.deque(maxlen=8)
        report = JobReport(master, {"topology": {"coords": [[0, 0, 0], [0, 1, 0]]}}, steps,
                           every_s=0.02).start()  # fmt: skip
        try:
            _wait_for(master, lambda r: r["topology"]["coords"] == [[0, 0, 0], [0, 1, 0]])
            report.publish_job({"topology": {"coords": [[0, 1, 0], [0, 0, 0]]}})
            _wait_for(master, lambda r: r["topology"]["coords"] == [[0, 1, 0], [0, 0, 0]])
        finally:
            report.stop()
    finally:
        master.close()
