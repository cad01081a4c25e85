"""Prometheus metrics of a job's control plane and of a node (PyPI ``prometheus-client``).

``failslow run --metrics-port PORT`` (config ``observe.metrics_port``; 0 picks a free port,
printed at start) serves ``/metrics`` on 127.0.0.1 unless ``observe.metrics_addr`` says
otherwise. Two sources, one registry per launcher:

- :class:`ControlMetrics`, on the node that hosts the controller: an observer of the control
  plane's events (:mod:`failslow.core.control.journal`), so it costs nothing per training step
  and nothing per rank - job-level series only:
  ``failslow_controller_state``, ``failslow_onsets_total{type}``,
  ``failslow_validation_rounds_total{result}``, ``failslow_validation_pause_seconds``,
  ``failslow_diagnoses_total{kind}``, the last diagnosis's
  ``failslow_diagnosis_rank_slowdown_ratio{rank}`` / ``..._link_slowdown_ratio{a,b}`` (the
  ``top_k`` largest), ``failslow_plans_total{strategy,action,outcome}`` (outcome: committed,
  aborted, then in effect or not in effect once the ranks reported),
  ``failslow_plan_in_effect{strategy}`` (set only from what every rank reported running), the
  plan's estimated vs measured effect
  (``failslow_plan_{estimated,baseline,measured,before}_step_seconds``,
  ``failslow_plan_overhead_seconds``), its outcome a few steps after it took effect
  (``failslow_plan_outcomes_total{strategy,verdict}``,
  ``failslow_plan_outcome_{predicted,measured}_step_seconds``), the strategies that could not
  take effect in this job (``failslow_strategy_unavailable{strategy}``), the job's
  ``failslow_job_step``,
  ``failslow_job_step_seconds`` and ``failslow_job_step_duration_seconds`` (histogram).
- :class:`NodeCollector`, on every node: read at scrape time (no cost between scrapes) from the
  node publisher's per-rank tracker state - ``failslow_rank_iteration_seconds{rank}``,
  ``failslow_rank_iteration_median_seconds{rank}``, ``failslow_rank_iterations_total{rank}``,
  ``failslow_rank_slow{rank}``, ``failslow_rank_transients_total{rank}`` (verified slowdowns
  over before they persisted: not fail-slows, issue 47) - from the snapshot directory's headers -
  ``failslow_snapshot_step{rank,kind}``, ``failslow_snapshot_bytes{rank,kind}``,
  ``failslow_snapshot_age_seconds{rank,kind}`` (kind ``own`` or ``backup``; the age counts from
  when a scrape first saw that step, so it is exact to one scrape interval: a memory-mapped
  slot's mtime does not move with its writes) - and from the launcher's agent:
  ``failslow_hot_updates_total{outcome}``, ``failslow_incidents_total{kind}``.
  Per-rank series are this node's ranks only (at most ``top_k`` of them, the slowest), so no
  endpoint's cardinality grows with the job.

Units are in the names (seconds, bytes, ratio), counters end in ``_total``; see
``examples/grafana-failslow.json`` for a dashboard over them.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from failslow.errors import ConfigError

STATES = ("tracking", "profiling", "validating", "diagnosed")
STRATEGIES = ("S2", "S3", "S4")
STRATEGY_OF = {"MicroBatchPlan": "S2", "TopologyPlan": "S3", "RestartPlan": "S4"}
"""The strategy label of a plan in effect, by its type."""


def _short(strategy: Any) -> str:
    """``"S2"`` for the planner's ``"S2 micro-batches"`` (a bounded label set)."""
    return str(strategy).split(" ", 1)[0]
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
PAUSE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(
            "metrics need the prometheus-client package: pip install 'failslow[observe]'"
        ) from None
    return prometheus_client


