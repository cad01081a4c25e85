"""The mitigation loop on a real TCPStore: diagnosis -> ski-rental -> S2 plan on every rank.

Ranks are threads with the real plan receiver (see test_plan_channel.py); the job record and the
step times are written as rank 0's session writes them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_plan_channel import CONNECT_S, Rank, _ranks, _stop

from failslow.config import load_config
from failslow.core.control import keys
from failslow.core.control.mitigator import Mitigator
from failslow.core.control.store import Store, open_store
from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner.plans import MicroBatchPlan
from failslow.core.topology import Topology

pytestmark = pytest.mark.timeout(60)

TOPOLOGY = Topology.megatron(tp=1, dp=4, pp=1, gpus_per_host=1, micro_batches=16)
SUPPORTED = {"microbatch_plans": "", "topology_plans": "no", "snapshots": "no", "hot_update": "no"}


@pytest.fixture
def url() -> Iterator[str]:
    master = open_store("tcp://127.0.0.1:0?master=1")
    try:
        yield master.url
    finally:
        master.close()


def _job(store: Store, capabilities: dict[str, str]) -> None:
    store.set_json(keys.JOB, {"topology": TOPOLOGY.to_dict(), "capabilities": capabilities})
    healthy = [[s, 0.1] for s in range(20)]
    store.set_json(keys.STEPS, {"steps": healthy})


def _diagnosis() -> Diagnosis:
    onset = {"type": "onset", "wall": time.time() + 1e-3, "before_s": 0.1}
    return Diagnosis(Kind.COMPUTE, slow_ranks=(SlowRank(2, 3.0),), evidence={"onsets": [onset]})


def _s4_only() -> tuple[Any, dict[str, str]]:
    """Settings and adapter capabilities of a job that restarts (S4, Algorithm 1's break-even,
    0.5 s per restart) and has no other plan."""
    config = load_config(
        {"planner": {"strategies": ["S4"], "rule": "break-even", "restart_s": 0.5}}, environ={}
    )
    return config, {**SUPPORTED, "microbatch_plans": "no", "snapshots": ""}


def _wait_applied(ranks: list[Rank], n: int) -> None:
    deadline = time.monotonic() + 20
    while any(len(r.applied) < n for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.02)


def _diagnosed_after_slow_steps(store: Store, config: Any, ranks: list[Rank]) -> Mitigator:
    """Healthy steps, a compute fail-slow on rank 2 with ten slow steps since its onset, its
    diagnosis; returns once every rank applied the plan the mitigator bought."""
    mitigator = Mitigator(store, config.planner, world_size=4)
    mitigator.tick()  # the healthy steps are seen before the onset
    diagnosis = _diagnosis()
    time.sleep(0.01)
    # slow steps since the onset: their excess pays for the plan (ski-rental, Alg. 1)
    store.set_json(keys.STEPS, {"steps": [[s, 0.3] for s in range(20, 30)]})
    mitigator.tick()
    mitigator.on_diagnosis(diagnosis)
    mitigator.tick()
    _wait_applied(ranks, 1)
    return mitigator


def test_diagnosis_buys_s2_and_relief_reverts_to_the_even_split(url: str) -> None:
    config = load_config({"planner": {"microbatch_apply_s": 0.0}}, environ={})
    ranks = _ranks(url, 4)
    with open_store(url, timeout_s=CONNECT_S) as store:
        _job(store, SUPPORTED)
        mitigator = _diagnosed_after_slow_steps(store, config, ranks)
        assert mitigator.active
        (action,) = mitigator.actions
        plan = action.plan
        assert isinstance(plan, MicroBatchPlan) and action.strategy == "S2 micro-batches"
        assert sum(plan.counts) == 16 and plan.counts[2] == min(plan.counts) < 4
        assert action.outcome is not None and action.outcome.committed
        assert mitigator.healthy_step_s(_diagnosis()) == pytest.approx(0.1)
        # the same fail-slow seen again by a re-validation: nothing new
        mitigator.on_diagnosis(_diagnosis())
        mitigator.tick()
        assert len(mitigator.actions) == 1
        mitigator.on_healthy()
        mitigator.tick()
        _wait_applied(ranks, 2)
    _stop(ranks)
    assert not mitigator.active
    assert mitigator.actions[-1].action == "revert"
    assert mitigator.actions[-1].plan.counts == (4, 4, 4, 4)  # type: ignore[attr-defined]
    for r in ranks:
        assert [p for _, p in r.applied] == [plan, mitigator.actions[-1].plan]
        assert r.applied[0][0] == action.outcome.apply_step


def test_a_link_only_rediagnosis_after_the_gpu_recovered_reverts_s2(url: str) -> None:
    """Seen in the DeepSpeed demo: after the slowed rank recovered, a re-validation on the
    loaded machine named one link at 2.3x and nothing else; the S2 split for the recovered
    rank must not stay in effect."""
    config = load_config({"planner": {"microbatch_apply_s": 0.0}}, environ={})
    ranks = _ranks(url, 4)
    with open_store(url, timeout_s=CONNECT_S) as store:
        _job(store, SUPPORTED)
        mitigator = _diagnosed_after_slow_steps(store, config, ranks)
        link_only = Diagnosis(Kind.COMMUNICATION, slow_links=(SlowLink(2, 0, 2.3),))
        mitigator.on_diagnosis(link_only)
        mitigator.tick()
        _wait_applied(ranks, 2)
    _stop(ranks)
    assert [a.action for a in mitigator.actions] == ["apply", "revert"]
    assert mitigator.actions[-1].plan.counts == (4, 4, 4, 4)  # type: ignore[attr-defined]
    assert mitigator.in_effect is None
    for r in ranks:
        assert [p for _, p in r.applied][-1] == mitigator.actions[-1].plan


def test_nothing_is_planned_that_the_adapter_cannot_apply(url: str) -> None:
    config = load_config({}, environ={})
    with open_store(url, timeout_s=CONNECT_S) as store:
        _job(store, {**SUPPORTED, "microbatch_plans": "ZeRO-3 reduces every micro-step"})
        mitigator = Mitigator(store, config.planner, world_size=4)
        mitigator.tick()
        mitigator.on_diagnosis(_diagnosis())
        store.set_json(keys.STEPS, {"steps": [[s, 0.3] for s in range(20, 30)]})
        mitigator.tick()
    assert mitigator.actions == []
    assert mitigator.planner is not None and mitigator.planner.ski.candidates() == ()


def test_no_job_record_means_no_plan(url: str) -> None:
    with open_store(url, timeout_s=CONNECT_S) as store:
        mitigator = Mitigator(store, load_config({}, environ={}).planner, world_size=4)
        store.set_json(keys.STEPS, {"steps": [[0, 0.1], [1, 0.1], [2, 0.1]]})
        mitigator.tick()
        mitigator.on_diagnosis(_diagnosis())
        mitigator.tick()
    assert mitigator.planner is None and mitigator.actions == []


def test_after_a_topology_swap_the_controller_plans_from_the_new_placement(url: str) -> None:
    """A congested DP link (greyhound Fig. 11) buys S3; once every rank committed to it, the
    mitigator's topology is the swapped one: the same processes, other roles."""
    from failslow.core.diagnosis.record import SlowLink
    from failslow.core.planner.plans import TopologyPlan

    topology = Topology.megatron(tp=1, dp=2, pp=2, gpus_per_host=1, micro_batches=8)
    config = load_config({"planner": {"strategies": ["S3"], "pause_s": 0.01}}, environ={})
    ranks = _ranks(url, 4)
    with open_store(url, timeout_s=CONNECT_S) as store:
        capabilities = {**SUPPORTED, "microbatch_plans": "no", "topology_plans": ""}
        store.set_json(keys.JOB, {"topology": topology.to_dict(), "capabilities": capabilities})
        store.set_json(keys.STEPS, {"steps": [[s, 0.1] for s in range(20)]})
        mitigator = Mitigator(store, config.planner, world_size=4)
        mitigator.tick()
        onset = {"type": "onset", "wall": time.time() + 1e-3, "before_s": 0.1}
        link = Diagnosis(
            Kind.COMMUNICATION, slow_links=(SlowLink(0, 1, 5.0),), evidence={"onsets": [onset]}
        )  # ranks 0 and 1: stage 0 of replicas 0 and 1, a DP link
        time.sleep(0.01)
        store.set_json(keys.STEPS, {"steps": [[s, 0.5] for s in range(20, 60)]})
        mitigator.tick()
        mitigator.on_diagnosis(link)
        mitigator.tick()
        _wait_applied(ranks, 1)
    _stop(ranks)
    (action,) = mitigator.actions
    plan = action.plan
    assert isinstance(plan, TopologyPlan) and action.outcome is not None
    assert action.outcome.committed
    moved = mitigator.topology
    assert moved is not None and moved.hosts == topology.hosts
    assert sorted(moved.coords) == sorted(topology.coords) and moved.coords != topology.coords
    # the congested link no longer carries DP traffic (processes 0 and 1 now hold roles of
    # different stages: here of different replicas too, so no traffic at all)
    (_, _, p0), (_, _, p1) = moved.coords[0], moved.coords[1]
    assert p0 != p1, (plan.hosts, moved.coords)
    assert mitigator.planner is not None and mitigator.planner.topology == moved
    for r in ranks:
        assert [p for _, p in r.applied] == [plan]


