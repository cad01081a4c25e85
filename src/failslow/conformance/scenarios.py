"""The rank side of the conformance suite: every invariant's scenario for one layout, in turn.

Spawning a world is the expensive part (imports), so one world runs every scenario of every
layout and writes what each rank saw; the test mixins only assert on those files. Per layout,
three jobs are built from the same seed:

1. ``reference`` - :data:`STEPS` steps on the framework's even split, each step's CLOCK_MONOTONIC
   window and the harness's expected collectives recorded (invariant 1, greyhound 4.2 capture);
   afterwards every capability is requested (:mod:`failslow.conformance.requests`).
2. ``microbatch`` - if the adapter supports micro-batch plans: uneven counts from step 1, a
   more skewed plan at step 2 and the even split again at step 3, each scheduled with
   ``session.schedule(plan, step)`` on every rank (no store). Invariant 2 (greyhound 5.2,
   weighted aggregation: weight ``counts[r] * D / M``): its parameters equal the reference's.
   In the size form (the adapter's ``failslow_microbatch_unit``: every replica runs the loop's
   ``G`` micro-batches, a plan sizes them) each replica reads ``counts[r] * B`` samples per step
   instead, and where the harness sees which samples (``samples_read``) every sample of the
   step is read once. Invariant 7: what each rank's session reported of every plan
   (``effects``: applied, then in effect or not, from what the rank ran) - the plans of steps 1
   and 2 are checked at the next boundaries.
3. ``pause`` - after step :data:`HOLD` the ranks wait at a file handshake; the test process
   requests the pause trap on every ring, lets them go, sees every rank park at its next
   collective, and releases them (greyhound 4.3: pause for validation, then resume).
   Invariant 6: no step lost, parameters bitwise equal to the reference's.
4. ``swap`` - if the adapter supports topology plans: every rank's host is its own
   (``FAILSLOW_HOST``, set by the world), and from step :data:`SWAP_STEP` every role moves to
   the next rank's host (a rotation: every role moves, state travels around one cycle), with
   ``session.schedule(plan, step)`` on every rank. Invariant 3 (greyhound 5.2, S3 in place):
   each rank's parameters equal the reference's rank that held the same role, in the same
   process (no restart). A plan that gives one host every role is refused at prepare. With
   snapshots, the job is then restarted in place (closed, built afresh in its launch roles) and
   must resume the swapped placement from the newest snapshot (``swap_resumed``).
5. ``snapshot`` / ``resumed`` - if the adapter supports snapshots: the reference run again with
   an in-memory snapshot at every step boundary (byterobust 6.3) into a directory that outlives
   the job; then the job is closed and built afresh - a restart in place, as a hot update does
   (byterobust 6.1) - and its session resumes from the newest snapshot. Invariants 4 and 5: the
   snapshots change nothing (bitwise equal to the reference), the new job resumes at the last
   snapshotted step, and finishing the run from there gives bitwise the reference's parameters.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from failslow import hookimpl
from failslow.conformance.harness import AdapterHarness, AdapterJob
from failslow.conformance.requests import request_each
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan, TopologyPlan

SEED = 20240607
STEPS = 4
HOLD = 1
"""The pause run waits at the handshake after this step."""
HOLD_TIMEOUT_S = 60.0
SWAP_STEP = 2
"""The swap run moves every role at this step boundary."""


def plan_counts(micro_batches: int, dp: int) -> dict[int, tuple[int, ...]]:
    """Counts per DP replica by step for the micro-batch run: uneven, more skewed, even."""
    even = micro_batches // dp
    if dp < 2 or even < 2 or even * dp != micro_batches:
        raise ValueError(
            f"the conformance layout needs DP >= 2 and an even split of >= 2 micro-batches per "
            f"replica to make uneven plans; got {micro_batches} micro-batches over DP={dp}"
        )
    shift = max(1, even // 2)
    uneven = [even] * dp
    uneven[0] -= shift
    uneven[-1] += shift
    skewed = [1] * dp
    skewed[0] = micro_batches - (dp - 1)
    return {1: tuple(uneven), 2: tuple(skewed), 3: (even,) * dp}


def weighted(counts: tuple[int, ...], micro_batches: int) -> MicroBatchPlan:
    """``counts`` with the weights ``m_r * D / M`` that keep the even split's gradient."""
    assert sum(counts) == micro_batches
    return MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))


