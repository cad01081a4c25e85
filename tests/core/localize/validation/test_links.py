"""Link tests on a real 4-rank gloo world (greyhound 4.3, Fig. 10).

The test process owns the TCPStore (port 0) and runs this file as a script once per rank
(``python test_links.py worker RANK WORLD PORT OUT``). The world goes through three phases:
``healthy`` (ring and tree link tests, 1 MB), ``slow`` (the same while the test SIGSTOP/SIGCONT
duty-cycles rank 3, a real slow endpoint: its transfers stall while it is stopped) and
``timeout`` (rank 3 leaves; the others must fail with LinkTestTimeout instead of hanging).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from failslow.core.localize.validation.links import (
    MB,
    LinkTestTimeout,
    _check_schedule,
    _sizes,
    slow_links,
)
from failslow.core.localize.validation.schedules import links_of_ring, links_of_tree
from failslow.errors import FailslowError

HERE = Path(__file__).resolve()
WORLD = 4
SLOW_RANK = 3
HEALTHY = {"nbytes": 1 * MB, "repetitions": 3}
SLOW = {"nbytes": 16 * MB, "repetitions": 5}


# -- pure parts ---------------------------------------------------------------------------------


def test_slow_links_against_the_median_of_all_links() -> None:
    times = {(0, 1): 1.0, (1, 2): 1.0, (2, 3): 1.0, (3, 0): 2.0}
    assert slow_links(times) == {(3, 0): 2.0}
    # Two slow links of four: the median is between them and the fast ones.
    two = {(0, 1): 1.0, (1, 2): 1.0, (2, 3): 3.0, (3, 0): 3.0}
    assert slow_links(two) == {(2, 3): 1.5, (3, 0): 1.5}
    assert slow_links({(0, 1): 1.0, (1, 0): 1.1}) == {}
    assert slow_links({(0, 1): 5.0}) == {}
    assert slow_links({}) == {}
    with pytest.raises(FailslowError, match=r"\(1, 0\)"):
        slow_links({(0, 1): 1.0, (1, 0): -1.0})


def test_schedule_and_size_checks() -> None:
    assert _sizes(5) == (5,)
    assert _sizes([1, 2]) == (1, 2)
    with pytest.raises(FailslowError, match="nbytes"):
        _sizes(0)
    with pytest.raises(FailslowError, match="nbytes"):
        _sizes([])
    with pytest.raises(FailslowError, match="rank 1 is in two transfers"):
        _check_schedule([[(0, 1), (1, 2)]], {0, 1, 2})
    with pytest.raises(FailslowError, match="rank 7, which is not in the group"):
        _check_schedule([[(0, 7)]], {0, 1})
    with pytest.raises(FailslowError, match="self-transfer"):
        _check_schedule([[(1, 1)]], {0, 1})


# -- the 4-rank world ---------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, out: Path) -> None:
    import torch.distributed as dist

    from failslow.core.localize.validation.links import measure_links
    from failslow.core.localize.validation.schedules import ring_passes, tree_passes

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    result: dict[str, Any] = {}

    def both(**kw: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        ring = measure_links(ring_passes(world), **kw)
        tree = measure_links(tree_passes(world), **kw)
        return {
            "ring": [[a, b, s] for (a, b), s in ring.items()],
            "tree": [[a, b, s] for (a, b), s in tree.items()],
            "wall": time.perf_counter() - t0,
        }

    for phase, kw in (("healthy", HEALTHY), ("slow", SLOW)):
        store.set(f"ready/{phase}/{rank}", "1")
        store.wait([f"go/{phase}"])
        result[phase] = both(**kw)
        out.write_text(json.dumps(result))

    # A rank that never arrives: the others must not hang.
    if rank == SLOW_RANK:
        os._exit(0)
    t0 = time.perf_counter()
    try:
        measure_links(ring_passes(world), nbytes=1024, repetitions=1, timeout_s=2.0)
        result["timeout"] = "no error"
    except LinkTestTimeout as exc:
        result["timeout"] = {"error": str(exc), "seconds": time.perf_counter() - t0}
    out.write_text(json.dumps(result))
    os._exit(0)  # the group is unusable now; do not wait on it at exit


def _as_links(rows: list[list[Any]]) -> dict[tuple[int, int], float]:
    return {(int(a), int(b)): float(s) for a, b, s in rows}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_link_tests_on_a_gloo_world(tmp_path: Path) -> None:
    import torch.distributed as dist

    from failslow.faults import DutyCycleThrottle

    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outs = [tmp_path / f"rank{r}.json" for r in range(WORLD)]
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(WORLD)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE),
                "worker",
                str(r),
                str(WORLD),
                str(store.port),
                str(outs[r]),
            ],
            env=env,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    throttle = DutyCycleThrottle(procs[SLOW_RANK].pid, stopped_fraction=0.95, period_s=0.02)
    store.set_timeout(datetime.timedelta(seconds=60))
    try:
        store.wait([f"ready/healthy/{r}" for r in range(WORLD)])
        store.set("go/healthy", "1")
        store.wait([f"ready/slow/{r}" for r in range(WORLD)])
        throttle.start()
        store.set("go/slow", "1")
        for p in procs:
            p.wait(timeout=90)
    finally:
        throttle.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    tails = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))
    assert all(p.returncode == 0 for p in procs), tails
    results = [json.loads(o.read_text()) for o in outs]

    for phase in ("healthy", "slow"):
        for topo, links in (("ring", links_of_ring(WORLD)), ("tree", links_of_tree(WORLD))):
            by_rank = [_as_links(r[phase][topo]) for r in results]
            # Every link measured, and every rank returns the same numbers.
            assert set(by_rank[0]) == set(links), (phase, topo)
            assert all(b == by_rank[0] for b in by_rank), (phase, topo)
            assert all(s > 0 for s in by_rank[0].values())
            print(phase, topo, {k: round(v * 1e3, 2) for k, v in by_rank[0].items()}, "ms")

    # Slow phase: the links with the duty-cycled rank at one end are flagged, and only they.
    for topo, links in (("ring", links_of_ring(WORLD)), ("tree", links_of_tree(WORLD))):
        seconds = _as_links(results[0]["slow"][topo])
        flagged = slow_links(seconds)
        touched = {link for link in links if SLOW_RANK in link}
        print(topo, "flagged", flagged)
        assert set(flagged) == touched, (topo, seconds)
        others = [s for link, s in seconds.items() if link not in touched]
        assert min(seconds[link] for link in touched) > 1.3 * max(others), (topo, seconds)

    for rank in range(WORLD):
        if rank == SLOW_RANK:
            continue
        outcome = results[rank]["timeout"]
        assert isinstance(outcome, dict), outcome
        assert "timed out after 2 s" in outcome["error"]
        assert outcome["seconds"] < 30


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
