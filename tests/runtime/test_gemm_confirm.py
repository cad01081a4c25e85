"""Repeat before blame (issue 49): the GEMM task's ``confirm`` in a real 3-rank gloo world.

Each rank's timings are scripted (``gemm_seconds`` replaced in the rank's process) so the
rule - exchange, a second timing on every rank when one is named, the fastest of both kept -
is checked exactly; that the GEMM itself sees a throttled rank is
``tests/core/localize/validation/test_gemm.py``'s test.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

HEALTHY = {"float32": 0.020, "bfloat16": 0.040}
SLOW = {"float32": 0.060, "bfloat16": 0.120}

# rank -> its first and second timing, per scenario
SCRIPTS: dict[str, dict[int, list[dict[str, float]]]] = {
    "healthy": {0: [HEALTHY], 1: [HEALTHY], 2: [HEALTHY]},
    # rank 1 preempted during the first timing only: timed again, not blamed
    "transient": {0: [HEALTHY, HEALTHY], 1: [SLOW, HEALTHY], 2: [HEALTHY, HEALTHY]},
    # rank 1 slow in both timings (a sustained fail-slow): still slow after the second
    "sustained": {0: [HEALTHY, HEALTHY], 1: [SLOW, SLOW], 2: [HEALTHY, HEALTHY]},
}


# scenario, serial (the CPU demos' ranks take turns)
RUNS = (("healthy", False), ("transient", True), ("sustained", False))


def _rank(rank: int, world: int, init: str, out: Any) -> None:
    import torch.distributed as dist

    from failslow.core.localize.validation import gemm
    from failslow.runtime.agent import run_task

    calls: list[dict[str, Any]] = []
    script: list[dict[str, float]] = []

    def scripted(**options: Any) -> dict[str, float]:
        calls.append(options)
        return dict(script[len(calls) - 1])

    gemm.gemm_seconds = scripted  # type: ignore[assignment]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for scenario, serial in RUNS:  # one world, the three rounds in turn
            calls.clear()
            script[:] = SCRIPTS[scenario][rank]
            task = {"kind": "gemm", "repetitions": 3, "serial": serial, "confirm": 1.1}
            result = run_task(task)
            out.put((scenario, rank, result, len(calls), calls[0]))
    finally:
        dist.destroy_process_group()


def _world(tmp_path: Path) -> dict[str, dict[int, tuple[Any, ...]]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'init'}"
    procs = [ctx.Process(target=_rank, args=(r, 3, init, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got: dict[str, dict[int, tuple[Any, ...]]] = {scenario: {} for scenario, _ in RUNS}
        for _ in range(len(procs) * len(RUNS)):
            scenario, rank, result, ncalls, options = out.get(timeout=60)
            got[scenario][rank] = (result, ncalls, options)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return got


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_rank_named_by_the_gemm_is_timed_again_before_blame(tmp_path: Path) -> None:
    from failslow.core.localize.diagnose import diagnose

    def named(got: dict[int, tuple[Any, ...]]) -> list[int]:
        found = diagnose({r: {"ok": v[0]} for r, v in got.items()}, None, threshold=1.1)
        return [s.rank for s in found.slow_ranks] if found else []

    got = _world(tmp_path)
    healthy, transient, sustained = got["healthy"], got["transient"], got["sustained"]
    assert {r: v[1] for r, v in healthy.items()} == {0: 1, 1: 1, 2: 1}  # no second timing
    assert healthy[0][2] == {"repetitions": 3} and named(healthy) == []

    assert {r: v[1] for r, v in transient.items()} == {0: 2, 1: 2, 2: 2}  # every rank again
    assert {k: v for k, v in transient[1][0].items() if k != "first"} == HEALTHY
    assert transient[1][0]["first"] == SLOW and named(transient) == []

    assert {r: v[1] for r, v in sustained.items()} == {0: 2, 1: 2, 2: 2}
    assert sustained[1][0]["first"] == SLOW and named(sustained) == [1]
    found = diagnose({r: {"ok": v[0]} for r, v in sustained.items()}, None, threshold=1.1)
    assert found is not None and found.evidence["gemm_first_s"] == {0: 0.04, 1: 0.12, 2: 0.04}