def _collect() -> None:
    """Free the jobs a scenario closed, now, and freeze what is left.

    A framework's objects sit in reference cycles that hold its process groups, and a gloo
    group freed only at some later collection keeps its threads and sockets until then. The
    Megatron world (4 layouts, ~30 jobs per rank) ran 298 s in a suite run with 1,250 threads
    per rank by its last layout, whose steps took 4-10x those of its first. Between scenarios
    no job is referenced any more, so a collection frees them all; what survives it is live
    and is frozen (``gc.freeze``): the next collection, here or automatic, walks only what
    later jobs made, not the ~195,000 objects of the imports (a full collection with torch
    and deepspeed imported: ~0.1 s). Left: Megatron's distributed optimizer outlives its job
    even so (a plain ``build_gpt(distributed_optimizer=True)``, deleted and collected, stays
    alive with its 17 groups; Megatron's own, not root-caused)."""
    gc.collect()
    gc.freeze()


class PlanResults:
    """A plugin recording what the session reports of each plan on this rank."""

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    @hookimpl
    def failslow_on_plan_result(
        self, plan: Any, step: int | None, outcome: str, detail: str
    ) -> None:
        self.seen.append([outcome, step, detail])


class LayoutRunner:
    """Runs one layout's scenarios on this rank and writes ``<layout>.rank<R>.json`` (+ npz)."""

    def __init__(
        self, harness: AdapterHarness, layout: str, *, rank: int, out: Path, sync: Path
    ) -> None:
        self.harness = harness
        self.layout = layout
        self.rank = rank
        self.out = out
        self.sync = sync
        self.result: dict[str, Any] = {"layout": layout, "rank": rank, "runs": {}}

    def run(self) -> dict[str, Any]:
        try:
            self._reference()
            _collect()
            if self.result["capabilities"]["microbatch_plans"] == "":
                self._microbatch()
                _collect()
            self._pause()
            _collect()
            if self.result["capabilities"]["topology_plans"] == "":
                self._swap()
                _collect()
            if self.result["capabilities"]["snapshots"] == "":
                self._snapshot()
                _collect()
        except Exception:
            self.result["error"] = traceback.format_exc()
            raise
        finally:
            path = self.out / f"{self.layout}.rank{self.rank}.json"
            path.write_text(json.dumps(self.result))
        return self.result

    # ---- scenarios ---------------------------------------------------------------------------
    def _reference(self) -> None:
        from failslow import nccl_hook

        job = self.harness.build(self.layout, SEED)
        session = job.session
        if not session.started or nccl_hook.current() is None:
            raise AssertionError(
                "the adapter's session is not started or did not install the capture "
                "(failslow config: enabled and capture must be true for the suite)"
            )
        topology = session.topology
        self.result.update(
            capabilities=session.capabilities.to_dict(),
            topology=topology.to_dict(),
            replica=topology.coords[self.rank][1],
            by_size=session.pm.hook.failslow_microbatch_unit(),
        )
        self._steps(job, "reference", expect=True)
        self.result["requests"] = request_each(session)
        job.close()

    def _microbatch(self) -> None:
        job = self.harness.build(self.layout, SEED)
        session = job.session
        topology = session.topology
        schedule = plan_counts(topology.micro_batches, topology.dp)
        for step, counts in schedule.items():
            session.schedule(weighted(counts, topology.micro_batches), step)
        self.result["plans"] = {str(step): list(counts) for step, counts in schedule.items()}
        self.result["malformed_plan"] = self._malformed(job, topology.micro_batches, topology.dp)
        results = PlanResults()
        session.register(results)
        self._steps(job, "microbatch")
        self.result["effects"] = {"microbatch": results.seen}
        job.close()

    def _malformed(self, job: AdapterJob, micro_batches: int, dp: int) -> dict[str, Any]:
        """A plan whose counts do not add up to the global batch must be refused at once."""
        counts = (micro_batches // dp + 1,) * dp
        try:
            job.session.prepare(weighted(counts, micro_batches))
        except Exception as exc:
            return {"counts": list(counts), "raised": type(exc).__name__, "message": str(exc)}
        return {"counts": list(counts), "raised": None, "message": ""}

    def _pause(self) -> None:
        job = self.harness.build(self.layout, SEED)
        self._steps(job, "pause", hold=HOLD)
        job.close()

    def _swap(self) -> None:
        snapshots = self.result["capabilities"]["snapshots"] == ""
        directory = self.sync / f"swap-snapshots-{self.layout}"
        settings = {"checkpoint": {"every_steps": 1, "directory": str(directory)}}
        job = self.harness.build(self.layout, SEED, failslow=settings if snapshots else None)
        session = job.session
        hosts = session.topology.hosts
        rotated = TopologyPlan(hosts=hosts[1:] + hosts[:1], reason="conformance: rotate roles")
        crowded = TopologyPlan(hosts=(hosts[0],) * len(hosts))
        try:
            session.prepare(crowded)
            refused: dict[str, Any] = {"raised": None, "message": ""}
        except Exception as exc:
            refused = {"raised": type(exc).__name__, "message": str(exc)}
        session.schedule(rotated, SWAP_STEP)
        pid = os.getpid()
        results = PlanResults()
        session.register(results)
        self._steps(job, "swap")
        self.result.setdefault("effects", {})["swap"] = results.seen
        self.result["swap"] = {
            "plan": list(rotated.hosts),
            "hosts": list(hosts),
            "coords_after": list(session.topology.coords[self.rank]),
            "same_process": os.getpid() == pid,
            "crowded": refused,
        }
        if not snapshots:
            job.close()
            return
        sealed = session.snapshots.wait_sealed(timeout_s=60.0)
        job.close()
        # a restart in place after the swap: the fresh job starts in its launch role and must
        # resume the swapped placement from the snapshot
        job = self.harness.build(self.layout, SEED, failslow=settings)
        resumed = job.session.resumed_step
        self.result["swap"].update(sealed=sealed, resumed=resumed)
        if resumed is not None:
            self._steps(job, "swap_resumed", start=resumed)
            self.result["swap"]["coords_resumed"] = list(job.session.topology.coords[self.rank])
        job.close()

    def _snapshot(self) -> None:
        directory = self.sync / f"snapshots-{self.layout}"
        settings = {"checkpoint": {"every_steps": 1, "directory": str(directory)}}
        job = self.harness.build(self.layout, SEED, failslow=settings)
        self._steps(job, "snapshot")
        sealed = job.session.snapshots.wait_sealed(timeout_s=60.0)
        job.close()
        # the restart in place: a fresh job over the same directory resumes from it
        job = self.harness.build(self.layout, SEED, failslow=settings)
        resumed = job.session.resumed_step
        self.result["snapshot"] = {"sealed": sealed, "resumed": resumed}
        if resumed is not None:
            self._steps(job, "resumed", start=resumed)
        job.close()

    # ---- one run -----------------------------------------------------------------------------
    def _steps(
        self, job: AdapterJob, name: str, *, expect: bool = False, hold: int = -1, start: int = 0
    ) -> None:
        record: dict[str, Any] = {
            "windows": [],
            "session_steps": [],
            "micro_batches": [],
            "step_s": [],
        }
        if expect:
            record["expected"] = []
        before = job.micro_batches_run()
        seen = job.samples_read()
        read = None if seen is None else list(seen)
        if read is not None:
            record["samples"] = []
        for step in range(start, STEPS):
            t0 = time.monotonic_ns()
            job.run_step(step)
            t1 = time.monotonic_ns()
            after = job.micro_batches_run()
            record["windows"].append([t0, t1])
            record["step_s"].append((t1 - t0) / 1e9)
            record["session_steps"].append(job.session.step)
            record["micro_batches"].append(after - before)
            before = after
            if read is not None:
                now = list(job.samples_read() or ())
                record["samples"].append(now[len(read) :])
                read = now
            if expect:
                expected = job.expected_collectives(step)
                record["expected"].append(
                    None if expected is None else [c.to_dict() for c in expected]
                )
            if step == hold:
                record["released"] = self._hold()
        record["profile"] = job.session.profile.summary()  # what the S2 estimate reads
        params = job.parameters()
        np.savez(
            self.out / f"{self.layout}.{name}.rank{self.rank}.npz", allow_pickle=False, **params
        )
        record["parameters"] = sorted(params)
        self.result["runs"][name] = record

    def _hold(self) -> bool:
        """Stand between two steps until the test process says go (it requests the pause)."""
        (self.sync / f"{self.layout}.hold.rank{self.rank}").touch()
        go = self.sync / f"{self.layout}.go"
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not go.exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True
