"""Plans from the controller to every rank: all switch at the same step boundary, or none does.

greyhound 5 applies a mitigation "at the next iteration boundary"; in a synchronous job that
boundary must be the *same* step on every rank, or replicas would train on overlapping or
missing samples. Two phases over the control store (DESIGN.md, second channel):

1. **prepare** - the controller writes plan ``n`` (``{prefix}/{n}/plan``) and points
   ``{prefix}/current`` at it. Each rank's poll thread (:class:`PlanReceiver`) checks the plan
   with the adapter (no state change) and either accepts - raising the shared maximum
   ``{prefix}/{n}/latest`` (compare-and-set) to ``its step + horizon``, the last step boundary it
   will pass without a decision, then counting ``{prefix}/{n}/acks`` - or refuses with its
   reason (``{prefix}/{n}/nack``).
2. **decide** - when every rank accepted, the controller commits ``apply_step =
   {prefix}/{n}/latest``; on a refusal or a timeout (a rank died) it aborts. No rank can have
   passed ``apply_step``: each stops at its own ``step + horizon`` until the decision is there,
   so every rank applies at the same boundary. An abort changes nothing anywhere.

Store traffic: one small read per rank per poll, O(1) writes per rank per plan; the controller
reads two counters per check and never a per-rank key (no O(world size) work on any process).
If the controller dies mid-plan, ranks waiting for a decision give up after ``decision_timeout_s``
and keep their current plan - as every other rank does, since no commit was written.

3. **effect** (DESIGN.md, the closed loop) - a commit is the plan's spec, not its status. After
   the apply step each rank checks what it actually ran against the plan (its own counters:
   micro-batches, gradient weight and data share for S2, its role for S3) and reports through
   its poll thread: ``{prefix}/{n}/ran`` counts the ranks that ran it, ``{prefix}/{n}/not_ran``
   those that did not, ``{prefix}/{n}/why`` holds the first one's reason. The controller reads
   the two counters (:func:`read_effect`) and calls the plan in effect only when every rank
   said so. O(1) writes per rank per plan, two counter reads per controller check.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from failslow.core.control import keys
from failslow.core.control.polling import PollingThread
from failslow.core.control.stop import StopForUpdate
from failslow.core.control.store import Store
from failslow.core.planner.plans import PLAN_TYPES, Plan, plan_from_dict, plan_to_dict

log = logging.getLogger(__name__)

CHANNEL_TYPES = {**PLAN_TYPES, StopForUpdate.__name__: StopForUpdate}
"""What the channel carries: every plan kind, and the stop for a hot update."""


class PlanResult:
    """The outcomes ``failslow_on_plan_result`` reports, and who reports each."""

    COMMITTED = "committed"
    """Controller process: every rank accepted the plan; it takes effect at ``step``."""
    ABORTED = "aborted"
    """Controller process, and every rank: a rank refused or did not answer in time; no rank
    changed anything (``step`` is None)."""
    APPLIED = "applied"
    """Rank process: this rank runs the plan from ``step`` (for a hot update's stop: it
    committed its snapshot and exits)."""
    ROLLED_BACK = "rolled back"
    """Rank process: some rank failed to switch at ``step``; every rank went back to the plan
    in effect before."""
    IN_EFFECT = "in effect"
    """Rank process: after ``step`` this rank checked what it ran and it was the plan;
    controller process: every rank said so."""
    NOT_IN_EFFECT = "not in effect"
    """Rank process: what this rank ran at ``step`` was not the plan (``detail`` says what it
    ran); controller process: a rank said so, or not every rank confirmed in time - the plan
    is rolled back."""


@dataclass(frozen=True)
class PlanOutcome:
    epoch: int
    plan: Plan
    apply_step: int | None
    """The step boundary where every rank switches; None when aborted."""
    reason: str = ""
    seconds: float = 0.0
    refused: bool = False
    """Aborted because a rank refused it at prepare (not a timeout): it cannot apply here."""

    @property
    def committed(self) -> bool:
        return self.apply_step is not None


# -------------------------------------------------------------------------------------------
# controller side
# -------------------------------------------------------------------------------------------


def dispatch(
    store: Store,
    plan: Plan,
    *,
    world_size: int,
    horizon_steps: int,
    timeout_s: float = 60.0,
    prefix: str = keys.PLANS,
    poll_s: float = 0.02,
    token: str | None = None,
) -> PlanOutcome:
    """Prepare ``plan`` on every rank and commit it, or abort; returns the outcome. ``token``:
    the job's token (ranks that hold one ignore plans without it)."""
    started = time.monotonic()
    n = store.add(f"{prefix}/count", 1)
    base = f"{prefix}/{n}"
    record: dict[str, Any] = {"plan": plan_to_dict(plan), "horizon_steps": horizon_steps}
    if token:
        record["token"] = token
    store.set_json(f"{base}/plan", record)
    store.set_json(f"{prefix}/current", {"epoch": n})
    reason, refused = "", False
    while True:
        if store.add(f"{base}/nacks", 0) > 0:
            reason = (store.get(f"{base}/nack") or b"a rank refused").decode()
            refused = True
            break
        if store.add(f"{base}/acks", 0) >= world_size:
            break
        if time.monotonic() - started > timeout_s:
            acks = store.add(f"{base}/acks", 0)
            reason = f"only {acks} of {world_size} ranks accepted within {timeout_s:g} s"
            break
        time.sleep(poll_s)
    if reason:
        store.set_json(f"{base}/decision", {"abort": reason})
        return PlanOutcome(n, plan, None, reason, time.monotonic() - started, refused)
    apply_step = int((store.get(f"{base}/latest") or b"0").decode())
    store.set_json(f"{base}/decision", {"apply_step": apply_step})
    return PlanOutcome(n, plan, apply_step, "", time.monotonic() - started)


