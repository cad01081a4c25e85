"""The node agent's restart-in-place loop (byterobust 6.1, "In-Place Hot-Update"; 4.2 rollback).

``failslow run`` hands CMD to :class:`Agent`, which runs it until it ends and meanwhile polls the
job's update history:

- an **urgent** update (or a lazy one whose window expired) stops CMD now: with a control store
  hosted (``--controller N``) a :class:`StopForUpdate` plan goes through the plan channel, so every
  rank snapshots at one common step boundary and exits with :data:`EXIT_FOR_UPDATE`; without one,
  CMD's process group gets SIGTERM. CMD is then relaunched with every pending update applied;
- a **lazy** update waits for the next failure of CMD: the restart after it applies the update;
- after a relaunch with updates, CMD is on **probation**: if it fails within the window, the
  agent rolls the updates back (relaunch with the version they replaced) and records why;
- CMD exiting 0 ends the agent; restarts after failures are bounded by ``max_restarts``; ranks
  that cannot restore their state (:data:`EXIT_UNRESTORABLE`) end it at once;
- a launch that ended because a rank's metrics went bad (a rollback request, byterobust 4.1)
  climbs the stop-time ladder (:mod:`failslow.node.incidents`): relaunch from the newest
  snapshot before the bad step (``$FAILSLOW_ROLLBACK_BEFORE``), then with the latest code update
  rolled back, then stop for a person. These relaunches do not count against ``max_restarts``:
  the ladder bounds them;
- a launch that failed with an exception traceable to a running code update (a frame in a file
  it changed; :mod:`failslow.node.hot_update.blame`) rolls that update back at once, on
  probation or not (byterobust 4.1).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from failslow import envvars
from failslow.core.control.stop import (
    EXIT_FOR_RESTART,
    EXIT_FOR_UPDATE,
    EXIT_UNRESTORABLE,
    StopForUpdate,
)
from failslow.core.planner.ladder import DIAGNOSE, NEEDS_PERSON, REPLAY, ROLL_BACK_CODE
from failslow.errors import FailslowError
from failslow.node.hot_update.history import LIVE, History, Update
from failslow.node.hot_update.version import Version


@dataclass(kw_only=True, slots=True)
class AgentOptions:
    """How the agent restarts CMD; ``failslow run`` fills it from its options."""

    max_restarts: int = 0
    """Restarts after CMD failures, over the agent's life (updates and rollbacks do not count)."""
    probation_s: float = 600.0
    """After a relaunch with updates, a failure within this long rolls them back."""
    window_s: float = 24 * 3600.0
    """A lazy update without its own window is applied at the latest this long after submission."""
    poll_s: float = 1.0
    """How often the history is read."""
    stop_timeout_s: float = 300.0
    """After the ranks agreed to stop, CMD must exit within this long, or it gets SIGTERM."""
    kill_grace_s: float = 10.0
    """SIGKILL this long after SIGTERM."""
    dispatch_timeout_s: float = 60.0
    """The ranks must all accept a stop within this long, or the plan is aborted."""
    dispatch_attempts: int = 3
    """Plans aborted because ranks did not answer (a rank still starting, say) before the update
    is recorded failed; a rank's refusal fails it at once."""
    horizon_steps: int = 4
    world_size: int | None = None
    """Ranks answering the plan channel (``--controller N``); None: stop CMD with SIGTERM."""
    job_token: str | None = None
    """The job's token: ranks that hold one act only on plans that carry it."""
    follower: bool = False
    """Another node's agent decides the job's updates (``--node-rank`` > 0): ranks that
    stopped for an update it asked for are relaunched, not counted as a failure, and a code
    rollback of the ladder is its (this node relaunches at the version it publishes)."""


Spawn = Callable[[Version, dict[str, str]], "subprocess.Popen[bytes]"]


@dataclass(slots=True)
class _Stop:
    """A stop for update in progress."""

    due: list[Update]
    thread: threading.Thread | None = None
    outcome: Any = None  # plan_channel.PlanOutcome once dispatch returned
    deadline: float | None = None  # committed: CMD must be gone by then
    terminated_at: float | None = None

    @property
    def requested(self) -> bool:
        """The agent asked CMD to stop (committed plan, or SIGTERM)."""
        committed = self.outcome is not None and self.outcome.committed
        return committed or self.terminated_at is not None


@dataclass(slots=True)
class _Ended:
    status: int
    lifetime_s: float
    stop: _Stop | None


