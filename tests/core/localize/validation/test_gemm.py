"""GEMM computation validation (greyhound 4.3): per-dtype times and the peers'-median rule.

Run as a script (``python test_gemm.py worker REPS``) this file is one rank of the
multi-process test: it prints ``ready``, waits for a line on stdin, times GEMMs and prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from failslow.errors import FailslowError

HERE = Path(__file__).resolve()


def test_gemm_seconds_times_each_cpu_dtype() -> None:
    from failslow.core.localize.validation.gemm import CPU_DTYPES, default_dtypes, gemm_seconds

    assert default_dtypes("cpu") == CPU_DTYPES == ("float32", "bfloat16")
    times = gemm_seconds(size=128, repetitions=5, device="cpu")
    assert set(times) == {"float32", "bfloat16"}
    assert all(t > 0 for t in times.values())
    # A bigger GEMM takes longer: 512x the flops; each time is the fastest of its runs, so a
    # preemption flips it only if it hit every run of the big one (8x flops did flip under load).
    big = gemm_seconds(size=1024, dtypes=("float32",), repetitions=3, device="cpu")
    assert big["float32"] > times["float32"]


def test_a_ranks_time_is_its_fastest_run_not_one_a_preemption_stretched(monkeypatch) -> None:
    """Being preempted only adds time: of the runs [0.030, 0.090, 0.091] (two stretched by
    a neighbour on a loaded machine) the rank reports 0.030, where the median, 0.090, would call
    it 3x slow (issue 49: the median named healthy ranks, benchmarks/gemm_estimator.py)."""
    from failslow.core.localize.validation import gemm

    runs = gemm.gemm_times(size=64, dtypes=("float32",), repetitions=4, device="cpu")
    assert len(runs["float32"]) == 4 and all(t > 0 for t in runs["float32"])
    monkeypatch.setattr(gemm, "gemm_times", lambda **_: {"float32": [0.030, 0.090, 0.091]})
    assert gemm.gemm_seconds(device="cpu") == {"float32": 0.030}


def test_default_cpu_size_takes_milliseconds() -> None:
    import torch

    from failslow.core.localize.validation.gemm import gemm_seconds

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = gemm_seconds(device="cpu", dtypes=("float32",), repetitions=1)
    finally:
        torch.set_num_threads(threads)
    assert 0.002 < times["float32"] < 0.5


def test_gemm_seconds_rejects_bad_input() -> None:
    from failslow.core.localize.validation.gemm import gemm_seconds

    with pytest.raises(FailslowError, match="not a torch dtype"):
        gemm_seconds(size=8, dtypes=("float33",), device="cpu")
    with pytest.raises(FailslowError, match="capability"):
        gemm_seconds(size=16, dtypes=("float8_e4m3fn",), device="cpu")
    with pytest.raises(FailslowError, match="size"):
        gemm_seconds(size=0, device="cpu")
    with pytest.raises(FailslowError, match="repetitions"):
        gemm_seconds(size=8, repetitions=0, device="cpu")
    with pytest.raises(FailslowError, match="no dtypes"):
        gemm_seconds(size=8, dtypes=(), device="cpu")


@pytest.mark.gpu
def test_gemm_seconds_on_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from failslow.core.localize.validation.gemm import default_dtypes, gemm_seconds

    times = gemm_seconds(size=2048)
    assert set(times) == set(default_dtypes())
    assert {"float16", "float32"} <= set(times)
    assert all(t > 0 for t in times.values())


# -- slow_ranks ---------------------------------------------------------------------------------


def test_slow_ranks_uses_the_peers_median_without_the_rank_itself() -> None:
    from failslow.core.localize.validation.gemm import slow_ranks

    # With the rank itself in the median, rank 1 would be 2.0 / 1.5 = 1.33x.
    assert slow_ranks({0: 1.0, 1: 2.0}) == {1: 2.0}
    # Rank 2's peers are 1, 1, 2 (median 1): 2.0x; rank 3 likewise.
    assert slow_ranks({0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0}) == {2: 2.0, 3: 2.0}
    assert slow_ranks({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}) == pytest.approx({3: 1.5})


def test_slow_ranks_threshold_and_edges() -> None:
    from failslow.core.localize.validation.gemm import slow_ranks

    assert slow_ranks({0: 1.0, 1: 1.0, 2: 1.1}) == {}  # exactly 1.1x is not slow
    assert slow_ranks({0: 1.0, 1: 1.0, 2: 1.1001}) == pytest.approx({2: 1.1001})
    assert slow_ranks({0: 1.0, 1: 1.0, 2: 1.05}, threshold=1.01) == pytest.approx({2: 1.05})
    assert slow_ranks({}) == {}
    assert slow_ranks({7: 3.0}) == {}  # no peers, nothing to compare with
    assert slow_ranks({0: 1.0, 1: 1.0}) == {}
    with pytest.raises(FailslowError, match="rank 1"):
        slow_ranks({0: 1.0, 1: 0.0})
    with pytest.raises(FailslowError, match="rank 0"):
        slow_ranks({0: float("nan"), 1: 1.0})


# -- a rank slowed from outside ----------------------------------------------------------------


# Sizes that take ~0.1-0.2 s per GEMM on one CPU core. bfloat16 matmul on a CPU without
# bf16 units is ~80x slower than float32 (1536: 0.10 s float32, 8.6 s bfloat16), so it gets a
# smaller matrix; the rule under test compares ranks per dtype, not dtypes with each other.
WORKER_SIZES = {"float32": 1536, "bfloat16": 512}
MIN_GEMM_S = 0.06
"""One unthrottled GEMM must span a few throttle periods (20 ms): bf16 512^3 took ~1 s on an
older CPU and 0.2 ms on one with AMX, where it fits between two stops and looks healthy."""


def _worker_sizes() -> dict[str, int]:
    """WORKER_SIZES, each doubled until one GEMM takes MIN_GEMM_S on this CPU (at most 4096)."""
    from failslow.core.localize.validation.gemm import gemm_seconds

    sizes = dict(WORKER_SIZES)
    for dtype, size in sizes.items():
        while (
            size < 4096
            and gemm_seconds(size=size, dtypes=(dtype,), repetitions=1, device="cpu")[dtype]
            < MIN_GEMM_S
        ):
            size *= 2
        sizes[dtype] = size
    return sizes


def _worker(repetitions: int, sizes: dict[str, int]) -> None:
    from failslow.core.localize.validation.gemm import gemm_seconds

    gemm_seconds(size=64, device="cpu")  # import and first-call costs before "ready"
    print("ready", flush=True)
    sys.stdin.readline()
    times: dict[str, float] = {}
    for dtype, size in sizes.items():
        times |= gemm_seconds(size=size, dtypes=(dtype,), repetitions=repetitions, device="cpu")
    print(json.dumps(times), flush=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_duty_cycled_rank_is_flagged() -> None:
    from failslow.core.localize.validation.gemm import slow_ranks
    from failslow.faults import DutyCycleThrottle

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # sized as the workers run: one thread each
    try:
        sizes = _worker_sizes()
    finally:
        torch.set_num_threads(threads)
    cmd = [sys.executable, str(HERE), "worker", "5", json.dumps(sizes)]
    procs = [
        subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    throttle = DutyCycleThrottle(procs[1].pid, stopped_fraction=0.7, period_s=0.02)
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        throttle.start()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            assert p.stdout is not None
            results.append(json.loads(p.stdout.readline()))
    finally:
        throttle.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    print("gemm seconds by rank:", results)
    for dtype in WORKER_SIZES:
        flagged = slow_ranks({rank: r[dtype] for rank, r in enumerate(results)})
        assert set(flagged) == {1}, (dtype, results)
        assert flagged[1] > 1.1, (dtype, results)
    total = {rank: sum(r.values()) for rank, r in enumerate(results)}
    assert set(slow_ranks(total)) == {1}


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "worker":
    _worker(int(sys.argv[2]), json.loads(sys.argv[3]))
