"""The Prometheus exporter (:mod:`failslow.observe.metrics`) served for real and scraped over HTTP.

The control plane's half is fed the events its controller and mitigator emit (built with the
journal's own ``event``), the node's half reads real snapshot files written by a real
:class:`~failslow.core.checkpoint.snapshot.Snapshotter`. The e2e over a real 4-rank job is
``tests/node/test_run_controller.py::test_metrics_and_top_of_a_four_rank_job_show_the_straggler``.
"""

from __future__ import annotations

import math
import socket
import urllib.request
from pathlib import Path

import pytest

from failslow.core.control.journal import event
from failslow.core.planner.plans import MicroBatchPlan, plan_to_dict
from failslow.errors import ConfigError
from failslow.observe.metrics import (
    ControlMetrics,
    MetricsServer,
    NodeCollector,
    new_registry,
)


def scrape(server: MetricsServer) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def served():
    registry = new_registry()
    server = MetricsServer(registry, port=0).start()
    yield registry, server
    server.stop()


PLAN = MicroBatchPlan(
    counts=(5, 5, 2, 4), weights=(1.25, 1.25, 0.5, 1.0), overhead_s=0.2, step_time_s=0.3,
    baseline_step_s=0.6,
)  # fmt: skip


def test_control_events_become_job_level_series(served) -> None:
    registry, server = served
    metrics = ControlMetrics(registry, top_k=2)
    metrics(event("state", state="profiling", detail={}))
    metrics(event("onset", type="onset", rank=2, iteration=70))
    metrics(event("state", state="diagnosed", detail={"healthy": False, "paused_s": 0.4}))
    metrics(
        event(
            "diagnosis",
            diagnosis={
                "kind": "compute",
                "slow_ranks": [[2, 3.5], [0, 1.2], [3, 1.1]],
                "slow_links": [[0, 1, 4.0]],
                "evidence": {},
            },
        )
    )
    metrics(event("steps", steps=[[s, 1.0] for s in range(80, 100)]))
    metrics(
        event(
            "plan", action="apply", strategy="S2 micro-batches", plan=plan_to_dict(PLAN),
            reason="break-even", apply_step=100, committed=True, detail="", in_effect=None,
        )
    )  # fmt: skip
    committed = scrape(server)  # committed is not in effect: nothing reported running it yet
    assert committed[("failslow_plan_in_effect", (("strategy", "none"),))] == 1
    metrics(
        event(
            "effect", action="apply", strategy="S2 micro-batches", plan=plan_to_dict(PLAN),
            apply_step=100, state="in effect", detail="", in_effect=plan_to_dict(PLAN),
        )
    )  # fmt: skip
    metrics(event("steps", steps=[[100, 0.5], [101, 0.4], [102, 0.45]]))
    metrics(
        event(
            "outcome", action="apply", strategy="S2 micro-batches", plan=plan_to_dict(PLAN),
            apply_step=100, before_s=1.0, predicted_s=0.5, measured_s=0.45, verdict="pays",
            reason="r",
        )
    )  # fmt: skip
    metrics(
        event(
            "drift", action="apply", strategy="S2 micro-batches", plan=plan_to_dict(PLAN),
            apply_step=100, before_s=1.0, predicted_s=0.5, measured_s=0.9,
            verdict="stopped paying", reason="r", then="revert", then_reason="did not pay",
        )
    )  # fmt: skip
    metrics(event("unavailable", strategy="S3 topology", reason="no model factory"))
    metrics(event("state", state="tracking", detail={}))
    got = scrape(server)
    assert got[("failslow_controller_state", (("failslow_controller_state", "tracking"),))] == 1
    assert got[("failslow_controller_state", (("failslow_controller_state", "profiling"),))] == 0
    assert got[("failslow_onsets_total", (("type", "onset"),))] == 1
    assert got[("failslow_validation_rounds_total", (("result", "diagnosed"),))] == 1
    assert got[("failslow_validation_pause_seconds_sum", ())] == pytest.approx(0.4)
    assert got[("failslow_diagnoses_total", (("kind", "compute"),))] == 1
    # the two largest slowdowns only (top_k=2): rank 3's 1.1 is left out
    ranks = {k[1]: v for k, v in got.items() if k[0] == "failslow_diagnosis_rank_slowdown_ratio"}
    assert ranks == {(("rank", "2"),): 3.5, (("rank", "0"),): 1.2}
    link = (("a", "0"), ("b", "1"))
    assert got[("failslow_diagnosis_link_slowdown_ratio", link)] == 4.0
    key = (("action", "apply"), ("outcome", "committed"), ("strategy", "S2"))
    assert got[("failslow_plans_total", key)] == 1
    key = (("action", "apply"), ("outcome", "in effect"), ("strategy", "S2"))
    assert got[("failslow_plans_total", key)] == 1
    assert got[("failslow_plan_in_effect", (("strategy", "S2"),))] == 1
    assert got[("failslow_plan_in_effect", (("strategy", "none"),))] == 0
    # estimated vs measured effect of the plan in effect
    assert got[("failslow_plan_estimated_step_seconds", ())] == 0.3
    assert got[("failslow_plan_baseline_step_seconds", ())] == 0.6
    assert got[("failslow_plan_overhead_seconds", ())] == 0.2
    assert got[("failslow_plan_measured_step_seconds", ())] == 0.45
    assert got[("failslow_plan_before_step_seconds", ())] == 1.0
    assert got[("failslow_job_step", ())] == 102
    assert got[("failslow_job_step_seconds", ())] == 0.45
    assert got[("failslow_job_step_duration_seconds_count", ())] == 23
    # the outcome against the prediction, and a strategy that cannot take effect here
    assert got[("failslow_plan_outcomes_total", (("strategy", "S2"), ("verdict", "pays")))] == 1
    stopped = (("strategy", "S2"), ("verdict", "stopped paying"))
    assert got[("failslow_plan_outcomes_total", stopped)] == 1  # later, watched on
    assert got[("failslow_plan_outcome_predicted_step_seconds", ())] == 0.5
    assert got[("failslow_plan_outcome_measured_step_seconds", ())] == 0.45
    assert got[("failslow_strategy_unavailable", (("strategy", "S3"),))] == 1