class Agent:
    """Runs CMD at ``base`` (or the version the history says is current) until it is done."""

    def __init__(
        self,
        history: History,
        base: Version,
        env: dict[str, str],
        spawn: Spawn,
        *,
        options: AgentOptions,
        store: Any = None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.history, self.base, self.env, self.spawn = history, base, env, spawn
        self.options, self.store, self.say = options, store, say
        self.child: subprocess.Popen[bytes] | None = None
        self.signalled = False
        self.launches = 0
        self.attempts: dict[int, int] = {}  # dispatches per update
        self.incidents: collections.Counter[str] = collections.Counter()
        """CMD's failures: ``failed`` (a restart or the end), ``failed_after_update`` (rolled
        back within probation), ``metrics`` (a rank's metrics went bad), ``code`` (an
        exception traceable to an update, rolled back) - the metrics exporter's
        ``failslow_incidents_total``."""
        from failslow.node.incidents import Incidents

        state_dir = env.get(envvars.STATE_DIR)
        self.ladder = Incidents(Path(state_dir) if state_dir else None, history, say=say)
        """The stop-time ladder of the incidents the ranks report."""
        self._rollback_before: int | None = None
        self.replay: Callable[[Version, dict[str, str], int, dict[str, Any]], Any] | None = None
        """Dual-phase replay on the node's ranks (``failslow run --nproc-per-node``; set by
        the launcher): ``(version, env, until, incident)`` -> the outcome, its suspects already
        evicted. None: the ladder has no replay rung."""
        self.check: Callable[[dict[str, str], dict[str, Any]], Any] | None = None
        """The stop-time checks on the node's machines (``failslow run --nproc-per-node``;
        set by the launcher): ``(env, incident)`` -> the outcome, its suspects already
        evicted. None: the ladder starts at the reattempt."""

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        version = self._starting_version()
        version, batch, fallback = self._take_pending(version, "start", None)
        restarts = 0
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                ended = self._launch(version, batch)
                if ended is None:  # the new version could not start
                    assert fallback is not None
                    version, batch = fallback, []
                    continue
                status = ended.status
                if self.signalled:
                    return status
                if status == 0:
                    self._finish(batch, "applied")
                    pending = [u.id for u in self.history.updates("pending")]
                    self.history.finish(pending, "expired", "the job ended before it was applied")
                    return 0
                if status == EXIT_UNRESTORABLE:
                    self._finish(batch, "applied")
                    self.incidents["unrestorable"] += 1
                    self.say(
                        "the ranks cannot restore their state from memory (their log says why): "
                        "not restarting - the job needs a person"
                    )
                    return status
                rung = self.ladder.after(
                    replay=self.replay is not None,
                    diagnose=self.check is not None,
                    status=status,
                )
                if rung is not None:
                    self.incidents["metrics"] += 1
                    if rung.name == DIAGNOSE:
                        rung = self.ladder.checked(self._check(version))
                    if rung.name == REPLAY and not self._replay(version, rung.before_step):
                        self._finish(batch, "applied")
                        return status
                    if rung.name == NEEDS_PERSON:
                        self._finish(batch, "applied")
                        return status
                    if rung.name == ROLL_BACK_CODE and not self.options.follower:
                        version, batch, fallback = self._roll_back_code(
                            version, batch, fallback, rung.why,
                            trigger="rollback: the stop-time ladder",
                        )  # fmt: skip
                    self._rollback_before = rung.before_step
                    continue
                if status == EXIT_FOR_RESTART:  # S4: the ranks stopped at a restart plan
                    self._finish(batch, "applied")
                    self.say("relaunching every rank from memory for the S4 restart plan")
                    version, batch, fallback = self._take_pending(version, "S4 restart", None)
                    continue
                blamed = self.ladder.blame()  # an exception in an update's changes
                if blamed is not None:
                    self.incidents["code"] += 1
                    version, batch, fallback = self._roll_back_code(
                        version, batch, fallback, blamed[1], target=blamed[0].id,
                        trigger="rollback: an exception in the update's changes",
                    )  # fmt: skip
                    continue
                stop = ended.stop
                if (stop is not None and stop.requested) or status == EXIT_FOR_UPDATE:
                    self._finish(batch, "applied")
                    step = stop.outcome.apply_step if stop and stop.outcome else None
                    trigger = _trigger(stop.due) if stop else f"exit {EXIT_FOR_UPDATE}"
                    version, batch, fallback = self._take_pending(version, trigger, step)
                    if batch:
                        continue
                    if stop is not None and stop.requested:  # its updates were cancelled
                        self.say("relaunching: no pending update left")
                        continue
                    if stop is None and self.options.follower:  # node 0's agent asked
                        self.say("the ranks stopped for an update: relaunching")
                        continue
                if batch and any(u.kind == "update" for u in batch):
                    assert fallback is not None
                    why = (
                        f"CMD exited with status {status} {ended.lifetime_s:.1f} s after the "
                        f"update, within the {self.options.probation_s:g} s probation window"
                    )
                    self.incidents["failed_after_update"] += 1
                    self._roll_back(batch, why)
                    version, batch = fallback, []
                    continue
                self._finish(batch, "applied")
                self.incidents["failed"] += 1
                restarts += 1
                if restarts > self.options.max_restarts:
                    self.say(
                        f"CMD failed with status {status}; {restarts - 1} restarts already "
                        f"(--max-restarts {self.options.max_restarts}): giving up"
                    )
                    return status
                self.say(
                    f"CMD failed with status {status}: restart {restarts} of "
                    f"{self.options.max_restarts}"
                )
                version, batch, fallback = self._take_pending(version, "failure", None)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _starting_version(self) -> Version:
        """The history's current version when it was made from this same base, else the base."""
        recorded_base = self.history.job("base")
        current = self.history.job("current")
        self.history.set_job("base", self.base.to_dict())
        if recorded_base == self.base.to_dict() and current is not None:
            version = Version.from_dict(current)
            if version != self.base:
                self.say("resuming the job's current version from its update history")
            return version
        return self.base

    def _take_pending(
        self, version: Version, trigger: str, step: int | None
    ) -> tuple[Version, list[Update], Version | None]:
        """Apply every pending update, in order, to ``version``: (new version, the updates,
        the version before them)."""
        fallback, batch = version, []
        for update in self.history.updates("pending"):
            if (
                update.kind == "rollback"
                and self.history.get(update.target or 0).outcome not in LIVE
            ):
                self.history.finish([update.id], "failed", f"#{update.target} is not applied")
                continue
            new = update.apply_to(version, self.history)
            self.history.record_applied(
                update, previous=version, version=new, trigger=trigger, applied_step=step
            )
            batch.append(update)
            version = new
        if batch:
            where = f" at step {step}" if step is not None else ""
            self.say(
                f"relaunching{where} with {_ids(batch)} ({trigger}): "
                + "; ".join(u.describe() for u in batch)
            )
        return version, batch, (fallback if batch else None)

    def _check(self, version: Version) -> Any:
        """The ladder's first rung: the stop-time checks (their suspects evicted)."""
        assert self.check is not None
        return self.check(version.environment(self.env), self.ladder.incident)

    def _replay(self, version: Version, until: int) -> bool:
        """The ladder's replay rung: whether it named (and evicted) a machine."""
        assert self.replay is not None
        env = version.environment(self.env)
        env[envvars.RESTART] = str(self.launches)
        outcome = self.replay(version, env, until, self.ladder.incident)
        self.ladder.replayed(outcome)
        return bool(outcome.suspects)

    def _roll_back_code(
        self,
        version: Version,
        batch: list[Update],
        fallback: Version | None,
        why: str,
        target: int | None = None,
        trigger: str = "rollback",
    ) -> tuple[Version, list[Update], Version | None]:
        """Roll back ``target`` (default: the latest applied update) and every update after
        it: the batch on probation when it holds ``target``, else through the history."""
        ids = [u.id for u in batch if u.kind == "update"]
        if fallback is not None and ids and (target is None or target in ids):
            self._roll_back(batch, why)
            return fallback, [], None
        self._finish(batch, "applied")
        self.history.request_rollback(target, note=why)
        return self._take_pending(version, trigger, None)

    def _launch(self, version: Version, batch: list[Update]) -> _Ended | None:
        env = version.environment(self.env)
        if self._rollback_before is not None:  # this launch only
            env[envvars.ROLLBACK_BEFORE] = str(self._rollback_before)
            self._rollback_before = None
        if self.launches == 0:
            self.ladder.clear()
        applied = [u for u in self.history.updates() if u.outcome in LIVE and u.kind == "update"]
        env[envvars.UPDATE_ID] = str(max((u.id for u in applied), default=0))
        env[envvars.RESTART] = str(self.launches)
        self.history.set_job("current", version.to_dict())
        try:
            self.child = self.spawn(version, env)
        except FailslowError as exc:
            if not any(u.kind == "update" for u in batch):
                raise
            self._roll_back(batch, f"the new version cannot start: {exc}")
            return None
        self.launches += 1
        return self._watch(self.child, batch)

    # -- one launch ----------------------------------------------------------------------------
    def _watch(self, child: subprocess.Popen[bytes], batch: list[Update]) -> _Ended:
        started = time.monotonic()
        stop: _Stop | None = None
        while (returncode := child.poll()) is None:
            if batch and time.monotonic() - started >= self.options.probation_s:
                self._finish(batch, "applied")
                self.say(f"{_ids(batch)} passed probation")
                batch.clear()
            if not self.signalled:
                if stop is None:
                    due = self.history.due(time.time(), self.options.window_s)
                    if due:
                        stop = self._begin_stop(child, due)
                else:
                    stop = self._advance_stop(child, stop)
            try:
                child.wait(timeout=self.options.poll_s)
            except subprocess.TimeoutExpired:
                pass
        status = 128 - returncode if returncode < 0 else returncode
        return _Ended(status, time.monotonic() - started, stop)

    def _begin_stop(self, child: subprocess.Popen[bytes], due: list[Update]) -> _Stop:
        stop = _Stop(due)
        if self.store is None or not self.options.world_size:
            self.say(f"{_ids(due)} ({_trigger(due)}): stopping CMD (SIGTERM, no control store)")
            self._signal(child, signal.SIGTERM)
            stop.terminated_at = time.monotonic()
            return stop
        self.say(f"{_ids(due)} ({_trigger(due)}): asking the ranks to stop at a step boundary")
        plan = StopForUpdate(update_id=due[0].id, reason=due[0].note or due[0].describe())

        def dispatch() -> None:
            from failslow.core.control.plan_channel import dispatch

            stop.outcome = dispatch(
                self.store,
                plan,
                world_size=int(self.options.world_size or 0),
                horizon_steps=self.options.horizon_steps,
                timeout_s=self.options.dispatch_timeout_s,
                token=self.options.job_token,
            )

        stop.thread = threading.Thread(target=dispatch, name="failslow-update", daemon=True)
        stop.thread.start()
        return stop

    def _advance_stop(self, child: subprocess.Popen[bytes], stop: _Stop) -> _Stop | None:
        now = time.monotonic()
        if stop.thread is not None and not stop.thread.is_alive() and stop.deadline is None:
            if stop.outcome is None or not stop.outcome.committed:
                why = stop.outcome.reason if stop.outcome is not None else "dispatch failed"
                key = stop.due[0].id
                self.attempts[key] = tries = self.attempts.get(key, 0) + 1
                timed_out = "accepted within" in why  # not a rank's refusal
                if timed_out and tries < self.options.dispatch_attempts:
                    self.say(f"the ranks did not stop ({why}); asking again")
                    return None  # still pending: the next poll dispatches a new plan
                self.history.finish([u.id for u in stop.due], "failed", f"no stop: {why}")
                self.say(f"{_ids(stop.due)} failed: the ranks did not stop ({why})")
                return None
            stop.deadline = now + self.options.stop_timeout_s
            self.say(f"the ranks stop at step {stop.outcome.apply_step}")
        if stop.deadline is not None and now > stop.deadline and stop.terminated_at is None:
            self.say(f"CMD still running {self.options.stop_timeout_s:g} s after the stop: SIGTERM")
            self._signal(child, signal.SIGTERM)
            stop.terminated_at = now
        if stop.terminated_at is not None and now > stop.terminated_at + self.options.kill_grace_s:
            self._signal(child, signal.SIGKILL)
        return stop

    # -- helpers -------------------------------------------------------------------------------
    def _roll_back(self, batch: list[Update], why: str) -> None:
        self.history.finish([u.id for u in batch], "rolled_back", why)
        self.say(f"{_ids(batch)} rolled back: {why}")

    def _finish(self, batch: list[Update], outcome: str) -> None:
        if batch:
            self.history.finish([u.id for u in batch], outcome)

    def _forward(self, signum: int, _frame: Any) -> None:
        self.signalled = True
        if self.child is not None:
            self._signal(self.child, signum)

    @staticmethod
    def _signal(child: subprocess.Popen[bytes], signum: int) -> None:
        group = getattr(child, "signal_group", None)  # failslow's own ranks (node/ranks.py)
        if group is not None:
            group(signum)
            return
        try:
            os.killpg(child.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _ids(updates: list[Update]) -> str:
    return "update " + ", ".join(f"#{u.id}" for u in updates)


def _trigger(due: list[Update]) -> str:
    first = due[0]
    return "urgent" if first.urgency == "urgent" else "lazy window expired"
