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
compares each link with the median of all links of the test. With ``confirm`` (the controller
passes its detection threshold), a round in which some link is above that factor of the median
is followed by a second round, and each link keeps the smaller of its two times: a busy core
that delays one end for a few milliseconds (on shared CPUs a time slice lasts as long as a
transfer) does not make a link slow, a degraded link is slow in both rounds. The ranks a pass
leaves idle transfer between themselves, untimed (ballast), so that a ring's pass - every rank
busy - and a tree's - one pair - time their links under the same load.

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
import logging
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from failslow.core.localize.validation.schedules import Link
from failslow.errors import FailslowError

log = logging.getLogger(__name__)

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
    confirm: float | None = None,
    ballast: bool = True,
) -> dict[Link, float]:
    """Time every link of ``passes`` (global ranks); collective over ``group`` (default: world).

    Returns, on every rank, ``{(sender, receiver): seconds}``: per link, the sum over the message
    sizes of the median over ``repetitions`` of the sender's time (message + acknowledgement).

    ``confirm``: when a link measures above ``confirm`` x the median link (the threshold the
    caller will judge by, :func:`slow_links`), every pass is timed once more and each link keeps
    the smaller of its two times. Interference from outside the link - a busy core that
    delays one end for a few milliseconds, on shared CPUs a time slice as long as a transfer -
    only ever adds time and seldom hits one link in both rounds, while a degraded link is slow
    in both. Every rank holds the same table, so all agree on the second round.

    ``ballast``: in each pass, the tested ranks (those of any pass) that no timed link of the
    pass uses transfer between themselves, untimed (:func:`_ballast`), so that every pass loads
    the machines alike; False leaves them idle, as greyhound's passes do.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise FailslowError("measure_links: torch.distributed is not initialized")
    if repetitions < 1:
        raise FailslowError(f"measure_links: repetitions must be >= 1, got {repetitions}")
    if not (timeout_s > 0):
        raise FailslowError(f"measure_links: timeout_s must be positive, got {timeout_s}")
    if confirm is not None and not confirm > 0:
        raise FailslowError(f"measure_links: confirm must be a positive factor, got {confirm}")
    sizes = _sizes(nbytes)
    members = set(
        dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    )
    schedule = _check_schedule(passes, members)
    if dist.get_rank() not in members:
        raise FailslowError(
            f"measure_links: rank {dist.get_rank()} is not in the group {sorted(members)}"
        )
    test = _LinkTest(group, sorted(members), schedule, max(sizes), timeout_s, ballast)
    test.warm_up(min(sizes))
    seconds = test.measure(sizes, repetitions)
    suspects = slow_links(seconds, threshold=confirm) if confirm is not None else {}
    if suspects:
        again = test.measure(sizes, repetitions)
        (log.info if test.me == min(members) else log.debug)(
            "link test: %s above %gx the median link; timed again (%s of the first round), "
            "each link keeps its smaller time",
            ", ".join(f"{a}->{b} {s:.2f}x" for (a, b), s in suspects.items()),
            confirm,
            ", ".join(f"{a}->{b} {again[a, b] / seconds[a, b]:.2f}x" for a, b in suspects),
        )
        seconds = {link: min(first, again[link]) for link, first in seconds.items()}
    return seconds


def _ballast(one_pass: list[Link], tested: Sequence[int]) -> list[Link]:
    """Untimed transfers between the tested ranks (those of any pass) that ``one_pass`` leaves
    idle, paired in ascending order.

    A pass of one pair (a tree's) and a pass of every rank (a ring's) do not time their links
    under the same load: the ring's concurrent pairs share the hosts' cores, memory bandwidth
    and fabric. On 4 CPU ranks of 2 cores the lone pairs measured 0.72x and 0.76x the median
    link and the concurrent ones 1.02-1.08x (up to 1.5x) - a healthy link over greyhound's 1.1
    in most tests (benchmarks/README.md). With the idle ranks transferring too, every pass loads
    the machines alike. Only tested ranks: the world's other ranks, which wait at the barriers
    of a test of a few suspect groups, add no traffic."""
    busy = {r for link in one_pass for r in link}
    idle = [r for r in tested if r not in busy]
    return list(zip(idle[0::2], idle[1::2], strict=False))


class _LinkTest:
    """The transfers of one :func:`measure_links` call on this rank: its buffers, barriers,
    its pair in each pass (a timed link or :func:`_ballast`), and one round over the schedule
    (:meth:`measure`)."""

    def __init__(
        self, group: Any, members: list[int], schedule: list[list[Link]], nbytes: int,
        timeout_s: float, ballast: bool = True,
    ) -> None:  # fmt: skip
        import torch
        import torch.distributed as dist

        self.group, self.members, self.timeout_s = group, len(members), timeout_s
        self.schedule = schedule
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.me = dist.get_rank()
        tested = sorted({r for one_pass in schedule for link in one_pass for r in link})
        self.pairs = [self._mine(p, _ballast(p, tested) if ballast else []) for p in schedule]
        """Per pass: this rank's pair (None: idle) and whether it is a timed link."""
        backend = str(dist.get_backend(group)).lower()
        self.device = torch.device("cpu")
        if "nccl" in backend and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.token = torch.zeros(1, dtype=torch.uint8, device=self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def barrier(self, where: str) -> None:
        import torch.distributed as dist

        try:
            work = dist.barrier(group=self.group, async_op=True)
            if work is not None:
                work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise LinkTestTimeout(
                f"link test: rank {self.me} timed out after {self.timeout_s:g} s at the barrier "
                f"{where} ({exc})"
            ) from exc

    def run(self, work: Any) -> None:
        if work is not None:
            work.wait(timeout=self.timeout)

    def transfer(self, link: Link, size: int) -> float | None:
        """One transfer of ``size`` bytes on ``link``; the sender returns its time."""
        import torch.distributed as dist

        src, dst = link
        me, group, token, view = self.me, self.group, self.token, self.buffer[:size]
        self.barrier(f"before {src}->{dst}")
        try:
            if me == src:
                # Handshake with the receiver first, so that only this pair's two ends (not the
                # barrier's exit skew, which any rank of the group can cause) are timed.
                self.run(dist.isend(token, dst, group=group))
                self.run(dist.irecv(token, dst, group=group))
                t0 = time.perf_counter()
                self.run(dist.isend(view, dst, group=group))
                self.run(dist.irecv(token, dst, group=group))  # the receiver's acknowledgement
                self.sync()
                return time.perf_counter() - t0
            self.run(dist.irecv(token, src, group=group))
            self.run(dist.isend(token, src, group=group))
            self.run(dist.irecv(view, src, group=group))
            self.sync()
            self.run(dist.isend(token, src, group=group))
            return None
        except RuntimeError as exc:
            raise LinkTestTimeout(
                f"link test: rank {me} timed out after {self.timeout_s:g} s on link {src}->{dst} "
                f"({size} bytes) ({exc})"
            ) from exc

    def _mine(self, one_pass: list[Link], ballast: list[Link]) -> tuple[Link | None, bool]:
        for counted, links in ((True, one_pass), (False, ballast)):
            for link in links:
                if self.me in link:
                    return link, counted
        return None, False

    def warm_up(self, size: int) -> None:
        """Connect every pair once, untimed."""
        for link, _ in self.pairs:
            if link is None:
                self.barrier("of the warm-up")
            else:
                self.transfer(link, size)

    def measure(self, sizes: tuple[int, ...], repetitions: int) -> dict[Link, float]:
        """One round: every pass at every size, ``repetitions`` times; the same table on every
        rank (the senders' times are gathered)."""
        import torch.distributed as dist

        records: list[tuple[Link, int, int, float]] = []
        for size in sizes:
            for rep in range(repetitions):
                for link, counted in self.pairs:
                    if link is None:
                        self.barrier(f"of a pass ({size} bytes)")
                        continue
                    seconds = self.transfer(link, size)
                    if seconds is not None and counted:
                        records.append((link, size, rep, seconds))
        self.barrier("after the link test")

        gathered: list[Any] = [None] * self.members
        dist.all_gather_object(gathered, records, group=self.group)
        timed: dict[tuple[Link, int, int], float] = {}
        for rank_records in gathered:
            for (src, dst), size, rep, seconds in rank_records:
                timed[((src, dst), size, rep)] = seconds
        return {
            link: sum(
                statistics.median(timed[(link, size, rep)] for rep in range(repetitions))
                for size in sizes
            )
            for one_pass in self.schedule
            for link in one_pass
        }


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
