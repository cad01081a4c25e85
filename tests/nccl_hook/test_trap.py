"""The pause trap of the Python hook on a real 2-rank gloo world (spawned processes).

Each rank runs a small SGD loop whose gradient is all-reduced every step. At step ``HOLD`` both
ranks stop between two all-reduces (a file handshake outside torch.distributed, so the pause
request lands while every rank stands at a call boundary), the test requests the pause, lets
them go and watches them park in the trap at their next all-reduce. The final parameters and
every all-reduce result must equal those of a run without a pause: exactly (tolerance 0), since
the same ops run on the same values in the same order.

Run as a script, this file is one rank of such a world.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from failslow import envvars

pytestmark = pytest.mark.timeout(90)

WORLD = 2
STEPS = 40
HOLD = 10  # ranks wait at the end of this step for the test's go-ahead


def _spawn_world(tmp: Path, *, hold: bool, env: dict[str, str] | None = None) -> dict[str, Any]:
    import torch.distributed as dist

    ring_dir, sync_dir = tmp / "rings", tmp / "sync"
    ring_dir.mkdir(parents=True)
    sync_dir.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
    child_env.update(env or {}, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                str(rank),
                str(store.port),
                str(ring_dir),
                str(sync_dir) if hold else "-",
                str(tmp / f"rank{rank}.json"),
            ],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    return {"store": store, "procs": procs, "ring_dir": ring_dir, "sync_dir": sync_dir, "tmp": tmp}


def _finish(world: dict[str, Any], timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    logs = []
    for p in world["procs"]:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        logs.append(out)
    for rank, p in enumerate(world["procs"]):
        assert p.returncode == 0, f"rank {rank} rc={p.returncode}:\n{logs[rank][-3000:]}"
    results = [json.loads((world["tmp"] / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, log in zip(results, logs, strict=True):
        r["log"] = log
    return results


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _hold_and_pause(world: dict[str, Any]) -> list[Path]:
    """Wait until both ranks stand after step HOLD, request the pause, let them go."""
    from failslow.core.ring import find_rings
    from failslow.nccl_hook import trap

    sync: Path = world["sync_dir"]
    _wait_for(
        lambda: all((sync / f"rank{r}.at").exists() for r in range(WORLD)),
        30,
        "both ranks at the hold point",
    )
    rings = find_rings(world["ring_dir"])
    assert len(rings) == WORLD
    for ring in rings:
        assert trap.parked(ring) == 0
        trap.request_pause(ring)
    (sync / "go").touch()
    for ring in rings:
        assert trap.wait_parked(ring, timeout_s=10.0), f"{ring.name} did not park"
    return rings


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The same job without any pause."""
    return _finish(_spawn_world(tmp_path_factory.mktemp("trap_ref"), hold=False))


