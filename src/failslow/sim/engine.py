"""Event-driven simulation of one training job under one mitigation policy.

The clock advances one training step at a time at the step time of the current state (the
step model is re-evaluated only when the state changes), interleaved with the scenario's
events: fail-slows start and end, hosts fail and come back. Detection is modelled by its
measured latency (greyhound Table 6): the policy hears of an onset ``detect_s`` after the set
of fail-slows affecting the job changed, with the diagnosis of the state at that moment
(true slowdowns - localization accuracy is measured elsewhere), and of relief
``relief_detect_s`` after the last one ended. Policies act through :class:`Simulation`'s
methods, which charge each action's pause and lost progress on the same clock.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.topology import Topology
from failslow.sim.scenario import FailSlow, FailStop, Scenario
from failslow.sim.stepmodel import HostPair, host_pair, step_time

if TYPE_CHECKING:
    from failslow.sim.policies import Policy


@dataclass
class Trace:
    """What one run produced: (time, completed steps) samples and marked actions."""

    policy: str
    times: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    actions: list[tuple[float, str]] = field(default_factory=list)
    lost_steps: int = 0
    paused_s: float = 0.0

    @property
    def final_steps(self) -> int:
        return self.steps[-1] if self.steps else 0


class Simulation:
    def __init__(self, scenario: Scenario, policy: Policy) -> None:
        self.scenario = scenario
        self.costs = scenario.costs
        self.topology: Topology = scenario.topology
        self.even_counts = self._even(scenario.topology)
        self.counts: list[int] = list(self.even_counts)
        self.degraded_step_s: float | None = None
        """Step time of a re-planned layout after fail-stops (from the odyssey model)."""
        self.down: set[str] = set()
        self.spares = scenario.spares
        """Warm standbys left; a repaired host that had been replaced becomes one."""
        self._replaced: set[str] = set()
        self.t = 0.0
        self.steps = 0
        self._checkpoint_steps = 0
        self._next_checkpoint = self.costs.checkpoint_interval_s
        self._spares = (f"spare{i:05d}" for i in itertools.count())
        self._active: list[FailSlow] = []
        self._cached: float | None = None
        self._queue: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._notified: tuple[object, ...] = ()
        self.policy = policy
        self.trace = Trace(policy.name)
        for event in scenario.events:
            if isinstance(event, FailSlow):
                self._push(event.start_s, "slow-start", event)
                self._push(event.end_s, "slow-end", event)
            else:
                self._push(event.time_s, "stop", event)

    @staticmethod
    def _even(topology: Topology) -> list[int]:
        base, extra = divmod(topology.micro_batches, topology.dp)
        return [base + (1 if d < extra else 0) for d in range(topology.dp)]

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self._queue, (at, next(self._seq), kind, payload))

    # ---- state the policies read -------------------------------------------------------
    def affecting(self) -> tuple[dict[int, float], dict[HostPair, float]]:
        """Slow ranks and slow host pairs of the fail-slows that touch the job's hosts now."""
        compute: dict[int, float] = {}
        links: dict[HostPair, float] = {}
        for fs in self._active:
            if fs.gpu is not None:
                ranks = self.topology.ranks_on(fs.gpu[0])
                if fs.gpu[1] < len(ranks):
                    rank = ranks[fs.gpu[1]]
                    compute[rank] = max(compute.get(rank, 1.0), fs.slowdown)
            elif fs.link is not None:
                a, b = fs.link
                if self.topology.ranks_on(a) and self.topology.ranks_on(b):
                    pair = host_pair(a, b)
                    links[pair] = max(links.get(pair, 1.0), fs.slowdown)
        return compute, links

    def touching(self) -> list[FailSlow]:
        """The active fail-slows that touch the job's hosts now (hindsight: they carry their
        end; only the oracle policy reads this)."""
        out = []
        for fs in self._active:
            if fs.gpu is not None:
                if fs.gpu[1] < len(self.topology.ranks_on(fs.gpu[0])):
                    out.append(fs)
            elif fs.link is not None and all(self.topology.ranks_on(h) for h in fs.link):
                out.append(fs)
        return out

    def upcoming(self, *kinds: str) -> float | None:
        """When the next queued event of one of ``kinds`` ("stop", "repair", "slow-start",
        "slow-end") after now happens (hindsight; only the oracle policy reads this)."""
        return min(
            (at for at, _, kind, _ in self._queue if kind in kinds and at > self.t), default=None
        )

    def diagnosis(self) -> Diagnosis | None:
        compute, links = self.affecting()
        if not compute and not links:
            return None
        kind = Kind.BOTH if compute and links else Kind.COMPUTE if compute else Kind.COMMUNICATION
        slow_links = tuple(
            SlowLink(self.topology.ranks_on(a)[0], self.topology.ranks_on(b)[0], s)
            for (a, b), s in sorted(links.items())
        )
        return Diagnosis(
            kind, tuple(SlowRank(r, s) for r, s in sorted(compute.items())), slow_links
        )

    def diagnosis_under(self, layout: Topology) -> Diagnosis | None:
        """What :meth:`diagnosis` would say with the roles placed as ``layout`` places them."""
        saved, self.topology = self.topology, layout
        try:
            return self.diagnosis()
        finally:
            self.topology = saved

    def step_s_under(self, layout: Topology, counts: list[int]) -> float:
        """The step time with the roles placed as ``layout`` and ``counts`` micro-batches per
        replica, under the fail-slows active now (a plan's effect, before applying it)."""
        saved, self.topology = self.topology, layout
        try:
            compute, links = self.affecting()
        finally:
            self.topology = saved
        return step_time(layout, self.scenario.model, counts, compute, links)

    def healthy_step_s(self) -> float:
        return step_time(self.topology, self.scenario.model, self.even_counts, {}, {})

    def step_s(self) -> float:
        if self._cached is None:
            if self.degraded_step_s is not None:
                self._cached = self.degraded_step_s
            else:
                compute, links = self.affecting()
                self._cached = step_time(
                    self.topology, self.scenario.model, self.counts, compute, links
                )
        return self._cached

    # ---- actions the policies take -----------------------------------------------------
    def mark(self, label: str) -> None:
        self.trace.actions.append((self.t, label))

    def changed(self) -> None:
        self._cached = None
        self._schedule_detection()

    def pause(self, seconds: float) -> None:
        self.t += seconds
        self.trace.paused_s += seconds

    def set_counts(self, counts: list[int]) -> None:
        self.counts = list(counts)
        self._cached = None

    def set_topology(self, topology: Topology) -> None:
        self.topology = topology
        self.changed()

    def lose_progress(self) -> None:
        """Roll back to the last remote checkpoint (fail-stop without in-memory state)."""
        lost = self.steps - self._checkpoint_steps
        self.steps -= lost
        self.trace.lost_steps += lost

    def replace_hosts(self, hosts: list[str], *, warm: bool = False) -> None:
        """Swap ``hosts`` for other nodes (a restart that evicts them); ``warm`` takes them
        from the standby pool (the caller checked ``spares``)."""
        mapping = {h: next(self._spares) for h in hosts}
        if warm:
            self.spares -= len(hosts)
        self._replaced.update(hosts)
        self.set_topology(
            self.topology.with_hosts([mapping.get(h, h) for h in self.topology.hosts])
        )

    # ---- the loop ----------------------------------------------------------------------
    def _schedule_detection(self) -> None:
        compute, links = self.affecting()
        state = (tuple(sorted(compute.items())), tuple(sorted(links.items())))
        if state == self._notified:
            return
        delay = self.costs.detect_s if (compute or links) else self.costs.relief_detect_s
        self._push(self.t + delay, "detect", state)

    def _deliver(self, state: object) -> None:
        compute, links = self.affecting()
        now = (tuple(sorted(compute.items())), tuple(sorted(links.items())))
        if now != state or now == self._notified:
            return  # superseded by a later change; that one has its own detection
        was_slow = bool(self._notified and (self._notified[0] or self._notified[1]))
        self._notified = now
        diagnosis = self.diagnosis()
        if diagnosis is not None:
            self.policy.on_diagnosis(diagnosis)
        elif was_slow:
            self.policy.on_relief()

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "slow-start":
            assert isinstance(payload, FailSlow)
            self._active.append(payload)
            self.changed()
        elif kind == "slow-end":
            assert isinstance(payload, FailSlow)
            self._active.remove(payload)
            self.changed()
        elif kind == "detect":
            self._deliver(payload)
        elif kind == "stop":
            assert isinstance(payload, FailStop)
            if payload.host in self.topology.hosts and payload.host not in self.down:
                self.down.add(payload.host)
                self._push(self.t + payload.repair_s, "repair", payload.host)
                self.mark(f"fail-stop {payload.host}")
                self.policy.on_failstop(payload.host)
                self._cached = None
        elif kind == "repair":
            assert isinstance(payload, str)
            self.down.discard(payload)
            if payload in self._replaced:
                self._replaced.discard(payload)
                self.spares += 1
            self.policy.on_repair(payload)
            self._cached = None

    def run(self) -> Trace:
        self.policy.attach(self)
        end = self.scenario.duration_s
        self._record()
        while self.t < end:
            while self._queue and self._queue[0][0] <= self.t:
                _, _, kind, payload = heapq.heappop(self._queue)
                self._handle(kind, payload)
            if self.policy.halted:
                # training cannot run (waiting for a repair): jump to the next event
                if not self._queue:
                    break
                self.t = max(self.t, self._queue[0][0])
                self._record()
                continue
            step = self.step_s()
            self.t += step
            self.steps += 1
            if self.t >= self._next_checkpoint:
                self._checkpoint_steps = self.steps
                self._next_checkpoint += self.costs.checkpoint_interval_s
            self._record()
            self.policy.on_step(step)
        return self.trace

    def _record(self) -> None:
        self.trace.times.append(self.t)
        self.trace.steps.append(self.steps)
