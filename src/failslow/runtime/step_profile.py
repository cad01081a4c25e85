"""What one rank's step is made of: time per micro-batch and the rest (greyhound 5.2, odyssey IV).

An S2 plan changes how many micro-batches each DP replica runs. Its step time is then
``max_r (rest_r + m_r * t_r)``: per replica, the time of one micro-batch ``t_r`` times its new
count, plus what does not scale with the count (the optimizer step, the gradient reduction,
the pipeline's fill and drain). Neither part is known from a model or the validation GEMM:
the GEMM's slowdown is not the job's (measured 4-7x against 2-2.6x on the S2 demos), and the
rest is 40-70% of a step on some jobs. So each rank measures both, in its own loop:

- every training micro-batch announces itself (:meth:`StepProfile.micro_batch`; the adapters
  call it before each training forward, Megatron once per ``forward_step_func`` call);
- within a step, micro-batches of a DP replica run without waiting for other replicas (the
  gradient reduction is at the step's last micro-batch), so the spacing of their starts is the
  replica's time per call (on a pipeline stage, the 1F1B period: its slowest stage's). A loop
  that meets the other ranks at every micro-batch (PyTorch Lightning broadcasts a flag from
  rank 0 before each batch) puts their waits into that spacing - every replica would look as
  slow as the slowest; there the adapter also says where each micro-batch's own work ends
  (:meth:`StepProfile.micro_batch_end`, after its backward) and the time per call is the mean
  of the step's micro-batches but the last (whose backward holds the gradient reduction);
- the rest is split at the optimizer step (:meth:`StepProfile.optimizer_step`; the adapters'
  optimizer guard calls it): ``rest`` is the part before it less ``calls * spacing`` (the last
  micro-batch's backward, the gradient reduction), ``post`` the part after it (the optimizer,
  and on ZeRO/distributed optimizers the parameter all-gather that waits for every rank's
  optimizer). The job's step is then ``max_r (rest_r + m_r * t_r) + max_r post_r``.

:meth:`StepProfile.summary` gives the medians over the last few steps (on the slowest replica,
which waits for no one, what its step is made of) and a low quantile of ``rest`` and ``post``
over a long window (``rest_low``, ``post_low``: on a replica that waits for a slowed one, its
own parts from before the slowdown, low-biased) and the medians of consecutive blocks of
steps (``blocks``: a planner that knows the healthy step time reads a waiting replica's parts
from the newest block before the slowdown - its typical parts, not the lucky tail, measured
while every rank was busy, as under a plan). Per step the work is O(1); the summary sorts at
most ``long_window`` numbers, once per publication of the rank's progress record.

Replicas' times scatter from step to step, and the job waits for the slowest of them every
step: when a plan balances the replicas (what S2 is for), the mean step is above the largest
mean. The summary carries each part's standard deviation for that (``pre_sd``: the slowed
replica's, waits included, since it waits for no one; ``work_sd``: a healthy replica's, its
micro-batches only).

The model assumes a rank's speed does not depend on the others' load, as on dedicated GPUs. On
a CPU machine with more ranks than cores, moving micro-batches between replicas also moves CPU
share between them, and the prediction errs by that (``benchmarks/s2_prediction.py``).
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

NOW_STEPS = 3
"""Steps of the ``*_now`` medians: what a rank's step is made of at present."""

BLOCK_STEPS = 16
"""Steps per block of :meth:`StepProfile.summary`'s ``blocks``: the rank's parts over its
history, so a planner can read them from before a slowdown (a replica that now waits for a
slowed one measured its own parts there, on a machine as busy as under a plan)."""
MIN_BLOCK = 4
"""A block cut short (the micro-batch count changed) is kept from this many steps."""