@dataclass(frozen=True)
class Effect:
    """What the ranks reported of plan ``n`` after its apply step."""

    ran: int
    """Ranks that ran the plan."""
    not_ran: int
    """Ranks that did not."""
    why: str = ""
    """The first of those ranks' reason."""

    def state(self, world_size: int) -> str:
        """``"in effect"`` (every rank ran it), ``"not in effect"`` (a rank did not) or
        ``"pending"``."""
        if self.not_ran:
            return PlanResult.NOT_IN_EFFECT
        return PlanResult.IN_EFFECT if self.ran >= world_size else "pending"


def read_effect(store: Store, epoch: int, *, prefix: str = keys.PLANS) -> Effect:
    """The ranks' reports on plan ``epoch`` so far (two counter reads; the reason only when a
    rank did not run it)."""
    base = f"{prefix}/{epoch}"
    not_ran = store.add(f"{base}/not_ran", 0)
    why = ""
    if not_ran:
        why = (store.get(f"{base}/why") or b"a rank did not run it").decode()
    return Effect(store.add(f"{base}/ran", 0), not_ran, why)


def horizon_steps(step_time_s: float | None, horizon_s: float, minimum: int = 2) -> int:
    """Steps that cover ``horizon_s`` at the job's step time (at least ``minimum``)."""
    if not step_time_s or step_time_s <= 0:
        return max(minimum, 8)
    return max(minimum, math.ceil(horizon_s / step_time_s))


# -------------------------------------------------------------------------------------------
# rank side
# -------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    epoch: int
    plan: Plan
    block_at: int
    apply_step: int | None = None
    aborted: str = ""


def raise_max(store: Store, key: str, value: int) -> None:
    """Atomically ``store[key] = max(store[key], value)`` (compare-and-set loop)."""
    while True:
        current = store.get(key)
        if current is not None and int(current.decode()) >= value:
            return
        if store.compare_set(key, current, str(value).encode()):
            return