@pytest.mark.multiprocess
def test_pause_parks_every_rank_and_resume_changes_nothing(
    reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    from failslow.core.events import OpCode, records_to_events
    from failslow.core.ring import RingReader
    from failslow.nccl_hook import trap

    world = _spawn_world(tmp_path, hold=True)
    try:
        rings = _hold_and_pause(world)
        readers = [RingReader(ring) for ring in rings]
        at_park = [r.write_index for r in readers]
        time.sleep(0.6)  # unpaused, a rank writes a record every few milliseconds
        assert [r.write_index for r in readers] == at_park, "records written while parked"
        for ring, index in zip(rings, at_park, strict=True):
            assert 0 < trap.parked(ring) <= index + 1
        t_release = time.monotonic_ns()
        for ring in rings:
            trap.release(ring)
        results = _finish(world)
    finally:
        for p in world["procs"]:
            if p.poll() is None:
                p.kill()
    for ring, reader, index in zip(rings, readers, at_park, strict=True):
        assert trap.parked(ring) == 0 and trap.control(ring) == 0
        assert trap.self_releases(ring) == 0
        assert reader.write_index > index, "training did not continue after the release"
        events = [e for e in records_to_events(reader.poll()) if e.op == OpCode.ALLREDUCE]
        reader.close()
        assert len(events) == STEPS
        # the park sits before t_start: no call's duration contains the 0.6 s pause
        assert max(e.duration_ns for e in events) < 0.3e9
        assert any(e.t_start_ns >= t_release for e in events)
    for got, want in zip(results, reference, strict=True):
        assert got["held_s"] >= 0.5
        # exact equality: same ops on the same values in the same order
        assert got["reduced_sums"] == want["reduced_sums"]
        assert got["param"] == want["param"]


@pytest.mark.multiprocess
def test_trap_releases_itself_when_nobody_resumes(
    reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    from failslow.nccl_hook import trap

    world = _spawn_world(tmp_path, hold=True, env={"FAILSLOW_PAUSE_TIMEOUT_S": "1.0"})
    try:
        rings = _hold_and_pause(world)
        tokens = [trap.control(ring) for ring in rings]
        results = _finish(world)  # nobody releases: the job must still finish
    finally:
        for p in world["procs"]:
            if p.poll() is None:
                p.kill()
    for ring, token in zip(rings, tokens, strict=True):
        assert trap.self_releases(ring) == 1
        assert trap.parked(ring) == 0
        assert trap.control(ring) == token != 0, "the rank must not touch the control word"
    for got, want in zip(results, reference, strict=True):
        assert 0.9 <= got["held_s"] < 10
        assert got["log"].count("resuming on my own") == 1
        assert got["param"] == want["param"]


@pytest.mark.multiprocess
def test_targeted_pause_parks_every_rank_at_the_same_collective(
    reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    """No handshake: ranks run freely; the controller names a group and a call_index none has
    reached, and every rank parks right before that same all-reduce."""
    from failslow.core.events import OpCode, records_to_events
    from failslow.core.ring import RingReader, find_rings
    from failslow.nccl_hook import trap

    world = _spawn_world(tmp_path, hold=False, env={"TRAP_STEP_SLEEP_S": "0.03"})
    try:
        _wait_for(lambda: len(find_rings(world["ring_dir"])) == WORLD, 30, "both rings")
        rings = find_rings(world["ring_dir"])
        readers = [RingReader(ring) for ring in rings]
        seen: list[list[Any]] = [[] for _ in rings]

        def progress() -> int:
            for events, reader in zip(seen, readers, strict=True):
                events += records_to_events(reader.poll())
            return min(len(e) for e in seen)

        _wait_for(lambda: progress() >= 3, 30, "a few all-reduces")
        (key,) = {e.group_key for events in seen for e in events if e.op == OpCode.ALLREDUCE}
        target = max(e.call_index for events in seen for e in events) + 8
        for ring in rings:
            trap.request_pause(ring, group_key=key, call_index=target)
        for ring in rings:
            assert trap.wait_parked(ring, timeout_s=20.0), f"{ring.name} did not park"
        time.sleep(0.2)
        progress()
        for events in seen:
            assert max(e.call_index for e in events if e.group_key == key) == target - 1
        for ring in rings:
            trap.release(ring)
        results = _finish(world)
    finally:
        for p in world["procs"]:
            if p.poll() is None:
                p.kill()
    for got, want in zip(results, reference, strict=True):
        assert got["param"] == want["param"]  # exact, as above


# -- the trap alone, on threads ------------------------------------------------------------------
def _parking_thread(t: Any) -> tuple[Any, list[bool]]:
    import threading

    held: list[bool] = []
    thread = threading.Thread(target=lambda: held.append(t.check()))
    thread.start()
    return thread, held


def test_trap_semantics_on_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from failslow.core.ring import RingWriter
    from failslow.nccl_hook import trap

    monkeypatch.setenv(envvars.PAUSE_TIMEOUT_S, "0.3")
    ring = tmp_path / "r.ring"
    writer = RingWriter(ring, capacity=16)
    writer.write(t_start_ns=1, t_end_ns=2, nbytes=0, group_key=0, op=1)
    t = trap.Trap(writer)
    assert t.check() is False  # no pause requested: nothing happens
    first = trap.request_pause(ring)
    threads = [_parking_thread(t) for _ in range(2)]
    assert trap.wait_parked(ring, timeout_s=5)
    assert trap.parked(ring) == 2  # write_index (1) + 1
    time.sleep(0.05)
    assert all(th.is_alive() for th, _ in threads)
    trap.release(ring)
    for th, held in threads:
        th.join(5)
        assert held == [True]
    assert trap.parked(ring) == 0 and trap.self_releases(ring) == 0

    # nobody releases: one self-release, then the same token is ignored ...
    second = trap.request_pause(ring)
    assert second > first
    t0 = time.monotonic()
    assert t.check() is True
    assert 0.25 < time.monotonic() - t0 < 3
    assert trap.self_releases(ring) == 1 and trap.parked(ring) == 0
    assert t.check() is False and trap.control(ring) == second
    # ... until the word changes: a new request parks again
    trap.request_pause(ring)
    th, held = _parking_thread(t)
    assert trap.wait_parked(ring, timeout_s=5)
    trap.release(ring)
    th.join(5)
    assert held == [True] and trap.self_releases(ring) == 1
    writer.close()


def test_controller_api_rejects_a_file_that_is_not_a_ring(tmp_path: Path) -> None:
    from failslow.core.ring import RingFormatError
    from failslow.nccl_hook import trap

    bogus = tmp_path / "x.ring"
    bogus.write_bytes(b"\0" * 512)
    with pytest.raises(RingFormatError, match="not a failslow ring"):
        trap.request_pause(bogus)


# -- one rank -------------------------------------------------------------------------------------
def _rank_main(rank: int, port: int, ring_dir: str, sync_dir: str, out: str) -> None:
    import logging

    import torch
    import torch.distributed as dist

    import failslow.nccl_hook as hook

    logging.basicConfig(level=logging.WARNING)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    hook.install(ring_dir)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    param = torch.linspace(-1.0, 1.0, 4096, dtype=torch.float32)
    reduced_sums = []
    held_s = 0.0
    for step in range(STEPS):
        grad = torch.sin(param * (rank + 1) + step)
        t0 = time.monotonic()
        dist.all_reduce(grad)
        if step == HOLD + 1:
            held_s = time.monotonic() - t0
        reduced_sums.append(float(grad.double().sum()))
        param -= 0.01 * grad / WORLD
        if step == HOLD and sync_dir != "-":
            Path(sync_dir, f"rank{rank}.at").touch()
            while not Path(sync_dir, "go").exists():
                time.sleep(0.001)
        time.sleep(float(os.environ.get("TRAP_STEP_SLEEP_S", "0.002")))
    dist.barrier()
    time.sleep(0.2)  # let the last completion callbacks land
    dist.destroy_process_group()
    Path(out).write_text(
        json.dumps({"param": param.tolist(), "reduced_sums": reduced_sums, "held_s": held_s})
    )


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