class StepProfile:
    def __init__(
        self,
        *,
        window: int = 8,
        long_window: int = 200,
        low_quantile: float = 0.1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._clock = clock
        self._low_quantile = low_quantile
        self._starts: list[float] = []
        self._work: list[float] = []
        """Own work of this step's micro-batches, where the adapter stamps their ends."""
        self._optimizer: float | None = None
        self._boundary: float | None = None
        self._steps: collections.deque[tuple[int, float, float, float, float]] = collections.deque(
            maxlen=window
        )
        """(calls, spacing, rest, post, before the optimizer) of the last ``window`` steps."""
        self._rests: collections.deque[tuple[float, float]] = collections.deque(maxlen=long_window)
        self._block: list[tuple[int, float, float, float, float, int | None]] = []
        """(calls, spacing, rest, post, step, units) of the block being filled."""
        self._blocks: collections.deque[list[float | None]] = collections.deque(
            maxlen=max(1, long_window // BLOCK_STEPS)
        )
        """[steps, calls, median spacing, rest, post, step time, units] of the last blocks."""
        self._last_units: int | None = None
        self._spacing: float | None = None
        self.last_calls = 0
        """Training micro-batch calls between the last two boundaries (what the step that just
        ended ran: a plan's effect is checked against it)."""

    def micro_batch(self) -> None:
        """A training micro-batch (one forward call of it) starts now."""
        self._starts.append(self._clock())

    def micro_batch_end(self) -> None:
        """The current micro-batch's own work (its forward and backward) ended now, before any
        wait for other ranks at the next micro-batch."""
        if len(self._work) < len(self._starts):
            self._work.append(self._clock() - self._starts[-1])

    def optimizer_step(self) -> None:
        """The optimizer step starts now (after the gradient reduction)."""
        self._optimizer = self._clock()

    def boundary(self, end: float, start: float | None = None, *, units: int | None = None) -> None:
        """A step boundary: the step since the last one ended at ``end``; the next starts at
        ``start`` (default ``end``; later when a validation pause parked the rank between).
        ``units``: the count the rank's replica ran in that step under the plan in effect
        (micro-batches; in S2's size form, units of samples - its micro-batch calls stay the
        loop's), where the caller knows it."""
        starts, self._starts = self._starts, []
        work, self._work = self._work[: len(starts) - 1], []
        self.last_calls = len(starts)
        optimizer, self._optimizer = self._optimizer, None
        last, self._boundary = self._boundary, end if start is None else start
        if last is None or not starts:
            return
        if work and len(work) == len(starts) - 1:  # own work, waits left out (see above)
            self._spacing = sum(work) / len(work)
        elif len(starts) >= 2:  # the mean gap (a throttled rank's gaps are bimodal)
            self._spacing = (starts[-1] - starts[0]) / (len(starts) - 1)
        if self._spacing is None:
            return
        split = optimizer if optimizer is not None and optimizer >= starts[-1] else end
        rest = max(0.0, (split - last) - len(starts) * self._spacing)
        post = end - split
        self._steps.append((len(starts), self._spacing, rest, post, split - last))
        self._rests.append((rest, post))
        self._last_units = units
        self._add_to_block((len(starts), self._spacing, rest, post, end - last, units))

    def _add_to_block(self, step: tuple[int, float, float, float, float, int | None]) -> None:
        """O(1) per step; a block's medians once per :data:`BLOCK_STEPS` steps. A block holds
        steps of one count (calls and units): a plan's apply step closes it."""
        if self._block and (self._block[-1][0], self._block[-1][5]) != (step[0], step[5]):
            self._close_block()
        self._block.append(step)
        if len(self._block) >= BLOCK_STEPS:
            self._close_block()

    def _close_block(self) -> None:
        block, self._block = self._block, []
        if len(block) >= MIN_BLOCK:
            spacing, rest, post, step = (
                statistics.median(part) for part in list(zip(*block, strict=True))[1:5]
            )
            self._blocks.append([len(block), block[0][0], spacing, rest, post, step, block[0][5]])

    def summary(self) -> dict[str, Any] | None:
        """``{"calls", "spacing", "rest", "post", "spacing_now", "rest_now", "post_now",
        "pre_sd", "work_sd", "rest_low", "post_low", "steps"}`` (times in seconds; ``rest``:
        the step before the optimizer less ``calls * spacing``, ``post``: from the optimizer
        step to the next boundary; ``*_now``: the same over the last :data:`NOW_STEPS` steps
        only - a rank that just slowed down, whose longer window still holds its healthy steps
        (an onset is diagnosed a few steps after it began); ``pre_sd``: the
        standard deviation of the part before the optimizer, waits included, ``work_sd``: of
        ``calls * spacing``, the micro-batches alone; ``blocks``: ``[steps, calls, spacing,
        rest, post, step, units]``, the medians of consecutive blocks of up to :data:`BLOCK_STEPS`
        steps with one micro-batch count, oldest first, over the long window), or None before
        two steps were measured. ``units``: the replica's count in the newest step (and each
        block's last entry), where the session told it."""
        steps = list(self._steps)
        if len(steps) < 2:
            return None
        history = list(self._rests)
        low = int(self._low_quantile * (len(history) - 1))
        now = steps[-NOW_STEPS:]
        return {
            "calls": steps[-1][0],
            "spacing": statistics.median(s[1] for s in steps),
            "rest": statistics.median(s[2] for s in steps),
            "post": statistics.median(s[3] for s in steps),
            "spacing_now": statistics.median(s[1] for s in now),
            "rest_now": statistics.median(s[2] for s in now),
            "post_now": statistics.median(s[3] for s in now),
            "pre_sd": statistics.stdev(s[4] for s in steps),
            "work_sd": statistics.stdev(s[0] * s[1] for s in steps),
            "rest_low": sorted(r for r, _ in history)[low],
            "post_low": sorted(p for _, p in history)[low],
            "steps": len(history),
            "units": self._last_units,
            "blocks": [list(b) for b in self._blocks],
        }