class PlanReceiver:
    """The rank's end of the channel. ``prepare(plan)`` raises if this rank cannot apply it;
    ``step()`` returns the rank's current step; the training thread calls :meth:`due` at every
    step boundary and gets the plan to apply there, if any."""

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        prepare: Callable[[Plan], None],
        step: Callable[[], int],
        prefix: str = keys.PLANS,
        decision_timeout_s: float = 60.0,
        poll_s: float = 0.2,
        token: str | None = None,
    ) -> None:
        self.store = store
        self.token = token
        self.rank = rank
        self._prepare = prepare
        self._step = step
        self.prefix = prefix
        self.decision_timeout_s = decision_timeout_s
        self.poll_s = poll_s
        self.epoch = int((store.get_json(f"{prefix}/current") or {}).get("epoch", 0))
        """Plans up to this epoch were dispatched before this rank joined: not ours."""
        self._pending: _Pending | None = None
        self._lock = threading.Lock()
        self._poller = PollingThread(self.poll, name="failslow-plans", poll_s=poll_s)
        self.outcomes: list[tuple[int, Plan, int | None, str]] = []
        """(epoch, plan, apply step or None, abort reason) of every plan this rank decided."""
        self._data_step = 0
        """The first step whose data this rank has not read yet (loaders read ahead)."""
        self.due_epoch: int | None = None
        """The epoch of the plan :meth:`due` returned last."""
        self._effects: list[tuple[int, str]] = []
        """(epoch, reason; "" = ran it) this rank checked and the poll thread has not sent."""

    def start(self) -> PlanReceiver:
        self._poller.start()
        return self

    def stop(self) -> None:
        self._poller.stop()
        try:
            self._send_effects()  # a report made at the last step boundary still goes out
        except Exception:  # the store may be gone at exit: nothing to tell it then
            log.debug("failslow: effect reports not sent at stop", exc_info=True)

    def report_effect(self, epoch: int, reason: str) -> None:
        """What this rank ran at plan ``epoch``'s apply step: ``reason`` empty if it ran the
        plan, else what it ran instead. Sent by the poll thread (the training thread calls
        this and goes on; no store access there)."""
        with self._lock:
            self._effects.append((epoch, reason))

    def _send_effects(self) -> None:
        with self._lock:
            effects, self._effects = self._effects, []
        for epoch, reason in effects:
            base = f"{self.prefix}/{epoch}"
            if reason:
                self.store.compare_set(f"{base}/why", None, f"rank {self.rank}: {reason}".encode())
                self.store.add(f"{base}/not_ran", 1)
            else:
                self.store.add(f"{base}/ran", 1)

    def poll(self) -> None:
        """One poll: send this rank's effect reports; accept or refuse a new plan; fetch the
        decision of a pending one."""
        if self._effects:
            self._send_effects()
        with self._lock:
            pending = self._pending
        if pending is not None:
            if pending.apply_step is None and not pending.aborted:
                self._read_decision(pending)
            return
        current = self.store.get_json(f"{self.prefix}/current")
        if not current or int(current.get("epoch", 0)) <= self.epoch:
            return
        epoch = int(current["epoch"])
        self.epoch = epoch
        base = f"{self.prefix}/{epoch}"
        record = self.store.get_json(f"{base}/plan")
        if record is None:
            return
        if self.store.get(f"{base}/decision") is not None:
            return  # decided before this rank joined (a restarted process): not for it
        if not keys.authorized(record, self.token):
            log.warning("failslow: ignored plan %d: no valid job token", epoch)
            return
        try:
            plan = plan_from_dict(record["plan"], CHANNEL_TYPES)
            self._prepare(plan)
        except Exception as exc:
            why = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            self.store.compare_set(f"{base}/nack", None, why.encode())
            self.store.add(f"{base}/nacks", 1)
            log.warning("failslow: refused plan %d: %s", epoch, why)
            return
        with self._lock:
            # past the horizon, and past every step whose data this rank already read ahead
            block_at = max(self._step() + int(record.get("horizon_steps", 2)), self._data_step)
            self._pending = _Pending(epoch, plan, block_at)
        raise_max(self.store, f"{base}/latest", block_at)
        self.store.add(f"{base}/acks", 1)

    def _read_decision(self, pending: _Pending) -> bool:
        decision = self.store.get_json(f"{self.prefix}/{pending.epoch}/decision")
        if decision is None:
            return False
        with self._lock:
            if "apply_step" in decision:
                pending.apply_step = int(decision["apply_step"])
            else:
                pending.aborted = str(decision.get("abort", "aborted"))
        return True

    def _wait_decision(self, pending: _Pending) -> None:
        deadline = time.monotonic() + self.decision_timeout_s
        while not self._read_decision(pending):
            if time.monotonic() > deadline:
                pending.aborted = (
                    f"no decision within {self.decision_timeout_s:g} s (controller gone?)"
                )
                return
            time.sleep(0.01)

    def before_data(self, step: int) -> list[tuple[int, Plan]]:
        """Before this rank's data loading reads step ``step`` (it may run ahead of training):
        the committed plan that takes effect at ``step`` or earlier, as ``[(apply_step,
        plan)]``. A plan this rank accepted could take effect from its horizon on, so reading
        that far waits for the decision, as :meth:`due` does; a plan accepted later starts
        after the data read so far."""
        with self._lock:
            self._data_step = max(self._data_step, step + 1)
            pending = self._pending
        if pending is None:
            return []
        if pending.apply_step is None and not pending.aborted and step >= pending.block_at:
            self._wait_decision(pending)
        if pending.apply_step is not None and pending.apply_step <= step:
            return [(pending.apply_step, pending.plan)]
        return []

    def due(self, step: int) -> Plan | None:
        """At step boundary ``step`` (training thread): the plan to apply now, if any. Waits
        here only when this rank reached its horizon before the decision arrived."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return None
        if pending.apply_step is None and not pending.aborted and step >= pending.block_at:
            self._wait_decision(pending)
        if pending.aborted:
            self._finish(pending, None, pending.aborted)
            return None
        if pending.apply_step is not None and step >= pending.apply_step:
            if step > pending.apply_step:  # cannot happen: the horizon bounds every rank
                raise RuntimeError(
                    f"failslow: plan {pending.epoch} was due at step {pending.apply_step}, "
                    f"rank {self.rank} is at step {step}"
                )
            self._finish(pending, pending.apply_step, "")
            self.due_epoch = pending.epoch
            return pending.plan
        return None

    def _finish(self, pending: _Pending, step: int | None, reason: str) -> None:
        with self._lock:
            self._pending = None
        self.outcomes.append((pending.epoch, pending.plan, step, reason))

    def pending(self) -> dict[str, Any] | None:
        with self._lock:
            p = self._pending
        if p is None:
            return None
        return {"epoch": p.epoch, "block_at": p.block_at, "apply_step": p.apply_step}