def test_s2_step_time_comes_from_the_ranks_step_profiles(url: str) -> None:
    """With step profiles in the diagnosed rank's and a healthy replica's progress records,
    the S2 plan carries their model's step time (measured_step), not the GEMM-sized one."""
    from failslow.core.planner.measured_step import MeasuredSteps

    config = load_config({"planner": {"microbatch_apply_s": 0.0}}, environ={})
    ranks = _ranks(url, 4)
    records = {
        2: {"step": 25, "profile": {"calls": 4, "spacing": 0.06, "rest": 0.06, "rest_low": 0.05}},
        0: {"step": 25, "profile": {"calls": 4, "spacing": 0.02, "rest": 0.22, "rest_low": 0.02}},
    }
    with open_store(url, timeout_s=CONNECT_S) as store:
        _job(store, SUPPORTED)
        for rank, record in records.items():
            store.set_json(f"{keys.VALIDATE}/progress/{rank}", record)
        mitigator = _diagnosed_after_slow_steps(store, config, ranks)
    _stop(ranks)
    (action,) = mitigator.actions
    plan = action.plan
    assert isinstance(plan, MicroBatchPlan) and plan.baseline_step_s is None
    model = MeasuredSteps.from_records(TOPOLOGY, (4, 4, 4, 4), records, [2])
    assert model is not None and plan.step_time_s == pytest.approx(model.step_s(plan.counts))
    assert plan.step_time_s == pytest.approx(
        max(0.02 + max(plan.counts) * 0.02, 0.06 + plan.counts[2] * 0.06)
    )


