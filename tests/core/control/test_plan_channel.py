"""The two-phase plan channel on real stores (TCPStore and Redis), ranks as threads.

Each "rank" is a thread that runs steps of a few milliseconds and asks its receiver at every step
boundary for a plan due there; the controller side dispatches from the test thread. What must
hold: every rank switches at the same step, or none does - also when a rank refuses, dies before
accepting, or the controller disappears after the ranks accepted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from failslow.core.control.plan_channel import PlanReceiver, dispatch, horizon_steps, raise_max
from failslow.core.control.store import Store, open_store
from failslow.core.planner.plans import MicroBatchPlan

pytestmark = pytest.mark.timeout(60)

PLAN = MicroBatchPlan(counts=(1, 3, 2, 2), weights=(0.5, 1.5, 1.0, 1.0))
CONNECT_S = 12.0  # TCPStore connects here sometimes stall ~5 s on a DNS lookup


@pytest.fixture(params=["tcp", "redis"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "redis":
        yield request.getfixturevalue("redis_server").url
        return
    master = open_store("tcp://127.0.0.1:0?master=1")
    try:
        yield master.url
    finally:
        master.close()


class Rank(threading.Thread):
    """Steps of ``step_s``; records the step at which each plan arrived, and at the next step
    reports what it ran as a session does: ``ran(plan)`` is "" (it ran the plan) or what it
    ran instead; ``ran=None`` never reports (a rank whose adapter cannot tell)."""

    def __init__(
        self,
        url: str,
        rank: int,
        *,
        refuse: str = "",
        step_s: float = 0.005,
        token: str | None = None,
        ran: Callable[[object], str] | None = lambda plan: "",
        first_step: int = 0,
    ) -> None:
        super().__init__(daemon=True)
        self.store = open_store(url, timeout_s=CONNECT_S)
        self.applied: list[tuple[int, MicroBatchPlan]] = []
        self.step = first_step
        self.stop = threading.Event()
        self.step_s = step_s
        self.ran = ran
        self._unchecked: tuple[int, int, object] | None = None

        def prepare(plan: object) -> None:
            if refuse:
                raise ValueError(refuse)

        self.receiver = PlanReceiver(
            self.store,
            rank=rank,
            prepare=prepare,
            step=lambda: self.step,
            poll_s=0.02,
            decision_timeout_s=2.0,
            token=token,
        )

    def start(self) -> None:
        STARTED.append(self)
        super().start()

    def run(self) -> None:
        self.receiver.start()
        while not self.stop.is_set():
            self.step += 1
            if self._unchecked is not None and self.ran is not None:
                _, epoch, applied = self._unchecked
                self.receiver.report_effect(epoch, self.ran(applied))
            self._unchecked = None
            plan = self.receiver.due(self.step)
            if plan is not None:
                self.applied.append((self.step, plan))
                assert self.receiver.due_epoch is not None
                self._unchecked = (self.step, self.receiver.due_epoch, plan)
            time.sleep(self.step_s)
        self.receiver.stop()


STARTED: list[Rank] = []
"""Every rank thread a test started: stopped at its teardown if the test did not get there (a
failed assertion left them polling a closed store for the rest of the run)."""


def _ranks(url: str, n: int, **kw: object) -> list[Rank]:
    ranks = [Rank(url, r, **kw) for r in range(n)]  # type: ignore[arg-type]
    for r in ranks:
        r.start()
    return ranks


@pytest.fixture(autouse=True)
def _no_rank_outlives_its_test() -> Iterator[None]:
    yield
    left = [r for r in STARTED if r.is_alive()]
    STARTED.clear()
    _stop(left)


def _stop(ranks: list[Rank]) -> None:
    for r in ranks:
        r.stop.set()
    for r in ranks:
        r.join(timeout=10)
        r.store.close()


def test_every_rank_switches_at_the_same_step(url: str) -> None:
    ranks = _ranks(url, 4)
    with open_store(url, timeout_s=CONNECT_S) as store:
        outcome = dispatch(store, PLAN, world_size=4, horizon_steps=5, timeout_s=20)
        assert outcome.committed, outcome.reason
        deadline = time.monotonic() + 20
        while any(not r.applied for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.02)
        _stop(ranks)
    steps = {r.applied[0][0] for r in ranks}
    assert steps == {outcome.apply_step}
    assert all(r.applied == [(outcome.apply_step, PLAN)] for r in ranks)


def test_a_refusal_aborts_everywhere(url: str) -> None:
    ranks = _ranks(url, 3) + _ranks(url, 1, refuse="counts do not fit this layout")
    with open_store(url, timeout_s=CONNECT_S) as store:
        outcome = dispatch(store, PLAN, world_size=4, horizon_steps=3, timeout_s=20)
        time.sleep(0.5)  # the accepted ranks pass their horizon and read the abort
        _stop(ranks)
    assert not outcome.committed
    assert "rank 0: ValueError: counts do not fit this layout" in outcome.reason
    assert all(not r.applied for r in ranks)
    decided = [r.receiver.outcomes for r in ranks[:3]]
    assert all(o and o[-1][2] is None and "counts do not fit" in o[-1][3] for o in decided)


def test_a_rank_that_never_answers_aborts_by_timeout(url: str) -> None:
    ranks = _ranks(url, 3)  # the fourth rank died before the plan
    with open_store(url, timeout_s=CONNECT_S) as store:
        outcome = dispatch(store, PLAN, world_size=4, horizon_steps=3, timeout_s=1.0)
        time.sleep(0.3)
        _stop(ranks)
    assert not outcome.committed
    assert "only 3 of 4 ranks accepted" in outcome.reason
    assert all(not r.applied for r in ranks)


def test_ranks_wait_at_their_horizon_and_give_up_without_a_controller(url: str) -> None:
    ranks = _ranks(url, 2)
    with open_store(url, timeout_s=CONNECT_S) as store:
        # a controller that writes the plan and dies before deciding
        store.set_json(
            "failslow/plans/1/plan",
            {
                "plan": {"type": "MicroBatchPlan", "counts": [1, 3], "weights": [0.5, 1.5]},
                "horizon_steps": 3,
            },
        )
        store.set_json("failslow/plans/current", {"epoch": 1})
        deadline = time.monotonic() + 10
        while store.add("failslow/plans/1/acks", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        blocked = store.get("failslow/plans/1/latest")
        time.sleep(0.5)
        # both ranks stand at their horizon: no step beyond it without a decision
        assert all(r.step <= int(blocked or b"0") for r in ranks)
        time.sleep(2.5)  # decision_timeout_s = 2: they give up and go on, nothing applied
        _stop(ranks)
    assert all(not r.applied for r in ranks)
    assert all(r.receiver.outcomes[-1][2] is None for r in ranks)
    assert all("no decision within 2 s" in r.receiver.outcomes[-1][3] for r in ranks)
    assert all(r.step > int(blocked or b"0") for r in ranks)


def test_a_plan_from_before_a_rank_joined_is_not_applied(url: str) -> None:
    with open_store(url, timeout_s=CONNECT_S) as store:
        store.set_json("failslow/plans/current", {"epoch": 7})
        rank = Rank(url, 0)
        assert rank.receiver.epoch == 7
        rank.store.close()


def test_raise_max_is_atomic(url: str) -> None:
    with open_store(url, timeout_s=CONNECT_S) as store:
        stores: list[Store] = [open_store(url, timeout_s=CONNECT_S) for _ in range(4)]
        threads = [
            threading.Thread(
                target=lambda s=s, i=i: [raise_max(s, "m", v) for v in range(i, 200, 4)]
            )
            for i, s in enumerate(stores)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in stores:
            s.close()
        assert store.get("m") == b"199"


def test_horizon_covers_the_configured_time() -> None:
    assert horizon_steps(0.1, 1.0) == 10
    assert horizon_steps(5.0, 1.0) == 2  # never fewer than 2 steps
    assert horizon_steps(None, 1.0) == 8  # no step time known yet


def test_a_restarted_rank_ignores_a_plan_decided_before_it_joined(url: str) -> None:
    """A process restarted after a plan was decided (say, stopped for a hot update) may read
    ``current`` late (its store still connecting): it must not take that old plan up."""
    with open_store(url, timeout_s=CONNECT_S) as store:
        store.set_json(
            "failslow/plans/1/plan",
            {
                "plan": {"type": "MicroBatchPlan", "counts": [1, 3], "weights": [0.5, 1.5]},
                "horizon_steps": 3,
            },
        )
        store.set_json("failslow/plans/1/decision", {"apply_step": 19})
        rank = Rank(url, 0)
        rank.receiver.epoch = 0  # as if ``current`` was unreadable when it started
        store.set_json("failslow/plans/current", {"epoch": 1})
        rank.receiver.poll()
        assert rank.receiver.pending() is None
        assert store.add("failslow/plans/1/acks", 0) == 0
        rank.store.close()


def test_ranks_with_a_job_token_act_only_on_plans_that_carry_it(url: str) -> None:
    """Anyone who can reach the store could otherwise restart or reshape the job."""
    ranks = _ranks(url, 2, token="s3cret")
    with open_store(url, timeout_s=CONNECT_S) as store:
        forged = dispatch(store, PLAN, world_size=2, horizon_steps=3, timeout_s=1.0)
        wrong = dispatch(store, PLAN, world_size=2, horizon_steps=3, timeout_s=1.0, token="guess")
        assert not forged.committed and not wrong.committed
        assert "only 0 of 2 ranks accepted" in forged.reason
        outcome = dispatch(store, PLAN, world_size=2, horizon_steps=3, timeout_s=20, token="s3cret")
        assert outcome.committed, outcome.reason
        deadline = time.monotonic() + 20
        while any(not r.applied for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.02)
        _stop(ranks)
    assert all(r.applied == [(outcome.apply_step, PLAN)] for r in ranks)


def test_data_read_ahead_learns_the_plan_before_its_step(url: str) -> None:
    """A loader that reads ahead (before_data) gets a committed plan for the steps it reads,
    and a plan accepted later never takes effect at a step whose data was read already."""
    with open_store(url, timeout_s=CONNECT_S) as store:
        step = [3]
        receiver = PlanReceiver(store, rank=0, prepare=lambda plan: None, step=lambda: step[0])
        assert receiver.before_data(9) == []  # data read up to step 9, no plan yet
        result: list = []
        thread = threading.Thread(
            target=lambda: result.append(
                dispatch(store, PLAN, world_size=1, horizon_steps=2, timeout_s=20)
            )
        )
        thread.start()
        while receiver.pending() is None:
            receiver.poll()
            time.sleep(0.01)
        assert receiver.pending()["block_at"] == 10  # past the data read, not step 3 + 2
        thread.join(timeout=20)
        outcome = result[0]
        assert outcome.committed and outcome.apply_step == 10
        assert receiver.before_data(10) == [(10, PLAN)]  # the decision is read before step 10
        step[0] = 10
        assert receiver.due(10) == PLAN


def test_each_rank_reports_what_it_ran_and_the_controller_reads_two_counters(url: str) -> None:
    """The closed loop's third phase: after the apply step each rank says whether it ran the
    plan; the controller reads the counts and the first refusal's reason."""
    from failslow.core.control.plan_channel import read_effect

    ranks = _ranks(url, 3) + _ranks(url, 1, ran=lambda plan: "ran 4 micro-batches in step 9")
    with open_store(url, timeout_s=CONNECT_S) as store:
        outcome = dispatch(store, PLAN, world_size=4, horizon_steps=5, timeout_s=20)
        assert outcome.committed, outcome.reason
        deadline = time.monotonic() + 20
        effect = read_effect(store, outcome.epoch)
        while effect.ran + effect.not_ran < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
            effect = read_effect(store, outcome.epoch)
        _stop(ranks)
    assert (effect.ran, effect.not_ran) == (3, 1)
    assert effect.why == "rank 0: ran 4 micro-batches in step 9"
    assert effect.state(4) == "not in effect" and effect.state(3) == "not in effect"
