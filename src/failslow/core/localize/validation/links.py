"""Link tests: run O(1) pass schedules with torch.distributed point-to-point (greyhound 4.3,
"Communication validation", Fig. 10; falcon 4.3, Fig. 9).

While training is paused, every rank of the job's own world (or of ``group``) calls
:func:`measure_links` with the same passes (from
:mod:`failslow.core.localize.validation.schedules`, mapped to global ranks). For each message
size, repetition and pass: a barrier, then the pairs of that pass transfer at the same time
(``isend``/``irecv``); ranks outside the pass go straight to the next barrier. Within a pair,
the two ends first exchange a one-byte token (so the barrier's exit skew, which any rank of the
group can cause, is not timed), then the sender times the message and the receiver's one-byte
acknowledgement on its own clock (after a device synchronize on CUDA). A slow sender, a slow
receiver or a slow wire all lengthen that time. "Since the transmission sizes are identical, a
slow link measures longer communication times and can be easily identified": :func:`slow_links`
compares each link with the median of all links of the test.

Every rank returns the same result: the senders' timings are exchanged with
``all_gather_object`` at the end, and each rank reduces them identically. The seconds of a link
are the sum over the message sizes of the median over the repetitions (the default sizes are the
paper's 16, 32 and 64 MB; pass smaller ``nbytes`` on CPU). Before timing, one untimed round of
every pass warms up the connections (NCCL connects point-to-point peers lazily).

A rank that does not arrive (dead or hung) makes the others fail with :class:`LinkTestTimeout`
after ``timeout_s`` instead of hanging; the process group may be unusable after that, and the
caller (the controller) ends the pause. torch is imported inside the functions only.
"""

from __future__ import annotations

import datetime
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from failslow.core.localize.validation.schedules import Link
from failslow.errors import FailslowError

MB = 1 << 20
DEFAULT_NBYTES: tuple[int, ...] = (16 * MB, 32 * MB, 64 * MB)
"""Greyhound's message sizes; use e.g. ``(1 * MB,)`` for a CPU gloo test."""


class LinkTestTimeout(FailslowError, TimeoutError):
    """A rank did not reach a barrier or finish a transfer of the link test in time."""


