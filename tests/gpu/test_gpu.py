"""The GPU path on a GPU (issue 50): what benchmarks/gpu/check.py asserts with pytest.

``gpu``-marked and skipped, with the reason, where torch has no CUDA (CI, these CPU machines):
the check runs them on the GPU machine (``pytest -m gpu``). They run the real parts: torch's own
``libnccl.so.2`` under the built shim, a one-rank NCCL world, the Snapshotter on device tensors.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: real NCCL and device tensors exist only on a GPU machine, "
    "where benchmarks/gpu/run.sh runs this test (pytest -m gpu)",
)
needs_cuda_torch = pytest.mark.skipif(
    torch.version.cuda is None,
    reason="this torch is a CPU build and ships no libnccl.so.2 to hook; benchmarks/gpu/run.sh "
    "runs this test on a GPU machine's CUDA torch (pytest -m gpu)",
)


@needs_cuda_torch
def test_the_shim_resolves_every_hooked_symbol_in_torchs_own_nccl():
    from failslow.nccl_hook import doctor

    report = doctor.diagnose()
    assert report.ok, [f.message for f in report.findings if f.level == "error"]
    assert report.symbols, "doctor found no NCCL to read symbols from"
    for row in report.symbols:
        if row["optional"] and not row["nccl"] and not row["pnccl"]:
            continue  # only newer NCCL releases have it
        assert row["nccl"] and row["pnccl"], row
        assert row["shim"] == "pnccl", row


JOB = textwrap.dedent(
    """
    import time, torch, torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    grad = torch.ones(1 << 20, device="cuda")
    for _ in range(CALLS):
        dist.all_reduce(grad)
    torch.cuda.synchronize()
    time.sleep(0.2)  # the shim's harvester writes device-timed records off the training thread
    dist.destroy_process_group()
    """
)


@needs_cuda
def test_nccl_calls_are_recorded_with_their_device_times(tmp_path: Path):
    from failslow.core.events import Flags, OpCode, Source
    from failslow.core.ring import RingReader, find_rings
    from failslow.nccl_hook.native import shim_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "LD_PRELOAD": str(shim_path()),
        "FAILSLOW_RING_DIR": str(tmp_path),
        "FAILSLOW_DEVICE_TIMING": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    calls = 50
    done = subprocess.run(
        [sys.executable, "-c", JOB.replace("CALLS", str(calls))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = [r for path in find_rings(tmp_path) for r in RingReader(path).poll()]
    nccl = [r for r in records if r["source"] == Source.SHIM and r["op"] == OpCode.ALLREDUCE]
    assert len(nccl) == calls, f"{len(nccl)} shim all-reduce records of {len(records)}"
    for r in nccl:
        assert not r["flags"] & Flags.END_IS_ENQUEUE, "enqueue time, not the device's"
        assert r["t_end_ns"] > r["t_start_ns"] > 0


@needs_cuda
def test_a_snapshot_of_device_tensors_comes_back_bit_for_bit(tmp_path: Path):
    from failslow.core.checkpoint.snapshot import Snapshotter

    g = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "w": torch.randn(1 << 22, device="cuda", generator=g),
        "h": torch.randn(4096, 257, device="cuda", generator=g).to(torch.bfloat16),
        "i": torch.randint(0, 1 << 40, (1000,), device="cuda", generator=g),
        "host": torch.arange(10.0),
        "step": 7,
    }
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with Snapshotter(tmp_path, rank=0) as snap:
        snap.start(state, 7)
        snap.wait_consistent()
        state["w"].add_(1.0)  # after wait_consistent: ordered after the copy on the device
        assert snap.wait_sealed(timeout_s=60) == 7
        step, loaded = snap.load()
    assert step == 7
    assert loaded["step"] == 7
    for key in ("w", "h", "i", "host"):
        assert loaded[key].dtype == expected[key].dtype
        assert torch.equal(loaded[key].to(expected[key].device), expected[key]), key
