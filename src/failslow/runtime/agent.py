"""The rank-side agent of a validation round: pause at one collective, validate, resume.

greyhound 4.3: on a suspected fail-slow, training "is paused at the next iteration boundary",
GEMM and O(1) link tests run on the suspects, then training resumes. The agent lives in every
rank process (beside the capture layer) and talks to the controller only through the control
store (DESIGN.md: the second channel):

1. A thread polls ``{prefix}/pause`` (one small read per ``poll_s``; nothing per iteration).
   A new request ``{"epoch", "group_key", "call_index"}`` arms the rank's own trap with that
   target (ring header ``pause_group``/``pause_call``/``control``): the rank parks right before
   the group's collective number ``call_index``, the same collective on every member.
2. While parked, the trap calls :meth:`RankAgent.while_parked` in the training thread: the
   agent counts itself in ``{prefix}/{epoch}/parked``, then runs the round's tasks
   (``{prefix}/{epoch}/tasks``, executed in order by every rank, so collective tasks line up),
   publishing each result under ``{prefix}/{epoch}/result/{i}/{rank}`` and counting
   ``{prefix}/{epoch}/done/{i}``; validation traffic issued from the trap is never recorded.
3. ``{prefix}/{epoch}/release`` clears the trap and training goes on exactly where it stopped.

A rank driven by an adapter's session also publishes the training step it is in, and a request
``{"epoch", "step"}`` parks it at that step's boundary instead (:meth:`RankAgent.at_step`, called
by the session; greyhound 4.3 "pause at the next iteration boundary"): between two steps no
collective is in flight on any group, so every rank of any parallel layout - a pipeline x
data-parallel job has no group spanning all ranks - stops at the same cut of the training.

If the controller dies, the trap's own timeout releases the rank; if the store is gone, the
:class:`~failslow.core.control.resilient.ResilientStore` answers None and nothing is armed.
Tasks: ``{"kind": "gemm", ...}`` (:func:`failslow.core.localize.validation.gemm.gemm_seconds`; with
``"serial": true`` the ranks take turns, for CPU ranks that share cores - GPUs measure at once;
``"confirm": x``: time again before blaming a rank above x its peers' median) and
``{"kind": "links", "passes": [[[src, dst], ...], ...], "nbytes": n, "repetitions": r,
"confirm": x}`` (:func:`failslow.core.localize.validation.links.measure_links`; ``confirm``:
time the passes again when a link is above x the median link).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from failslow.core.control import keys
from failslow.core.control.polling import PollingThread
from failslow.core.control.store import Store
from failslow.core.control.validator import AGENT_POLL_S

log = logging.getLogger(__name__)


def run_task(task: Mapping[str, Any]) -> Any:
    """Execute one validation task on this rank; returns a JSON-serialisable result."""
    kind = task.get("kind")
    if kind == "gemm":
        return _gemm(task)
    if kind == "links":
        from failslow.core.localize.validation.links import measure_links

        passes = [[(int(a), int(b)) for a, b in one] for one in task["passes"]]
        measured = measure_links(
            passes,
            nbytes=int(task.get("nbytes", 1 << 20)),
            repetitions=int(task.get("repetitions", 3)),
            timeout_s=float(task.get("timeout_s", 60.0)),
            confirm=float(task["confirm"]) if task.get("confirm") else None,
        )
        return [[a, b, seconds] for (a, b), seconds in measured.items()]
    raise ValueError(f"unknown validation task kind {kind!r}")


def _gemm(task: Mapping[str, Any]) -> dict[str, Any]:
    """The GEMM task: this rank's fastest run per dtype; with ``confirm``, repeat before blame.

    ``"serial": true``: the ranks take turns (CPU ranks that share cores would measure each
    other). ``"confirm": x``: the ranks exchange their times and, when any rank is above x its
    peers' median (the controller's rule), every rank times the GEMM again and keeps the
    fastest of both timings (issue 49): a preemption that hit one timing rarely hits the next,
    a sustained slowdown slows both; the result then also holds the first timing (under ``FIRST``).
    Every rank decides from the same gathered times.
    """
    from failslow.core.localize.validation.gemm import FIRST, gemm_seconds, slow_ranks

    options = {k: v for k, v in task.items() if k in ("size", "dtypes", "repetitions")}
    if "dtypes" in options:
        options["dtypes"] = tuple(options["dtypes"])

    def measure() -> dict[str, float]:
        if not task.get("serial"):
            return gemm_seconds(**options)
        import torch.distributed as dist

        result: dict[str, float] = {}
        for turn in range(dist.get_world_size()):
            if turn == dist.get_rank():
                result = gemm_seconds(**options)
            dist.barrier()
        return result

    result = measure()
    if not task.get("confirm"):
        return result
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return result
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    per_rank = {r: max(times.values()) for r, times in enumerate(everyone) if times}
    named = slow_ranks(per_rank, threshold=float(task["confirm"]))
    if not named:
        return result
    log.info("failslow agent: GEMM names rank(s) %s; timing again before blame", sorted(named))
    again = measure()
    # the first timing rides along (the diagnosis's evidence shows what the repeat changed)
    return {**{name: min(s, again[name]) for name, s in result.items()}, FIRST: result}


RATE_WINDOW_S = 0.5
"""The published call rate is measured over this long: a straggler's job calls in bursts (a
duty-cycled rank: none for a while, then a few), and over one poll period the rate swings from
0 to several times the mean - the controller, which takes the fastest rank's rate to aim the
pause, would aim several iterations too far ahead. Over half a second the rate follows a
slowdown within that time."""


class RankAgent:
    """One per rank process; ``arm`` is how the trap gets its target (ring header words)."""

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        set_header_word: Callable[[str, int], None],
        prefix: str = keys.VALIDATE,
        poll_s: float = AGENT_POLL_S,
        check_every_s: float = 0.02,
        position: Callable[[], tuple[int, ...] | None] | None = None,
        token: str | None = None,
        steps: Callable[[], int | None] | None = None,
        park: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.prefix = prefix
        self._set = set_header_word
        self._check_every_s = check_every_s
        self.epoch = 0
        self._counted = False
        self._next_task = 0
        self._last_check = 0.0
        self.poll_s = poll_s
        self._poller = PollingThread(self._poll, name="failslow-agent", poll_s=poll_s)
        self._position = position
        self.steps = steps
        """The training step this rank is in (a session's), or None: no step pause."""
        self.profile: Callable[[], dict[str, Any] | None] | None = None
        """This rank's step profile (:class:`~failslow.runtime.step_profile.StepProfile`),
        published as ``"profile"`` in its progress record for the planner's S2 estimate."""
        self._park = park
        self._step_target: int | None = None
        self._last_step: tuple[int, float] | None = None
        self._step_rate = 0.0
        self._positions: collections.deque[tuple[int, int, float]] = collections.deque()
        """``(group key, next call_index, monotonic time)`` over the last ``RATE_WINDOW_S``."""
        self.token = token
        """The job's token: pause requests without it are ignored (:func:`keys.authorized`)."""
        self._ignored = 0

    def start(self) -> RankAgent:
        self._poller.start()
        return self

    def stop(self) -> None:
        self._poller.stop()

    def disarm(self) -> None:
        """Clear whatever pause this agent armed (its thread stopped: no one would release it);
        a thread parked on it goes on."""
        self._step_target = None
        self._set("pause_group", 0)
        self._set("pause_call", 0)
        self._set("control", 0)

    def _poll(self) -> None:
        self.publish_position()
        self.check_request()

    def publish_position(self) -> None:
        """``{prefix}/progress/{rank}``: the pause group's key, the next call_index this rank
        will issue on it and its calls per second, so the controller can pick a target no rank
        has reached (one small write per ``poll_s``, independent of the world size)."""
        record = self._step_record()
        where = self._position() if self._position is not None else None
        if where is not None:
            key, next_index = where[0], where[1]
            now = time.monotonic()
            seen = self._positions
            if seen and seen[-1][0] != key:  # another pause group: its calls count anew
                seen.clear()
            seen.append((key, next_index, now))
            while len(seen) > 2 and now - seen[1][2] >= RATE_WINDOW_S:
                seen.popleft()
            rate = 0.0
            if now > seen[0][2]:
                rate = (next_index - seen[0][1]) / (now - seen[0][2])
            record.update(
                group_key=key, next=next_index, rate=rate, t=time.time(), poll_s=self.poll_s
            )
            if len(where) == 4:  # (period, residue) of the iteration on this group (phase.py)
                record["phase"] = [where[2], where[3]]
        if record:
            self.store.set_json(f"{self.prefix}/progress/{self.rank}", record)

    def _step_record(self) -> dict[str, Any]:
        """``{"step", "step_rate", "t"}`` for a session-driven rank (else empty)."""
        step = self.steps() if self.steps is not None else None
        if step is None or step < 0 or self._park is None:
            return {}
        now = time.monotonic()
        last = self._last_step
        if last is None or step != last[0]:
            if last is not None and now > last[1] and step > last[0]:
                # steps per second between the last two changes seen (kept between changes)
                self._step_rate = (step - last[0]) / (now - last[1])
            self._last_step = (step, now)
        record: dict[str, Any] = {
            "step": step,
            "step_rate": self._step_rate,
            "t": time.time(),
            "poll_s": self.poll_s,
        }
        profile = self.profile() if self.profile is not None else None
        if profile is not None:
            record["profile"] = profile
        return record

    def at_step(self, step: int) -> None:
        """The session is about to start ``step``: park here if a step pause targets it."""
        target = self._step_target
        if target is None or step < target:
            return
        self._step_target = None
        self._set("pause_group", 0)
        self._set("pause_call", 0)
        self._set("control", self.epoch)
        if self._park is not None:
            self._park()

    def check_request(self) -> bool:
        """Arm the trap when the store holds a new pause request; True if it did."""
        request = self.store.get_json(f"{self.prefix}/pause")
        if not request or int(request["epoch"]) <= self.epoch:
            return False
        if not keys.authorized(request, self.token):
            if int(request["epoch"]) != self._ignored:
                self._ignored = int(request["epoch"])
                log.warning("failslow: ignored pause request %s: no valid job token", self._ignored)
            return False
        self.epoch = int(request["epoch"])
        if self.store.get(f"{self.prefix}/{self.epoch}/release") is not None:
            return False  # a round that ended before this rank (a restarted process) joined
        self._counted, self._next_task = False, 0
        self._step_target = None  # a new round replaces whatever an older one armed
        if "step" in request:
            return self._arm_step(int(request["step"]))
        where = self._position() if self._position is not None else None
        if where is not None and where[0] == int(request["group_key"]):
            if where[1] > int(request["call_index"]):
                # already past the target: parking later would stop this rank at another
                # collective than its peers; tell the controller, which releases and retries
                self.store.add(f"{self.prefix}/{self.epoch}/missed", 1)
                return False
        self._set("pause_group", int(request["group_key"]))
        self._set("pause_call", int(request["call_index"]))
        self._set("control", self.epoch)  # last: the target is in place first
        return True

    def _arm_step(self, target: int) -> bool:
        step = self.steps() if self.steps is not None else None
        if step is None or self._park is None or step >= target:
            # past the step (or not session-driven): tell the controller, which retries
            self.store.add(f"{self.prefix}/{self.epoch}/missed", 1)
            return False
        self._step_target = target
        return True

    def while_parked(self) -> None:
        """The trap's callback: count in, run the round's tasks, release on request."""
        now = time.monotonic()
        if now - self._last_check < self._check_every_s or not self.epoch:
            return
        self._last_check = now
        base = f"{self.prefix}/{self.epoch}"
        store = self.store
        if not self._counted:
            store.add(f"{base}/parked", 1)
            self._counted = True
        tasks = store.get_json(f"{base}/tasks") or []
        while self._next_task < len(tasks):
            i = self._next_task
            self._next_task += 1
            try:
                result: Any = {"ok": run_task(tasks[i])}
            except Exception as exc:
                result = {"error": f"{type(exc).__name__}: {exc}"}
            store.set_json(f"{base}/result/{i}/{self.rank}", result)
            store.add(f"{base}/done/{i}", 1)
        if store.get(f"{base}/release") is not None:
            self._set("control", 0)