class ControlMetrics:
    """The control plane's events as metrics (an observer for ``ControlPlane(observers=)``)."""

    def __init__(self, registry: Any, *, top_k: int = 16) -> None:
        pc = _client()
        self.top_k = top_k
        r = {"registry": registry}
        self.state = pc.Enum(
            "failslow_controller_state", "The controller's state", states=list(STATES), **r
        )
        self.onsets = pc.Counter(
            "failslow_onsets", "Change points the nodes reported", ["type"], **r
        )
        self.rounds = pc.Counter(
            "failslow_validation_rounds",
            "Validation rounds (pause, GEMM and link tests) by result",
            ["result"],
            **r,
        )
        self.pause = pc.Histogram(
            "failslow_validation_pause_seconds",
            "How long the ranks were paused for a validation round",
            buckets=PAUSE_BUCKETS,
            **r,
        )
        self.diagnoses = pc.Counter(
            "failslow_diagnoses", "Diagnoses that named a slow rank or link", ["kind"], **r
        )
        self.rank_slowdown = pc.Gauge(
            "failslow_diagnosis_rank_slowdown_ratio",
            "The last diagnosis: each slow rank's measured slowdown (x its peers)",
            ["rank"],
            **r,
        )
        self.link_slowdown = pc.Gauge(
            "failslow_diagnosis_link_slowdown_ratio",
            "The last diagnosis: each slow link's measured slowdown",
            ["a", "b"],
            **r,
        )
        self.plans = pc.Counter(
            "failslow_plans",
            "Plans dispatched, by strategy, action (apply, revert) and outcome",
            ["strategy", "action", "outcome"],
            **r,
        )
        self.in_effect = pc.Gauge(
            "failslow_plan_in_effect",
            "1 for the strategy whose plan every rank runs now (none: the even split)",
            ["strategy"],
            **r,
        )
        for name in (*STRATEGIES, "none"):
            self.in_effect.labels(name).set(1.0 if name == "none" else 0.0)
        plan_gauges = {
            "estimated": ("step_seconds", "the model's step time with it"),
            "baseline": ("step_seconds", "the model's step time for what it replaced"),
            "overhead": ("seconds", "the model's one-off cost of applying it"),
            "measured": ("step_seconds", "median measured step time since it took effect"),
            "before": ("step_seconds", "median measured step time just before it took effect"),
        }
        for attr, (unit, what) in plan_gauges.items():
            name = f"failslow_plan_{attr}_{unit}"
            setattr(self, attr, pc.Gauge(name, f"The plan in effect: {what}", **r))
        self.outcomes = pc.Counter(
            "failslow_plan_outcomes",
            "Plans measured a few steps after they took effect, by verdict (pays, short: saved "
            "under half the predicted, unknown; stopped paying: paid, then fell short later)",
            ["strategy", "verdict"],
            **r,
        )
        self.outcome_predicted = pc.Gauge(
            "failslow_plan_outcome_predicted_step_seconds",
            "The last measured plan: the step time it predicted (on the observed scale)",
            **r,
        )
        self.outcome_measured = pc.Gauge(
            "failslow_plan_outcome_measured_step_seconds",
            "The last measured plan: the median step time it gave",
            **r,
        )
        self.unavailable = pc.Gauge(
            "failslow_strategy_unavailable",
            "1 for a strategy whose plan could not take effect in this job (never planned again)",
            ["strategy"],
            **r,
        )
        self.step = pc.Gauge("failslow_job_step", "The newest step the job reported", **r)
        self.step_s = pc.Gauge(
            "failslow_job_step_seconds", "The newest step's time (rank 0's)", **r
        )
        self.step_hist = pc.Histogram(
            "failslow_job_step_duration_seconds",
            "The job's step times (rank 0's)",
            buckets=STEP_BUCKETS,
            **r,
        )
        self._steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=400)
        self._applied_at: int | None = None
        self._lock = threading.Lock()

    def __call__(self, ev: dict[str, Any]) -> None:
        kind = ev["kind"]
        with self._lock:
            if kind == "state":
                self._state(ev)
            elif kind == "onset":
                self.onsets.labels(str(ev.get("type", "onset"))).inc()
            elif kind == "diagnosis":
                self._diagnosis(ev["diagnosis"])
            elif kind == "steps":
                for step, seconds in ev["steps"]:
                    self._steps.append((int(step), float(seconds)))
                    self.step_hist.observe(float(seconds))
                if ev["steps"]:
                    step, seconds = ev["steps"][-1]
                    self.step.set(step)
                    self.step_s.set(seconds)
                self._effect()
            elif kind == "plan":
                self._plan(ev)
            elif kind == "effect":
                self.plans.labels(_short(ev.get("strategy")), str(ev.get("action")),
                                  str(ev.get("state"))).inc()  # fmt: skip
                self._in_effect(ev.get("in_effect"), ev.get("apply_step"))
            elif kind == "drift":
                self.outcomes.labels(_short(ev.get("strategy")), str(ev.get("verdict"))).inc()
            elif kind == "outcome":
                self.outcomes.labels(_short(ev.get("strategy")), str(ev.get("verdict"))).inc()
                for gauge, key in (
                    (self.outcome_predicted, "predicted_s"),
                    (self.outcome_measured, "measured_s"),
                ):
                    value = ev.get(key)
                    gauge.set(float(value) if value is not None else float("nan"))
            elif kind == "unavailable":
                self.unavailable.labels(_short(ev.get("strategy"))).set(1.0)

    def _state(self, ev: dict[str, Any]) -> None:
        state = ev["state"]
        if state in STATES:
            self.state.state(state)
        detail = ev.get("detail") or {}
        if state == "diagnosed":
            self.rounds.labels("healthy" if detail.get("healthy") else "diagnosed").inc()
            if detail.get("paused_s") is not None:
                self.pause.observe(float(detail["paused_s"]))
        elif state == "tracking" and "error" in detail:
            self.rounds.labels("abandoned").inc()

    def _diagnosis(self, diagnosis: dict[str, Any]) -> None:
        self.diagnoses.labels(str(diagnosis.get("kind"))).inc()
        self.rank_slowdown.clear()
        self.link_slowdown.clear()
        ranks = sorted(diagnosis.get("slow_ranks", []), key=lambda r: -float(r[1]))
        for rank, slowdown in ranks[: self.top_k]:
            self.rank_slowdown.labels(str(rank)).set(float(slowdown))
        links = sorted(diagnosis.get("slow_links", []), key=lambda x: -float(x[2]))
        for a, b, slowdown in links[: self.top_k]:
            self.link_slowdown.labels(str(a), str(b)).set(float(slowdown))

    def _plan(self, ev: dict[str, Any]) -> None:
        outcome = "committed" if ev.get("committed") else "aborted"
        self.plans.labels(_short(ev.get("strategy")), str(ev.get("action")), outcome).inc()

    def _in_effect(self, current: dict[str, Any] | None, apply_step: Any) -> None:
        """The plan every rank reported running (None: the even split), from ``apply_step``."""
        effective = STRATEGY_OF.get(str((current or {}).get("type")), "none")
        for name in (*STRATEGIES, "none"):
            self.in_effect.labels(name).set(1.0 if name == effective else 0.0)
        plan = current or {}
        for gauge, key in (
            (self.estimated, "step_time_s"),
            (self.baseline, "baseline_step_s"),
            (self.overhead, "overhead_s"),
        ):
            value = plan.get(key)
            gauge.set(float(value) if value is not None else float("nan"))
        self._applied_at = apply_step if current is not None else None
        self.measured.set(float("nan"))
        self.before.set(float("nan"))
        self._effect()

    def _effect(self) -> None:
        """The plan's measured effect: median step time since its apply step vs before it."""
        start = self._applied_at
        if start is None:
            return
        after = [s for step, s in self._steps if step >= start]
        before = [s for step, s in self._steps if start - 20 <= step < start]
        if after:
            self.measured.set(statistics.median(after[-50:]))
        if before:
            self.before.set(statistics.median(before))


