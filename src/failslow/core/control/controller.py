"""The controller: TRACKING -> PROFILING -> VALIDATING -> DIAGNOSED -> TRACKING (greyhound 4.1).

One per job, embedded beside rank 0 / in the launcher, or its own process (``failslow
controller --store URL``). It only reads what the nodes publish (:mod:`.publisher`: onsets,
reliefs, per-group summaries) and what the ranks' agents report (:mod:`.agent`: their position
on the pause group, validation results):

- TRACKING: wait for a new onset (one counter read per tick; one more for the nodes'
  transients, which are journaled and nothing else - issue 47). Onsets soon after a round
  (``cooldown_s``) are absorbed as that fail-slow's own; while a plan is in effect a round
  re-validates every ``recheck_every_s`` or at a relief. An onset that steps up from the slow
  level of the fail-slow diagnosed last (:meth:`Controller._compound`: a ladder's next rung, or
  a second fault on top of the first) is localized at once, in or out of the cooldown: the
  plan being bought may be for a root cause that is no longer the worst.
- PROFILING: read every rank's group summaries once, build per-instance group profiles and
  name suspects: degraded groups (communication) and late ranks (compute) (greyhound 4.3,
  falcon 4.3). With no suspect the GEMM still runs on every rank: a straggler that is never
  late at a collective (e.g. the only pipeline stage) is then still caught.
- VALIDATING: pause every rank at the same point: ranks driven by an adapter's session at the
  boundary of one training step none has reached (any parallel layout); capture-only ranks at
  the same collective of the pause group, at an index none has reached (their published
  positions + a margin for the round trip), moved to the first call of an iteration when every
  rank reports the same phase (:mod:`.phase`). Then run GEMM on every rank
  (the peers' median needs them) and the O(1) ring/tree link passes of every degraded
  communicator, over its ranks in its own group order - the links it uses, not a ring over
  sorted suspects (:func:`link_groups`; the world when no suspect is a communicator), always
  release.
- DIAGNOSED: write the diagnosis to the store, to ``<log_dir>/diagnosis-<n>.json`` and hand it
  to ``on_diagnosis`` (the plugin observation hook's call site), then back to TRACKING.

Every state change and its wall time is kept in :attr:`Controller.history` (reaction times).
"""

from __future__ import annotations

import enum
import json
import logging
import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from failslow.core.control import job_record, keys
from failslow.core.control.journal import event
from failslow.core.control.phase import align
from failslow.core.control.store import Store
from failslow.core.control.validator import (
    AGENT_POLL_S,
    PauseMissed,
    ValidationTimeout,
    validation_round,
)
from failslow.core.diagnosis.record import Diagnosis
from failslow.core.localize.config import DetectionConfig, ValidationConfig
from failslow.core.localize.diagnose import diagnose

log = logging.getLogger(__name__)


class State(enum.Enum):
    TRACKING = "tracking"
    PROFILING = "profiling"
    VALIDATING = "validating"
    DIAGNOSED = "diagnosed"


@dataclass
class Transition:
    state: State
    wall: float
    detail: dict[str, Any] = field(default_factory=dict)


