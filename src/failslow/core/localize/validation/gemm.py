"""Computation validation: a GEMM benchmark per rank (greyhound 4.3, "Computation validation";
falcon 4.3).

While training is paused, every rank of a suspect group runs the same matrix multiplication
(GEMM, "a building block training operation ... commonly used as a standard test" in SuperBench)
and reports its time; the controller gathers the times and :func:`slow_ranks` names the ranks
that are slower than their peers. Each dtype is timed after one untimed warm-up as the *fastest*
of ``repetitions`` runs (the issue's 3), synchronizing the device around every run on CUDA:
being preempted only ever adds time, so the fastest run is the least disturbed one, while a
sustained slowdown (a throttled GPU, a rank stopped part of every period shorter than the GEMM)
slows every run alike. The median named healthy ranks on a loaded machine (issue 49): 4 ranks
taking turns beside 2 busy processes on 2 cores, at the CPU demos' threshold (2.0), a healthy
rank was named in 14 and 23 of 60 rounds by the median, in 4 and 15 by the fastest run, and the
slow rank (stopped 75% of every 20 ms) in all but 1 (``benchmarks/gemm_estimator.py``).

Dtypes: ``float32`` and ``bfloat16`` on CPU; ``float8_e4m3fn``, ``float16`` and ``float32`` on
CUDA (fp8 only where ``torch._scaled_mm`` runs, compute capability 8.9 and up; it is left out of
the defaults elsewhere, and asking for it there is an error). A rank is slow when its time is
more than ``threshold`` (1.1, as for greyhound's degraded groups) times the median of its
*peers'* times - the rank itself excluded, so that with two ranks each is compared with the
other. torch is imported inside the functions only.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from failslow.errors import FailslowError

FIRST = "first"
"""In a GEMM task's result timed twice before blame (:func:`failslow.runtime.agent.run_task`,
``confirm``): the first timing's seconds per dtype, beside the fastest of both."""

CPU_SIZE = 1024
"""A float32 1024^3 GEMM takes ~25 ms on one core of the development machine."""
CUDA_SIZE = 8192

CPU_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
CUDA_DTYPES: tuple[str, ...] = ("float8_e4m3fn", "float16", "float32")
_FP8 = "float8_e4m3fn"


def _fp8_supported(torch: Any, device: Any) -> bool:
    if device.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
        return False
    return bool(torch.cuda.get_device_capability(device) >= (8, 9))


def default_dtypes(device: Any = None) -> tuple[str, ...]:
    """The dtypes :func:`gemm_seconds` times by default on ``device`` (default: CUDA if any)."""
    import torch

    dev = _device(torch, device)
    if dev.type != "cuda":
        return CPU_DTYPES
    return tuple(d for d in CUDA_DTYPES if d != _FP8 or _fp8_supported(torch, dev))


def _device(torch: Any, device: Any) -> Any:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def gemm_seconds(
    *,
    size: int | None = None,
    dtypes: Sequence[str] | None = None,
    repetitions: int = 3,
    device: Any = None,
) -> dict[str, float]:
    """Seconds of one ``size`` x ``size`` matmul per dtype: the fastest of ``repetitions``
    runs after a warm-up (see the module). ``size`` defaults to :data:`CPU_SIZE` on CPU and
    :data:`CUDA_SIZE` on CUDA; ``dtypes`` to :func:`default_dtypes`. Uses torch's current
    intra-op thread count.
    """
    times = gemm_times(size=size, dtypes=dtypes, repetitions=repetitions, device=device)
    return {name: min(runs) for name, runs in times.items()}


def gemm_times(
    *,
    size: int | None = None,
    dtypes: Sequence[str] | None = None,
    repetitions: int = 3,
    device: Any = None,
) -> dict[str, list[float]]:
    """Every timed run's seconds per dtype (what :func:`gemm_seconds` reduces)."""
    import torch

    dev = _device(torch, device)
    if size is None:
        size = CUDA_SIZE if dev.type == "cuda" else CPU_SIZE
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise FailslowError(f"gemm_seconds: size must be a positive int, got {size!r}")
    if repetitions < 1:
        raise FailslowError(f"gemm_seconds: repetitions must be >= 1, got {repetitions}")
    names = tuple(dtypes) if dtypes is not None else default_dtypes(dev)
    if not names:
        raise FailslowError("gemm_seconds: no dtypes to time")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    result: dict[str, list[float]] = {}
    for name in names:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise FailslowError(f"gemm_seconds: {name!r} is not a torch dtype")
        generator = torch.Generator(device=dev).manual_seed(0)
        if name == _FP8:
            if not _fp8_supported(torch, dev):
                raise FailslowError(
                    f"gemm_seconds: {name} needs CUDA compute capability >= 8.9 (device {dev})"
                )
            a = torch.randn(size, size, device=dev, generator=generator).to(dtype)
            # _scaled_mm wants the second operand column-major.
            b = torch.randn(size, size, device=dev, generator=generator).to(dtype).t()
            one = torch.ones((), device=dev)

            def run(a: Any = a, b: Any = b, one: Any = one) -> Any:
                return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        else:
            a = torch.randn(size, size, device=dev, generator=generator).to(dtype)
            b = torch.randn(size, size, device=dev, generator=generator).to(dtype)

            def run(a: Any = a, b: Any = b, one: Any = None) -> Any:
                return torch.matmul(a, b)

        try:
            run()  # warm-up: kernel selection, caches, lazy init
            sync()
            times = []
            for _ in range(repetitions):
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                times.append(time.perf_counter() - t0)
        except (RuntimeError, NotImplementedError) as exc:
            raise FailslowError(
                f"gemm_seconds: {name} matmul is not supported on {dev}: {exc}"
            ) from exc
        result[name] = times
    return result


def slow_ranks(times_by_rank: Mapping[int, float], *, threshold: float = 1.1) -> dict[int, float]:
    """Ranks slower than ``threshold`` x the median of their peers' times, with that slowdown.

    A rank's slowdown is its time over the median of the *other* ranks' times. With fewer than
    two ranks there are no peers and nothing is slow. Call it once per dtype (or on per-rank
    sums over dtypes).
    """
    for rank, seconds in times_by_rank.items():
        if not (math.isfinite(seconds) and seconds > 0):
            raise FailslowError(f"slow_ranks: rank {rank} has a non-positive time {seconds!r}")
    if len(times_by_rank) < 2:
        return {}
    slow: dict[int, float] = {}
    for rank, seconds in sorted(times_by_rank.items()):
        peers = statistics.median(t for r, t in times_by_rank.items() if r != rank)
        slowdown = seconds / peers
        if slowdown > threshold:
            slow[rank] = slowdown
    return slow
