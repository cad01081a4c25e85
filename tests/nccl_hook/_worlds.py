"""Spawn a real multi-process gloo world for the hook tests and read back what it captured.

The pytest process owns the TCPStore (port 0, 127.0.0.1) and starts one ``_worker.py``
subprocess per rank; each rank runs a named scenario, installs the hook into ``ring_dir`` and
writes its own JSON result. Phases are marked by CLOCK_MONOTONIC windows, so the test can cut
each rank's ring into phases and steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from _rank_procs import await_ranks
from failslow.core.events import CommEvent, GroupInfo, is_marker, records_to_events
from failslow.core.group_files import read_groups
from failslow.core.ring import RingReader, find_rings

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@dataclass
class RankResult:
    rank: int
    result: dict[str, Any]
    events: list[CommEvent]
    groups: dict[int, GroupInfo]
    writer_dropped: int
    markers: list[CommEvent]  # the step markers (events: the calls)

    def window(self, name: str) -> list[CommEvent]:
        """Events issued inside the named phase window of this rank."""
        t0, t1 = self.result["windows"][name]
        return [e for e in self.events if t0 <= e.t_start_ns <= t1]


def require_native_hook() -> None:
    """The native hook must be built (``./dev setup`` builds it); only a machine without a C++
    compiler may skip what needs it."""
    import shutil

    from failslow.nccl_hook import native_hook

    if native_hook.built() is None:
        if shutil.which("c++") is None and shutil.which("g++") is None:
            pytest.skip(
                "no C++ compiler (c++/g++) on this machine, so the hook's C++ kernel cannot be "
                "built here; the Python kernel's world still runs"
            )
        pytest.fail("the native hook is not built: run `failslow build-hook` (./dev setup does)")


def run_world(
    scenario: str,
    world: int,
    tmp: Path,
    *,
    timeout: float = 240.0,
    env: Mapping[str, str] | None = None,
) -> list[RankResult]:
    """Run ``scenario`` on ``world`` ranks; return each rank's result, ring events and groups."""
    import torch.distributed as dist

    ring_dir = tmp / "rings"
    out_dir = tmp / "out"
    ring_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(REPO / "tests"), child_env.get("PYTHONPATH", "")]
    )
    procs = []
    logs = []
    for rank in range(world):
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        cmd = [
            sys.executable, str(HERE / "_worker.py"), scenario,
            "--rank", str(rank), "--world", str(world), "--port", str(store.port),
            "--ring-dir", str(ring_dir), "--out", str(out_dir / f"rank{rank}.json"),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=child_env, stdout=log, stderr=subprocess.STDOUT))
    try:
        await_ranks(procs, logs, out_dir, timeout=timeout, label=f"scenario {scenario!r}")
    finally:
        del store
    results = []
    rings = {RingReader(p).global_rank: p for p in find_rings(ring_dir)}
    for rank in range(world):
        result = json.loads((out_dir / f"rank{rank}.json").read_text())
        reader = RingReader(rings[rank])
        records = reader.poll()
        marks = is_marker(records)
        events = records_to_events(records[~marks])
        dropped = reader.writer_dropped
        reader.close()
        results.append(
            RankResult(
                rank, result, events, read_groups(rings[rank]), dropped,
                records_to_events(records[marks]),
            )
        )
    return results