def test_s4_evicts_what_the_standbys_replace_and_the_next_plan_uses_the_new_hosts(
    url: str,
) -> None:
    """Issue 16, seen in the S4 demo on a loaded machine: a diagnosis of rank 2 (4x) with a
    noisy link beside it, one free standby. The restart evicts rank 2's host alone; after it the
    job registers from its new hosts, the impact counts anew (a noisy re-validation right after
    the restart buys nothing), the next restart, paid for by its own slow steps, evicts
    rank 2's new host, and with no standby free none is planned at all."""
    from failslow.core.planner.plans import RestartPlan

    config, capabilities = _s4_only()
    ranks = _ranks(url, 4)

    def diagnosed(diagnosis: Diagnosis, steps: range) -> None:
        """``diagnosis`` after ``steps`` slow steps (0.2 s of impact each) since its onset."""
        time.sleep(0.01)
        store.set_json(keys.STEPS, {"steps": [[s, 0.3] for s in steps]})
        mitigator.tick()
        mitigator.on_diagnosis(diagnosis)
        mitigator.tick()

    def onset() -> dict[str, Any]:
        return {"type": "onset", "wall": time.time() + 1e-3, "before_s": 0.1}

    with open_store(url, timeout_s=CONNECT_S) as store:
        _job(store, capabilities)
        store.set_json(f"{keys.STANDBYS}/node", {"free": 1})
        mitigator = Mitigator(store, config.planner, world_size=4)
        mitigator.tick()
        noisy = (SlowLink(3, 0, 5.0),)
        diagnosed(
            Diagnosis(Kind.BOTH, (SlowRank(2, 4.0),), noisy, evidence={"onsets": [onset()]}),
            range(20, 23),  # 0.6 s >= 0.5 s at the third
        )
        _wait_applied(ranks, 1)
        (first,) = mitigator.actions
        assert isinstance(first.plan, RestartPlan) and first.outcome and first.outcome.committed
        assert first.plan.evict == (TOPOLOGY.hosts[2],)
        # the job restarted (its steps numbered past the restart's): rank 2 on the standby's
        # host, and another standby is free
        hosts = list(TOPOLOGY.hosts)
        hosts[2] = "standby0"
        store.set_json(
            keys.JOB,
            {"topology": TOPOLOGY.with_hosts(hosts).to_dict(), "capabilities": capabilities},
        )
        link = Diagnosis(Kind.COMMUNICATION, slow_links=(SlowLink(1, 2, 2.0),),
                         evidence={"onsets": [onset()]})  # fmt: skip
        diagnosed(link, range(10_000, 10_002))
        assert len(mitigator.actions) == 1  # 0.4 s of its own: the first restart's was paid
        assert mitigator.planner is not None and mitigator.planner.topology.hosts[2] == "standby0"
        # its next slow step pays for the next restart, planned on the new hosts
        store.set_json(keys.STEPS, {"steps": [[10_002, 0.3]]})
        mitigator.tick()
        _wait_applied(ranks, 2)
        assert len(mitigator.actions) == 2
        # no standby left when rank 2 is diagnosed slow again: however long it lasts, a restart
        # would put it back on its own host
        store.set_json(f"{keys.STANDBYS}/node", {"free": 0})
        slow2 = Diagnosis(Kind.COMPUTE, (SlowRank(2, 4.0),), evidence={"onsets": [onset()]})
        diagnosed(slow2, range(20_000, 20_020))
    _stop(ranks)
    assert len(mitigator.actions) == 2
    second = mitigator.actions[-1]
    assert isinstance(second.plan, RestartPlan) and second.plan.evict == ("standby0",)