class NodeCollector:
    """This node's per-rank tracker state, snapshots and agent, read at scrape time."""

    def __init__(
        self,
        *,
        rank_states: Callable[[], dict[int, dict[str, Any]]] | None = None,
        snapshot_dir: Path | None = None,
        updates: Callable[[], Iterable[str]] | None = None,
        incidents: Callable[[], dict[str, int]] | None = None,
        top_k: int = 64,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rank_states = rank_states
        self.snapshot_dir = snapshot_dir
        self.updates = updates
        self.incidents = incidents
        self.top_k = top_k
        self._clock = clock
        self._first_seen: dict[tuple[int, str, int], float] = {}

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.rank_states is not None:
            states = list(self.rank_states().values())
            states.sort(key=lambda s: -float(s["median_s"]))
            last = GaugeMetricFamily(
                "failslow_rank_iteration_seconds", "The rank's last iteration time", labels=["rank"]
            )
            median = GaugeMetricFamily(
                "failslow_rank_iteration_median_seconds",
                "The median of the rank's recent iteration times",
                labels=["rank"],
            )
            count = CounterMetricFamily(
                "failslow_rank_iterations", "Iterations the node's tracker saw", labels=["rank"]
            )
            slow = GaugeMetricFamily(
                "failslow_rank_slow", "1 after an onset on the rank, until its relief",
                labels=["rank"],
            )  # fmt: skip
            transients = CounterMetricFamily(
                "failslow_rank_transients",
                "Verified slowdowns on the rank that were over before they persisted",
                labels=["rank"],
            )
            for s in states[: self.top_k]:
                rank = [str(s["rank"])]
                last.add_metric(rank, float(s["last_s"]))
                median.add_metric(rank, float(s["median_s"]))
                count.add_metric(rank, float(s["iterations"]))
                slow.add_metric(rank, 1.0 if s["slow"] else 0.0)
                transients.add_metric(rank, float(s.get("transients", 0)))
            yield from (last, median, count, slow, transients)
        if self.snapshot_dir is not None:
            yield from self._snapshots()
        if self.updates is not None:
            by_outcome = collections.Counter(self.updates())
            family = CounterMetricFamily(
                "failslow_hot_updates", "Hot updates in the job's history", labels=["outcome"]
            )
            for outcome, n in sorted(by_outcome.items()):
                family.add_metric([outcome], float(n))
            yield family
        if self.incidents is not None:
            family = CounterMetricFamily(
                "failslow_incidents", "Failures of the training command, by kind", labels=["kind"]
            )
            for kind, n in sorted(self.incidents().items()):
                family.add_metric([kind], float(n))
            yield family

    def _snapshots(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        from failslow.core.checkpoint.restore import inventory

        assert self.snapshot_dir is not None
        labels = ["rank", "kind"]
        step = GaugeMetricFamily(
            "failslow_snapshot_step", "Newest committed in-memory snapshot's step", labels=labels
        )
        size = GaugeMetricFamily(
            "failslow_snapshot_bytes", "Newest committed snapshot's size", labels=labels
        )
        age = GaugeMetricFamily(
            "failslow_snapshot_age_seconds",
            "Time since that snapshot was first seen (exact to one scrape interval)",
            labels=labels,
        )
        now = self._clock()
        records = inventory(self.snapshot_dir) if self.snapshot_dir.is_dir() else []
        seen = {}
        for record in records[: 2 * self.top_k]:
            kind = "backup" if record["backup"] else "own"
            key = (record["rank"], kind, record["step"])
            seen[key] = self._first_seen.get(key, now)
            values = [str(record["rank"]), kind]
            step.add_metric(values, float(record["step"]))
            size.add_metric(values, float(record["bytes"]))
            age.add_metric(values, now - seen[key])
        self._first_seen = seen
        yield from (step, size, age)


class MetricsServer:
    """``/metrics`` of ``registry`` on ``addr:port`` (port 0: a free one, see :attr:`port`),
    served by prometheus-client's own HTTP server on a daemon thread; :meth:`stop` joins it."""

    def __init__(self, registry: Any, *, port: int, addr: str = "127.0.0.1") -> None:
        self.registry = registry
        self.requested = (addr, port)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        pc = _client()
        addr, port = self.requested
        try:
            self._server, self._thread = pc.start_http_server(port, addr, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"metrics endpoint {addr}:{port}: {exc.strerror or exc}") from None
        return self

    @property
    def port(self) -> int:
        return int(self._server.server_port) if self._server is not None else 0

    @property
    def url(self) -> str:
        host = self.requested[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


def new_registry() -> Any:
    return _client().CollectorRegistry(auto_describe=True)