def _sizes(nbytes: int | Iterable[int]) -> tuple[int, ...]:
    sizes = (nbytes,) if isinstance(nbytes, int) else tuple(nbytes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
        raise FailslowError(f"measure_links: nbytes must be positive byte counts, got {nbytes!r}")
    return sizes


def _check_schedule(passes: Sequence[Sequence[Link]], members: set[int]) -> list[list[Link]]:
    checked: list[list[Link]] = []
    for index, one_pass in enumerate(passes):
        busy: set[int] = set()
        links = []
        for src, dst in one_pass:
            link = (int(src), int(dst))
            if link[0] == link[1]:
                raise FailslowError(f"measure_links: self-transfer {link} in pass {index}")
            for rank in link:
                if rank not in members:
                    raise FailslowError(
                        f"measure_links: pass {index} uses rank {rank}, which is not in the "
                        f"group {sorted(members)}"
                    )
                if rank in busy:
                    raise FailslowError(
                        f"measure_links: rank {rank} is in two transfers of pass {index}"
                    )
                busy.add(rank)
            links.append(link)
        checked.append(links)
    return checked


def measure_links(
    passes: Sequence[Sequence[Link]],
    *,
    nbytes: int | Iterable[int] = DEFAULT_NBYTES,
    repetitions: int = 3,
    group: Any = None,
    timeout_s: float = 60.0,
) -> dict[Link, float]:
    """Time every link of ``passes`` (global ranks); collective over ``group`` (default: world).

    Returns, on every rank, ``{(sender, receiver): seconds}``: per link, the sum over the message
    sizes of the median over ``repetitions`` of the sender's time (message + acknowledgement).
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise FailslowError("measure_links: torch.distributed is not initialized")
    if repetitions < 1:
        raise FailslowError(f"measure_links: repetitions must be >= 1, got {repetitions}")
    if not (timeout_s > 0):
        raise FailslowError(f"measure_links: timeout_s must be positive, got {timeout_s}")
    sizes = _sizes(nbytes)
    members = set(
        dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    )
    schedule = _check_schedule(passes, members)
    me = dist.get_rank()
    if me not in members:
        raise FailslowError(f"measure_links: rank {me} is not in the group {sorted(members)}")
    timeout = datetime.timedelta(seconds=timeout_s)

    backend = str(dist.get_backend(group)).lower()
    device = torch.device("cpu")
    if "nccl" in backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    token = torch.zeros(1, dtype=torch.uint8, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def barrier(where: str) -> None:
        try:
            work = dist.barrier(group=group, async_op=True)
            if work is not None:
                work.wait(timeout=timeout)
        except RuntimeError as exc:
            raise LinkTestTimeout(
                f"link test: rank {me} timed out after {timeout_s:g} s at the barrier {where} "
                f"({exc})"
            ) from exc

    def run(work: Any) -> None:
        if work is not None:
            work.wait(timeout=timeout)

    def transfer(link: Link, size: int) -> float | None:
        """One transfer of ``size`` bytes on ``link``; the sender returns its time."""
        src, dst = link
        view = buffer[:size]
        barrier(f"before {src}->{dst}")
        try:
            if me == src:
                # Handshake with the receiver first, so that only this pair's two ends (not the
                # barrier's exit skew, which any rank of the group can cause) are timed.
                run(dist.isend(token, dst, group=group))
                run(dist.irecv(token, dst, group=group))
                t0 = time.perf_counter()
                run(dist.isend(view, dst, group=group))
                run(dist.irecv(token, dst, group=group))  # the receiver's acknowledgement
                sync()
                return time.perf_counter() - t0
            run(dist.irecv(token, src, group=group))
            run(dist.isend(token, src, group=group))
            run(dist.irecv(view, src, group=group))
            sync()
            run(dist.isend(token, src, group=group))
            return None
        except RuntimeError as exc:
            raise LinkTestTimeout(
                f"link test: rank {me} timed out after {timeout_s:g} s on link {src}->{dst} "
                f"({size} bytes) ({exc})"
            ) from exc

    def mine(one_pass: list[Link]) -> Link | None:
        return next((link for link in one_pass if me in link), None)

    # Warm-up: connect every pair once, untimed.
    for one_pass in schedule:
        link = mine(one_pass)
        if link is None:
            barrier("of the warm-up")
        else:
            transfer(link, min(sizes))

    records: list[tuple[Link, int, int, float]] = []
    for size in sizes:
        for rep in range(repetitions):
            for one_pass in schedule:
                link = mine(one_pass)
                if link is None:
                    barrier(f"of a pass ({size} bytes)")
                    continue
                seconds = transfer(link, size)
                if seconds is not None:
                    records.append((link, size, rep, seconds))
    barrier("after the link test")

    gathered: list[Any] = [None] * len(members)
    dist.all_gather_object(gathered, records, group=group)
    timed: dict[tuple[Link, int, int], float] = {}
    for rank_records in gathered:
        for (src, dst), size, rep, seconds in rank_records:
            timed[((src, dst), size, rep)] = seconds
    result: dict[Link, float] = {}
    for one_pass in schedule:
        for link in one_pass:
            result[link] = sum(
                statistics.median(timed[(link, size, rep)] for rep in range(repetitions))
                for size in sizes
            )
    return result


def slow_links(
    seconds_by_link: Mapping[Link, float], *, threshold: float = 1.1
) -> dict[Link, float]:
    """Links slower than ``threshold`` x the median of all links, with their slowdown.

    Greyhound compares links of one test, which all move the same bytes. The median is over every
    link of ``seconds_by_link`` (the link itself included), so a single link is never slow.
    """
    if not seconds_by_link:
        return {}
    for link, seconds in seconds_by_link.items():
        if not (math.isfinite(seconds) and seconds > 0):
            raise FailslowError(f"slow_links: link {link} has a non-positive time {seconds!r}")
    median = statistics.median(seconds_by_link.values())
    slowdowns = {link: seconds / median for link, seconds in seconds_by_link.items()}
    return {link: s for link, s in sorted(slowdowns.items()) if s > threshold}
