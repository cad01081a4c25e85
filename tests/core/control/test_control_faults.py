"""Faults around a validation round, on real 3-rank gloo jobs (issue 4, "Faults"):

- the controller is killed mid-validation -> every rank resumes after the pause timeout and
  training finishes;
- the control store dies while training -> training goes on unmonitored and finishes;
- a rank dies while the others are paused -> they do not hang: the pause ends by timeout and
  their next collective fails fast (a gloo peer is gone), so every process exits.
Run as a script, this file is one rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _world import spawn_ranks

pytestmark = [pytest.mark.timeout(180), pytest.mark.multiprocess]

WORLD = 3
STEPS = 150


def _start(tmp: Path, control_url: str, *, pause_timeout: str = "3"):
    return spawn_ranks(
        __file__,
        WORLD,
        lambda r, port: [
            str(r),
            str(port),
            control_url,
            str(tmp / "rings"),
            str(tmp / f"rank{r}.json"),
        ],
        pause_timeout=pause_timeout,
    )


def _host_store(tmp: Path) -> tuple[subprocess.Popen, str]:
    """A TCPStore master in its own process (so the test can kill it)."""
    port_file = tmp / "store.port"
    code = (
        "import sys, time\n"
        "from failslow.core.control.store import open_store\n"
        "s = open_store('tcp://127.0.0.1:0?master=1')\n"
        f"open({str(port_file)!r}, 'w').write(str(s.port))\n"
        "time.sleep(3600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        assert time.monotonic() < deadline, "store host did not start"
        time.sleep(0.05)
    return proc, f"tcp://127.0.0.1:{port_file.read_text()}"


def _outputs(procs, timeout: float) -> list[str]:
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n<killed by the test: it hung>")
    return outs


def _wait_parked(store, epoch: int, want: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while store.add(f"failslow/validate/{epoch}/parked", 0) < want:
        assert time.monotonic() < deadline, "ranks did not park"
        time.sleep(0.02)


def _request_pause(store) -> int:
    """What validation_round does first: a pause request ahead of every rank."""
    positions = []
    deadline = time.monotonic() + 30
    while len(positions) < WORLD:
        assert time.monotonic() < deadline, "no positions published"
        positions = [store.get_json(f"failslow/validate/progress/{r}") for r in range(WORLD)]
        positions = [p for p in positions if p and p["next"] >= 5]
        time.sleep(0.05)
    epoch = store.add("failslow/validate/epoch", 1)
    target = max(p["next"] for p in positions) + 10
    store.set_json(
        "failslow/validate/pause",
        {"epoch": epoch, "group_key": positions[0]["group_key"], "call_index": target},
    )
    return epoch


def test_controller_killed_mid_validation_ranks_resume_on_their_own(tmp_path: Path) -> None:
    from failslow.core.control.store import open_store

    store_proc, url = _host_store(tmp_path)
    store = open_store(url)
    _job, procs = _start(tmp_path, url)
    try:
        epoch = _request_pause(store)
        _wait_parked(store, epoch, WORLD, 30)
        # the controller "dies" here: it never writes tasks or the release
        started = time.monotonic()
        outs = _outputs(procs, 60)
        waited = time.monotonic() - started
    finally:
        store_proc.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{out[-2000:]}"
        assert "resuming on my own" in out, out[-2000:]
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["steps"] == STEPS
    assert waited >= 2.5  # the pause timeout (3 s) ran out first


def test_store_dies_training_goes_on(tmp_path: Path) -> None:
    from failslow.core.control.store import open_store

    store_proc, url = _host_store(tmp_path)
    store = open_store(url)
    _job, procs = _start(tmp_path, url)
    deadline = time.monotonic() + 30
    while store.get_json("failslow/validate/progress/0") is None:
        assert time.monotonic() < deadline, "agents never reached the store"
        time.sleep(0.05)
    store_proc.kill()
    store_proc.wait()
    outs = _outputs(procs, 90)
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{out[-2000:]}"
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["steps"] == STEPS


def test_rank_dies_during_a_pause_others_do_not_hang(tmp_path: Path) -> None:
    from failslow.core.control.store import open_store

    store_proc, url = _host_store(tmp_path)
    store = open_store(url)
    _job, procs = _start(tmp_path, url)
    try:
        epoch = _request_pause(store)
        _wait_parked(store, epoch, WORLD, 30)
        procs[WORLD - 1].send_signal(signal.SIGKILL)
        started = time.monotonic()
        outs = _outputs(procs, 90)
        ended = time.monotonic() - started
    finally:
        store_proc.kill()
    assert "hung" not in "".join(outs), outs
    assert ended < 60, ended
    assert procs[WORLD - 1].returncode == -signal.SIGKILL


def _rank_main(rank: int, port: int, url: str, ring_dir: str, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import failslow.nccl_hook as hook
    from failslow.core.control.resilient import ResilientStore
    from failslow.runtime import rank_control

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    capture = hook.install(ring_dir, global_rank=rank)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=20)
    )
    agent = rank_control.attach(capture, ResilientStore(url), poll_s=0.05)
    param = torch.linspace(-1.0, 1.0, 1024)
    for step in range(STEPS):
        grad = torch.sin(param * (rank + 1) + step)
        dist.all_reduce(grad)
        param -= 0.01 * grad / WORLD
        time.sleep(0.02)
    agent.stop()
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"steps": STEPS}))


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