class Controller:
    def __init__(
        self,
        store: Store,
        *,
        world_size: int,
        detection: DetectionConfig | None = None,
        validation: ValidationConfig | None = None,
        log_dir: Path | None = None,
        node_prefix: str = keys.NODE,
        agent_prefix: str = keys.VALIDATE,
        token: str | None = None,
        on_diagnosis: Callable[[Diagnosis], None] | None = None,
        mitigation_active: Callable[[], bool] | None = None,
        on_healthy: Callable[[], None] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.store = store
        self.on_event = on_event
        """Gets every state change and every onset taken in (:mod:`.journal`'s events)."""
        self.world_size = world_size
        self.detection = detection or DetectionConfig()
        self.validation = validation or ValidationConfig()
        self.log_dir = log_dir
        self.node_prefix = node_prefix
        self.agent_prefix = agent_prefix
        self.token = token
        self.on_diagnosis = on_diagnosis
        self.mitigation_active = mitigation_active
        self.on_healthy = on_healthy
        self._recheck = False
        self._last_round = time.time()
        self.state = State.TRACKING
        self.history: list[Transition] = [Transition(State.TRACKING, time.time())]
        self.diagnoses: list[Diagnosis] = []
        self._seen_events = store.add(f"{node_prefix}/onsets", 0)
        self._seen_transients = store.add(f"{node_prefix}/{keys.TRANSIENTS}", 0)
        self._onsets: list[dict[str, Any]] = []
        self._suspects: list[Any] = []
        self._pending: Diagnosis | None = None
        self._diagnosed_at = -math.inf
        self._held: list[dict[str, Any]] = []
        """Onsets absorbed in the cooldown after a round that found every rank healthy: a
        fail-slow can begin right after a false alarm, and its onsets come only once."""
        self._last_healthy = False
        self._slow_from: float | None = None
        """The iteration time the fail-slow diagnosed last started from (its onsets' median
        ``before_s``; None after a relief or a healthy round): :meth:`_compound`'s line."""
        self.wake = threading.Event()
        """Set by a node publisher in the same process when it has written an onset or relief
        (``failslow run`` hosts both): :meth:`run` ticks at once instead of after ``tick_s``."""
        self.wake_publisher: Callable[[], None] | None = None
        """A node publisher in the same process (``failslow run`` hosts both): asked directly
        when summaries are requested (:meth:`failslow.node.publisher.NodePublisher.ask`)."""
        self.summary_wait_s = 0.75
        """How long :meth:`request_summaries` waits for every rank's (a publisher polls at
        least every 0.2 s, or 0.45 s while its ranks are calm:
        :meth:`failslow.node.publisher.NodePublisher.next_wait`)."""

    def request_summaries(self) -> int:
        """Ask every node publisher for its ranks' group summaries of this moment (greyhound
        4.1: the GlobalAnalyzer asks when it profiles) and wait until publishers of every rank
        answered or :attr:`summary_wait_s` passed - a node that does not answer leaves its last
        summaries in place. Returns how many ranks answered. One counter add, then one read
        per 5 ms: the controller's cost, never a rank's."""
        prefix = f"{self.node_prefix}/{keys.PROFILE}"
        n = self.store.add(prefix, 1)
        if self.wake_publisher is not None:
            self.wake_publisher()
        deadline = time.monotonic() + self.summary_wait_s
        world = self._world()
        while True:
            answered = self.store.add(f"{prefix}/{n}/ranks", 0)
            if answered >= world or time.monotonic() >= deadline:
                return answered
            time.sleep(0.005)

    def _enter(self, state: State, **detail: Any) -> None:
        self.state = state
        self.history.append(Transition(state, time.time(), detail))
        log.info("failslow controller: %s %s", state.value, detail or "")
        self._emit("state", state=state.value, detail=detail)

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(event(kind, **fields))

    # ---- one tick of the state machine -------------------------------------------------------
    def tick(self) -> State:
        if self.state is State.TRACKING:
            self._track()
        elif self.state is State.PROFILING:
            self._profile()
        elif self.state is State.VALIDATING:
            self._validate()
        elif self.state is State.DIAGNOSED:
            self._publish()
        return self.state

    def run(self, stop: Callable[[], bool], tick_s: float = 0.05) -> None:
        while not stop():
            before = self.state
            try:
                self.tick()
            except Exception as exc:  # a store gone mid-round: back to tracking, keep running
                if stop():
                    return
                log.warning("failslow controller: %s failed: %s", self.state.value, exc)
                self._abandon(f"{type(exc).__name__}: {exc}")
            if self.state is before and self.wake.wait(tick_s):
                self.wake.clear()  # what set it is in the store already: the next tick reads it

    def _track(self) -> None:
        new, self._seen_events = self._journal_new(
            f"{self.node_prefix}/onsets", "onset", self._seen_events
        )
        # transients go to the journal and nowhere else: a slowdown over before it persisted
        # starts no round (issue 47)
        _, self._seen_transients = self._journal_new(
            f"{self.node_prefix}/{keys.TRANSIENTS}", "transient", self._seen_transients
        )
        relief = any(r.get("type") == "relief" for r in new)
        onsets = [r for r in new if r.get("type") == "onset"]
        compound = self._compound(onsets)
        if relief:
            self._diagnosed_at = -math.inf  # the fail-slow is over: the next onset is new
            self._held, self._slow_from = [], None
        if self.mitigation_active is not None and self.mitigation_active():
            since = time.time() - self._last_round
            due = since >= self.validation.recheck_every_s
            # a relief soon after a round is usually the plan's own effect on the step time
            if (relief and since >= self.detection.cooldown_s) or due or compound:
                self._recheck, self._onsets = True, new
                why = "relief" if relief else "compound" if compound else "periodic"
                self._enter(State.PROFILING, recheck=why)
                return
        cooling = time.time() - self._diagnosed_at < self.detection.cooldown_s
        if onsets and cooling and not compound:
            self.history.append(Transition(State.TRACKING, time.time(), {"absorbed": onsets}))
            if self._last_healthy:
                self._held += onsets
            return
        if not onsets and self._held and not cooling:
            # the cooldown after a healthy round is over and no relief came: still slow
            onsets = self._held
        if onsets:
            self._held = []
            self._onsets = onsets
            self._enter(State.PROFILING, onsets=onsets)

    def _journal_new(
        self, counter: str, kind: str, seen: int
    ) -> tuple[list[dict[str, Any]], int]:
        """The node records under ``counter`` after the ``seen`` first, each journaled as an
        event of ``kind``; returns them and how many there are now."""
        count = self.store.add(counter, 0)
        new = []
        while seen < count:
            seen += 1
            key = f"{counter}/{seen}"
            self.store.wait([key], 1.0)
            record = self.store.get_json(key)
            if record is not None:
                new.append(record)
                self._emit(kind, **{k: v for k, v in record.items() if k != "wall"})
        return new, seen

    def _compound(self, onsets: list[dict[str, Any]]) -> bool:
        """Whether one of ``onsets`` starts from the slow level of the fail-slow diagnosed
        last: its ``before_s`` at least ``threshold`` (1.1) x the level that fail-slow started
        from. The diagnosed fail-slow's own onsets, reported late by other ranks, start from
        the healthy level and stay absorbed; a further step up is new (seen in the S4 demo: a
        load change was diagnosed as a slow link, the injected slow GPU came 4 s later, and
        the restart the planner bought at its break-even evicted the link's host)."""
        if self._slow_from is None:
            return False
        line = self._slow_from * self.detection.threshold
        return any(float(o.get("before_s") or 0.0) >= line for o in onsets)

    def _profile(self) -> None:
        from failslow.core.localize.profiling import degraded_groups, group_profiles, late_ranks
        from failslow.core.localize.summaries import GroupSummary

        answered = self.request_summaries()
        summaries = []
        for rank in range(self._world()):
            items = self.store.get_json(f"{self.node_prefix}/summaries/{rank}") or []
            summaries += [GroupSummary.from_dict(item) for item in items]
        profiles = group_profiles(summaries)
        suspects = degraded_groups(profiles, threshold=self.detection.threshold)
        suspects += late_ranks(profiles)
        self._suspects = suspects
        self._enter(
            State.VALIDATING, suspects=[s.to_dict() for s in suspects], summarized=answered
        )

    def _target(self, widen: float) -> dict[str, int] | None:
        """Where every rank pauses, ahead of its published position: ``{"step": S}`` when
        every rank is driven by a session (the boundary of training step S - any parallel
        layout), else ``{"group_key": k, "call_index": c}`` on the group every rank published;
        None when neither exists. The margin is ``widen`` x :meth:`_margin_s`."""
        positions = [
            self.store.get_json(f"{self.agent_prefix}/progress/{r}") for r in range(self._world())
        ]
        if any(p is None for p in positions):
            return None
        margin_s = widen * self._margin_s(positions)
        now = time.time()
        if all("step" in p for p in positions):
            ahead = max(
                p["step"] + p.get("step_rate", 0.0) * max(0.0, now - p["t"]) for p in positions
            )
            rate = max(p.get("step_rate", 0.0) for p in positions)
            return {"step": math.floor(ahead) + max(1, math.ceil(rate * margin_s))}
        if any("group_key" not in p for p in positions):
            return None
        group_keys = {p["group_key"] for p in positions}
        if len(group_keys) != 1:
            return None
        # where each rank is now: its published position moved on at its published rate
        ahead = max(p["next"] + p.get("rate", 0.0) * max(0.0, now - p["t"]) for p in positions)
        rate = max(p.get("rate", 0.0) for p in positions)
        target = math.ceil(ahead) + max(2, math.ceil(rate * margin_s))
        # the phase is a property of the shared call sequence: a majority of ranks decides (a
        # straggler's own gaps are distorted by whatever slows it)
        votes = Counter(tuple(p["phase"]) for p in positions if p.get("phase"))
        if votes:
            phase, count = votes.most_common(1)[0]
            if 2 * count > len(positions):
                target = align(target, (int(phase[0]), int(phase[1])))
        return {"group_key": group_keys.pop(), "call_index": target}

    def _margin_s(self, positions: list[dict[str, Any]]) -> float:
        """How far ahead of the ranks the pause lands: the configured margin, else 1.5 x the
        slowest agent's poll period (each sees the request within one poll; it publishes the
        period beside its position)."""
        if self.validation.pause_margin_s is not None:
            return self.validation.pause_margin_s
        return 1.5 * max(float(p.get("poll_s", AGENT_POLL_S)) for p in positions)

    def _world(self) -> int:
        """The ranks the job has now (the job record's: fewer after it went on without lost
        ranks), else the configured number."""
        return job_record.world_size(self.store, self.world_size)

    def _validate(self) -> None:
        from failslow.core.localize.validation.schedules import communicator_passes

        passes = communicator_passes(link_groups(self._suspects, self._world()))
        tasks = [
            self.validation.gemm_task(self.detection.threshold),
            {
                "kind": "links",
                "passes": [[list(link) for link in one] for one in passes],
                "nbytes": self.validation.link_mb << 20,
                "repetitions": self.validation.link_repetitions,
                "confirm": self.detection.threshold,  # a link the diagnosis would call slow
            },
        ]
        widen = 1.0
        for attempt in range(self.validation.pause_attempts):
            target = self._target(widen)
            if target is None:
                self._abandon("no common pause group published by the ranks")
                return
            try:
                result = validation_round(
                    self.store,
                    world_size=self._world(),
                    **target,
                    tasks=tasks,
                    timeout_s=self.validation.pause_timeout_s,
                    prefix=self.agent_prefix,
                    token=self.token,
                )
                break
            except PauseMissed as exc:  # released at once; aim further ahead
                log.info("failslow controller: %s (attempt %d)", exc, attempt + 1)
                widen *= 2
            except ValidationTimeout as exc:
                self._abandon(str(exc))
                return
        else:
            self._abandon("every pause attempt was missed by some rank")
            return
        gemm, links = result.results
        evidence = {
            "onsets": self._onsets,
            "suspects": [s.to_dict() for s in self._suspects],
            "round": result.epoch,
            "paused_s": result.paused_s,
            "target": target,
        }
        self._pending = diagnose(gemm, links, threshold=self.detection.threshold, evidence=evidence)
        self._enter(
            State.DIAGNOSED, healthy=self._pending is None, paused_s=result.paused_s,
            recheck=self._recheck,
        )  # fmt: skip

    def _abandon(self, error: str) -> None:
        self._recheck, self._last_round = False, time.time()
        self._enter(State.TRACKING, error=error)

    def _publish(self) -> None:
        diagnosis, self._pending = self._pending, None
        self._diagnosed_at = self._last_round = time.time()
        recheck, self._recheck = self._recheck, False
        self._last_healthy = diagnosis is None and not recheck
        started = [
            float(o["before_s"])
            for o in self._onsets
            if o.get("type") == "onset" and o.get("before_s")
        ]
        if diagnosis is None:
            self._slow_from = None
        elif started:  # a periodic re-validation has no onsets: the line stays
            self._slow_from = statistics.median(started)
        mitigating = recheck or (self.mitigation_active is not None and self.mitigation_active())
        if diagnosis is None and mitigating and self.on_healthy is not None:
            # every rank measured healthy while a plan is in effect - also in a round an onset
            # started (after a relief the next onset is not absorbed, and its round resets the
            # periodic re-validation's clock: seen in the DeepSpeed demo, the S2 split stayed
            # in effect 80 steps after the release until the job ended)
            try:
                self.on_healthy()
            except Exception:
                log.warning("failslow: on_healthy observer failed", exc_info=True)
        if diagnosis is not None:
            self.diagnoses.append(diagnosis)
            self._emit("diagnosis", diagnosis=json.loads(diagnosis.to_json()))
            n = self.store.add(keys.DIAGNOSES, 1)
            self.store.set(f"{keys.DIAGNOSES}/{n}", diagnosis.to_json().encode())
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                path = self.log_dir / f"diagnosis-{n}.json"
                path.write_text(json.dumps(json.loads(diagnosis.to_json()), indent=2) + "\n")
            if self.on_diagnosis is not None:
                try:
                    self.on_diagnosis(diagnosis)  # the observation hook's call site
                except Exception:
                    log.warning("failslow: on_diagnosis observer failed", exc_info=True)
        self._enter(State.TRACKING)


def link_groups(suspects: list[Any], world_size: int) -> list[tuple[int, ...]]:
    """The communicators whose links a validation round tests: every degraded one, its ranks in
    its group order (:class:`~failslow.core.localize.profiling.Suspect` keeps the order of the
    membership records); the world's ring and tree when none is (compute suspects only, or no
    suspect at all)."""
    groups = [
        tuple(s.ranks) for s in suspects if s.kind == "communication" and len(s.ranks) >= 2
    ]
    return groups or [tuple(range(world_size))]