def test_a_revert_returns_to_the_even_split_and_an_abort_changes_nothing(served) -> None:
    registry, server = served
    metrics = ControlMetrics(registry)
    base = dict(strategy="S2", plan=plan_to_dict(PLAN), detail="")
    metrics(event("plan", action="apply", apply_step=10, committed=True, reason="r",
                  in_effect=None, **base))  # fmt: skip
    metrics(event("effect", action="apply", apply_step=10, state="in effect",
                  in_effect=plan_to_dict(PLAN), **base))  # fmt: skip
    metrics(event("plan", action="revert", apply_step=None, committed=False, reason="r",
                  in_effect=plan_to_dict(PLAN), **base))  # fmt: skip
    got = scrape(server)
    assert got[("failslow_plan_in_effect", (("strategy", "S2"),))] == 1
    aborted = (("action", "revert"), ("outcome", "aborted"), ("strategy", "S2"))
    assert got[("failslow_plans_total", aborted)] == 1
    metrics(event("plan", action="revert", apply_step=30, committed=True, reason="r",
                  in_effect=plan_to_dict(PLAN), **base))  # fmt: skip
    assert scrape(server)[("failslow_plan_in_effect", (("strategy", "S2"),))] == 1
    metrics(event("effect", action="revert", apply_step=30, state="in effect", in_effect=None,
                  **base))  # fmt: skip
    got = scrape(server)
    assert got[("failslow_plan_in_effect", (("strategy", "S2"),))] == 0
    assert got[("failslow_plan_in_effect", (("strategy", "none"),))] == 1
    assert math.isnan(got[("failslow_plan_estimated_step_seconds", ())])


def test_node_series_come_from_the_publisher_snapshots_and_agent(served, tmp_path: Path) -> None:
    import torch

    from failslow.core.checkpoint.snapshot import Snapshotter

    registry, server = served
    states = {
        r: {"rank": r, "iterations": 50 + r, "last_s": 0.1 * (r + 1), "median_s": 0.1 * (r + 1),
            "slow": r == 2, "transients": 3 * r, "wall": 0.0}
        for r in range(3)
    }  # fmt: skip
    clock = [1000.0]
    with Snapshotter(tmp_path, rank=1) as snap:
        snap.start({"w": torch.arange(1000, dtype=torch.float32)}, 7)
        assert snap.wait_sealed(10.0) == 7
        registry.register(
            NodeCollector(
                rank_states=lambda: states,
                snapshot_dir=tmp_path,
                updates=lambda: ["applied", "applied", "rolled back"],
                incidents=lambda: {"failed": 1},
                top_k=2,
                clock=lambda: clock[0],
            )
        )
        first = scrape(server)
        clock[0] += 30.0
        later = scrape(server)
    # the two slowest local ranks only (top_k=2), slowest first
    name = "failslow_rank_iteration_median_seconds"
    medians = {k[1]: v for k, v in first.items() if k[0] == name}
    assert medians == {(("rank", "2"),): pytest.approx(0.3), (("rank", "1"),): pytest.approx(0.2)}
    assert first[("failslow_rank_slow", (("rank", "2"),))] == 1
    assert first[("failslow_rank_iterations_total", (("rank", "1"),))] == 51
    assert first[("failslow_rank_transients_total", (("rank", "2"),))] == 6
    own = (("kind", "own"), ("rank", "1"))
    assert first[("failslow_snapshot_step", own)] == 7
    assert first[("failslow_snapshot_bytes", own)] >= 4000
    assert first[("failslow_snapshot_age_seconds", own)] == 0
    assert later[("failslow_snapshot_age_seconds", own)] == 30.0
    assert first[("failslow_hot_updates_total", (("outcome", "applied"),))] == 2
    assert first[("failslow_incidents_total", (("kind", "failed"),))] == 1


def test_a_taken_port_is_one_line_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ConfigError, match=f"metrics endpoint 127.0.0.1:{port}: ") as info:
            MetricsServer(new_registry(), port=port).start()
    assert "\n" not in str(info.value)