def test_a_slow_gpu_diagnosed_on_top_of_a_slow_link_is_what_the_restart_evicts(url: str) -> None:
    """Seen in the S4 demo on a loaded machine: a load change was diagnosed as a slow link
    (3, 0), and the injected slow GPU (rank 2) came before that restart was paid for. The
    controller localizes the step up at once (a compound onset); its diagnosis replaces the
    first one's candidates, the impact so far still counts, and the restart evicts rank 2's
    host, not the link's."""
    from failslow.core.planner.plans import RestartPlan

    config, capabilities = _s4_only()
    ranks = _ranks(url, 4)
    with open_store(url, timeout_s=CONNECT_S) as store:
        _job(store, capabilities)
        store.set_json(f"{keys.STANDBYS}/node", {"free": 1})
        mitigator = Mitigator(store, config.planner, world_size=4)
        mitigator.tick()
        onset = {"type": "onset", "wall": time.time() + 1e-3, "before_s": 0.1}
        time.sleep(0.01)
        store.set_json(keys.STEPS, {"steps": [[20, 0.3]]})  # 0.2 s of impact: not yet paid
        mitigator.tick()
        link = Diagnosis(Kind.COMMUNICATION, slow_links=(SlowLink(3, 0, 2.0),),
                         evidence={"onsets": [onset]})  # fmt: skip
        mitigator.on_diagnosis(link)
        mitigator.tick()
        assert mitigator.active and not mitigator.actions
        step_up = {"type": "onset", "wall": time.time(), "before_s": 0.3}
        gpu = Diagnosis(Kind.BOTH, (SlowRank(2, 4.0),), (SlowLink(0, 1, 2.6),),
                        evidence={"onsets": [step_up]})  # fmt: skip
        mitigator.on_diagnosis(gpu)
        mitigator.tick()
        assert not mitigator.actions  # 0.2 s so far
        store.set_json(keys.STEPS, {"steps": [[21, 0.3], [22, 0.3]]})  # 0.6 s >= 0.5 s
        mitigator.tick()
        _wait_applied(ranks, 1)
    _stop(ranks)
    (restart,) = mitigator.actions
    assert isinstance(restart.plan, RestartPlan) and restart.plan.evict == (TOPOLOGY.hosts[2],)


def test_a_job_that_went_on_with_fewer_ranks_is_planned_for_the_ranks_it_has(url: str) -> None:
    """odyssey after a fail-stop with no standby (``failslow run --min-ranks``): the controller
    was started for 4 ranks, the job record of the relaunch says 3 replicas keep the old global
    batch of 16 micro-batches. A plan goes to the 3 ranks there are and commits (it would wait
    for a fourth ack until the timeout), and its relief is the smaller world's even split
    (6, 5, 5), not 5 x 3."""
    config = load_config(
        {"planner": {"microbatch_apply_s": 0.0, "plan_timeout_s": 5.0}}, environ={}
    )
    topology = Topology.megatron(tp=1, dp=3, pp=1, gpus_per_host=1, micro_batches=16)
    ranks = _ranks(url, 3)
    with open_store(url, timeout_s=CONNECT_S) as store:
        store.set_json(
            keys.JOB,
            {"topology": topology.to_dict(), "capabilities": SUPPORTED, "world_size": 3},
        )
        store.set_json(keys.STEPS, {"steps": [[s, 0.1] for s in range(20)]})
        mitigator = _diagnosed_after_slow_steps(store, config, ranks)
        (action,) = mitigator.actions
        assert action.outcome is not None and action.outcome.committed, action.outcome
        assert isinstance(action.plan, MicroBatchPlan) and sum(action.plan.counts) == 16
        mitigator.on_healthy()
        mitigator.tick()
        _wait_applied(ranks, 2)
    _stop(ranks)
    relief = [p for _, p in ranks[0].applied][-1]
    assert isinstance(relief, MicroBatchPlan) and relief.counts == (6, 5, 5)
