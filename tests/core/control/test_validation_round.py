"""A validation round on a real 4-rank gloo world: targeted pause, GEMM + O(1) link tests run
in the parked training threads, diagnosis, release (greyhound 4.3).

One rank is slowed from outside (SIGSTOP/SIGCONT duty cycling of its PID). The controller (this
test) pauses every rank at the same all-reduce through the control store, runs the tasks,
releases, and the diagnosis must name that rank, kind compute. Training then finishes every
step. Run as a script, this file is one rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from _world import spawn_ranks

pytestmark = [pytest.mark.timeout(180), pytest.mark.multiprocess]

WORLD = 4
STEPS = 80
SLOW = 2


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_round_pauses_validates_diagnoses_and_resumes(tmp_path: Path) -> None:

    from failslow.core.control.store import open_store
    from failslow.core.control.validator import validation_round
    from failslow.core.diagnosis.record import Kind
    from failslow.core.events import OpCode, records_to_events
    from failslow.core.localize.diagnose import diagnose
    from failslow.core.localize.validation.schedules import ring_passes, tree_passes
    from failslow.core.ring import RingReader, find_rings
    from failslow.faults import DutyCycleThrottle

    control = open_store("tcp://127.0.0.1:0?master=1")
    control_url = f"tcp://127.0.0.1:{control.port}"  # type: ignore[attr-defined]
    ring_dir = tmp_path / "rings"
    _job, procs = spawn_ranks(
        __file__,
        WORLD,
        lambda r, port: [
            str(r),
            str(port),
            control_url,
            str(ring_dir),
            str(tmp_path / f"rank{r}.json"),
        ],
        pause_timeout="60",
    )
    throttle = DutyCycleThrottle(procs[SLOW].pid, stopped_fraction=0.75, period_s=0.02)
    try:
        _wait_for(lambda: len(find_rings(ring_dir)) == WORLD, 60, "every ring")
        readers = [RingReader(r) for r in find_rings(ring_dir)]
        seen = [records_to_events(r.poll()) for r in readers]
        _wait_for(
            lambda: all(
                (seen[i].extend(records_to_events(r.poll())) or len(seen[i]) >= 5)
                for i, r in enumerate(readers)
            ),
            60,
            "a few steps",
        )
        (key,) = {e.group_key for s in seen for e in s if e.op == OpCode.ALLREDUCE}
        target = max(e.call_index for s in seen for e in s) + 10
        throttle.start()
        tasks = [
            {"kind": "gemm", "size": 1536, "dtypes": ["float32"], "repetitions": 5, "serial": True},
            {
                "kind": "links",
                "passes": ring_passes(WORLD) + tree_passes(WORLD),
                "nbytes": 8 << 20,
                "repetitions": 5,
            },
        ]
        started = time.monotonic()
        result = validation_round(
            control, world_size=WORLD, group_key=key, call_index=target, tasks=tasks, timeout_s=90
        )
        elapsed = time.monotonic() - started
        throttle.stop()
        gemm, links = result.results
        assert all("ok" in v for v in gemm.values()), gemm
        # 4 ranks on 2 shared cores: healthy ranks scatter by up to ~1.5x here (seen in CI:
        # 1.53x), the injected straggler (75% stopped) measures ~3-4x; greyhound's 1.1 is for
        # dedicated GPUs, so this CPU test uses 2.0 (the threshold is a parameter)
        diagnosis = diagnose(gemm, links, threshold=2.0, evidence={"round": result.epoch})
        summary = {
            "diagnosis": diagnosis and json.loads(diagnosis.to_json()),
            "round_s": elapsed,
            "paused_s": result.paused_s,
        }
        print(json.dumps(summary))
        assert diagnosis is not None, summary
        assert [s.rank for s in diagnosis.slow_ranks] == [SLOW], summary
        assert diagnosis.kind is Kind.COMPUTE, summary
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        throttle.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{out[-3000:]}"
        done = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert done["steps"] == STEPS and done["parked_at"] == target, done


def _rank_main(rank: int, port: int, control_url: str, ring_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import failslow.nccl_hook as hook
    from failslow.core.control.resilient import ResilientStore
    from failslow.runtime import rank_control

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    capture = hook.install(ring_dir, global_rank=rank)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    agent = rank_control.attach(capture, ResilientStore(control_url), poll_s=0.05)
    parked_at = -1
    original = agent.while_parked

    def note_park() -> None:
        nonlocal parked_at
        parked_at = capture.groups.get(dist.group.WORLD.group_name).calls.peek()
        original()

    capture.trap.on_parked = note_park
    param = torch.linspace(-1.0, 1.0, 4096)
    for step in range(STEPS):
        grad = torch.sin(param * (rank + 1) + step)
        dist.all_reduce(grad)
        param -= 0.01 * grad / WORLD
        time.sleep(0.02)
    dist.barrier()
    agent.stop()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"steps": STEPS, "parked_at": parked_at}))


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
