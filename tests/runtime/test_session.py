"""The rank-side session in one process: scheduling, capability checks, roll back on failure.

The adapter here is a plain plugin object recording what it is asked to do - this tests the
session's own contract; the real adapters run the conformance suite in spawned worlds.
"""

from __future__ import annotations

import pytest

import failslow
from failslow.capabilities import Capabilities, Unsupported
from failslow.core.planner.plans import MicroBatchPlan, TopologyPlan
from failslow.core.topology import Topology
from failslow.runtime.session import Session

TOPOLOGY = Topology.megatron(tp=1, dp=2, pp=1, gpus_per_host=1, micro_batches=8)
UNEVEN = MicroBatchPlan(counts=(3, 5), weights=(0.75, 1.25))


class Recording:
    def __init__(self, *, fail_apply: bool = False, refuse: str = "") -> None:
        self.counts = (4, 4)
        self.applied: list[tuple[int, tuple[int, ...]]] = []
        self.fail_apply, self.refuse = fail_apply, refuse
        self.results: list[str] = []

    @failslow.hookimpl
    def failslow_report_topology(self) -> Topology:
        return TOPOLOGY

    @failslow.hookimpl
    def failslow_capabilities(self) -> Capabilities:
        return Capabilities(
            microbatch_plans="", topology_plans="cannot regroup", snapshots="x", hot_update="x"
        )

    @failslow.hookimpl
    def failslow_prepare_microbatch_plan(self, plan: MicroBatchPlan, rank: int) -> bool:
        if self.refuse:
            raise ValueError(self.refuse)
        return True

    @failslow.hookimpl
    def failslow_apply_microbatch_plan(self, plan: MicroBatchPlan, step: int) -> bool:
        if self.fail_apply and plan is UNEVEN:
            self.counts = (99, 99)  # a half-done switch
            raise RuntimeError("engine refused")
        self.counts = plan.counts
        self.applied.append((step, plan.counts))
        return True

    @failslow.hookimpl
    def failslow_on_plan_result(self, plan: object, step: int, outcome: str, detail: str) -> None:
        self.results.append(f"{outcome} {step} {detail}")


class Checking(Recording):
    """Also checks what its loop ran (rank 0 is replica 0), as the adapters' kit does."""

    @failslow.hookimpl
    def failslow_verify_microbatch_plan(
        self, plan: MicroBatchPlan, step: int, forwards: int
    ) -> str:
        return "" if forwards == plan.counts[0] else f"ran {forwards} micro-batches"


def _steps(session: Session, steps: range, micro_batches: object) -> None:
    """Step boundaries, each step running ``micro_batches()`` training micro-batches."""
    for step in steps:
        session.step_boundary(step)
        for _ in range(micro_batches()):  # type: ignore[operator]
            session.micro_batch()


def _session(adapter: Recording) -> Session:
    session = Session({"capture": False}, source="test")
    session.register(adapter)
    return session.start()


def test_a_scheduled_plan_applies_at_its_step_boundary() -> None:
    adapter = Checking()
    session = _session(adapter)
    session.schedule(UNEVEN, 3)
    for step in range(5):
        _steps(session, range(step, step + 1), lambda: adapter.counts[0])
        assert adapter.counts == ((3, 5) if step >= 3 else (4, 4))
    assert adapter.applied == [(3, (3, 5))]
    assert session.current == UNEVEN
    assert [s for s, _ in session.step_times] == [0, 1, 2, 3]
    # checked at the next boundary against what the step ran
    assert adapter.results == ["applied 3 ", "in effect 3 "]
    with pytest.raises(ValueError, match="step 2 already passed"):
        session.schedule(UNEVEN, 2)
    session.close()


def test_a_plan_the_loop_does_not_run_is_not_in_effect() -> None:
    """A loop that runs its own 4 micro-batches whatever the plan says (the Trainer feeding
    DeepSpeed): applied, then reported not in effect with what ran."""
    adapter = Checking()
    session = _session(adapter)
    session.schedule(UNEVEN, 2)
    _steps(session, range(4), lambda: 4)
    assert adapter.results == ["applied 2 ", "not in effect 2 ran 4 micro-batches"]
    session.close()


def test_a_plan_no_plugin_can_check_is_not_in_effect() -> None:
    adapter = Recording()
    session = _session(adapter)
    session.schedule(UNEVEN, 1)
    _steps(session, range(3), lambda: adapter.counts[0])
    assert adapter.results[1] == (
        "not in effect 1 no plugin reports what the rank ran (failslow_verify_microbatch_plan)"
    )
    session.close()


def test_unsupported_and_refused_plans_fail_loudly_and_change_nothing() -> None:
    adapter = Recording(refuse="counts must be multiples of 2")
    session = _session(adapter)
    with pytest.raises(Unsupported, match="topology_plans is not supported here: cannot regroup"):
        session.schedule(TopologyPlan(hosts=("a", "b")), 1)
    with pytest.raises(ValueError, match="multiples of 2"):
        session.schedule(UNEVEN, 1)
    session.step_boundary(1)
    assert adapter.applied == [] and adapter.counts == (4, 4)


def test_a_failed_apply_rolls_back_to_the_plan_in_effect() -> None:
    adapter = Recording(fail_apply=True)
    session = _session(adapter)
    session.schedule(UNEVEN, 1)
    session.step_boundary(0)
    session.step_boundary(1)  # no exception: training goes on with the even split
    assert adapter.counts == (4, 4)
    assert session.current is None
    assert adapter.results == ["rolled back 1 rank 0: RuntimeError: engine refused"]


def test_without_an_adapter_nothing_is_supported() -> None:
    session = Session({"capture": False}).start()
    with pytest.raises(Unsupported, match="no adapter registered"):
        session.schedule(UNEVEN, 1)
    with pytest.raises(RuntimeError, match="no plugin reports the topology"):
        session.topology  # noqa: B018
