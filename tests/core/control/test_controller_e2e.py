"""End to end on a real 4-rank gloo job: a compute straggler is detected, profiled, validated
and diagnosed by the controller state machine (greyhound 4.1-4.3), training never stops.

Ranks train (matmul + two all-reduces per step) with the Python hook and an agent; the test
process plays the node (LocalAnalyzer -> NodePublisher, on a thread running the publisher's own
loop and poll cadence, as ``failslow run`` hosts it) and the controller (embedded). After a
healthy warm-up, rank 2 is duty-cycled with SIGSTOP/SIGCONT. The controller must go TRACKING ->
PROFILING -> VALIDATING -> DIAGNOSED and name rank 2, kind compute; the reaction (onset ->
diagnosis, in the straggler's iterations) is printed and kept in ``reaction.json``.
Run as a script, this file is one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _world import spawn_ranks

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess, pytest.mark.slow]

WORLD = 4
SLOW = 2


def test_controller_diagnoses_a_compute_straggler(tmp_path: Path) -> None:

    from failslow.core.control.controller import Controller, State
    from failslow.core.diagnosis.record import Kind
    from failslow.core.localize.config import DetectionConfig, ValidationConfig
    from failslow.core.tracking.analyzer import LocalAnalyzer
    from failslow.faults import DutyCycleThrottle
    from failslow.node.publisher import NodePublisher

    control, ring_dir, stop_file, _job, procs = _spawn(tmp_path, pause_timeout="60")
    throttle = DutyCycleThrottle(procs[SLOW].pid, stopped_fraction=0.75, period_s=0.02)
    diagnosed: list = []
    settings = dict(
        world_size=WORLD,
        log_dir=tmp_path / "logs",
        detection=DetectionConfig(threshold=2.0),
        validation=ValidationConfig(
            gemm_size=1536,
            gemm_dtypes=("float32",),
            gemm_repetitions=5,
            gemm_serial=True,
            link_mb=8,
            link_repetitions=5,
        ),
    )
    done = threading.Event()
    try:
        _wait_for_rings(ring_dir)
        publisher = NodePublisher(LocalAnalyzer(ring_dir), control)
        node = threading.Thread(target=publisher.run, args=(done.is_set,), daemon=True)
        node.start()  # the node's loop as `failslow run` hosts it, with its poll cadence
        onset_iteration = None
        controller: Controller | None = None
        timeline: list[tuple[str, int]] = []  # (controller state, the straggler's iterations)
        deadline = time.monotonic() + 150
        while not diagnosed:
            assert time.monotonic() < deadline, "no diagnosis in time"
            if controller is not None and len(controller.history) > len(timeline):
                for t in controller.history[len(timeline) :]:
                    timeline.append((t.state.value, publisher.iterations.get(SLOW, 0)))
            if onset_iteration is None and publisher.iterations.get(SLOW, 0) >= 120:
                # the controller starts with the fault: warm-up noise on a shared machine is
                # not what this test is about (the detector's false alarms are benchmarked)
                controller = Controller(control, **settings, on_diagnosis=diagnosed.append)
                publisher.on_event = controller.wake.set  # as failslow run wires them
                controller.wake_publisher = publisher.ask
                publisher.asked_here = True
                ctl = threading.Thread(target=controller.run, args=(done.is_set,), daemon=True)
                ctl.start()
                # the straggler's iterations now, not as of the publisher's last poll (up to
                # two iterations old while its ranks are calm): one poll more, then the fault
                polls = publisher.polls
                publisher.wake.set()
                while publisher.polls == polls:
                    time.sleep(0.001)
                onset_iteration = publisher.iterations[SLOW]
                throttle.start()
            time.sleep(0.02)
        diagnosis_iteration = publisher.iterations.get(SLOW, 0)
        throttle.stop()
    finally:
        done.set()
        throttle.stop()
        outs = _stop_ranks(procs, stop_file)
    (diagnosis,) = diagnosed
    assert controller is not None
    states = [t.state for t in controller.history]
    reaction = {
        "onset_iteration": onset_iteration,
        "diagnosis_iteration": diagnosis_iteration,
        "iterations": diagnosis_iteration - (onset_iteration or 0),
        "seconds": controller.history[-1].wall - controller.history[1].wall,
        "states": [s.value for s in states],
        "first_onset": controller.history[1].detail.get("onsets", [None])[0],
        "timeline": timeline,
        "paused_s": diagnosis.evidence.get("paused_s"),
        "diagnosis": json.loads(diagnosis.to_json()),
    }
    (tmp_path / "reaction.json").write_text(json.dumps(reaction, indent=1))
    print(json.dumps({k: v for k, v in reaction.items() if k != "diagnosis"}))
    assert "validating" not in reaction["states"][4:], "one fail-slow, one validation round"
    assert states[:5] == [
        State.TRACKING,
        State.PROFILING,
        State.VALIDATING,
        State.DIAGNOSED,
        State.TRACKING,
    ], reaction
    assert [s.rank for s in diagnosis.slow_ranks] == [SLOW], reaction
    assert diagnosis.kind is Kind.COMPUTE, reaction
    # the pause landed at an iteration's start: the gradient all-reduce after the compute gap
    # (world calls alternate gradient, bias from call 0: the start is an even call_index)
    assert diagnosis.evidence["target"]["call_index"] % 2 == 0, reaction
    assert list((tmp_path / "logs").glob("diagnosis-*.json")), "no diagnosis file"
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{out[-3000:]}"


def _spawn(tmp_path: Path, *extra: str, pause_timeout: str) -> tuple[Any, ...]:
    """A control store in this process and the ranks (this file run as a script, ``extra``
    arguments after their own); returns the store, the ring directory, the stop file, the job's
    store (its master: keep it alive while the ranks run) and the rank processes."""
    from failslow.core.control.store import open_store

    control = open_store("tcp://127.0.0.1:0?master=1")
    url = f"tcp://127.0.0.1:{control.port}"
    ring_dir, stop_file = tmp_path / "rings", tmp_path / "stop"
    job, procs = spawn_ranks(
        __file__,
        WORLD,
        lambda r, port: [str(r), str(port), url, str(ring_dir), str(stop_file), *extra],
        pause_timeout=pause_timeout,
    )
    return control, ring_dir, stop_file, job, procs


def _wait_for_rings(ring_dir: Path) -> None:
    from failslow.core.ring import find_rings

    deadline = time.monotonic() + 60
    while len(find_rings(ring_dir)) < WORLD:
        assert time.monotonic() < deadline, "rings did not appear"
        time.sleep(0.05)


def _stop_ranks(procs: list[subprocess.Popen[str]], stop_file: Path) -> list[str]:
    """Tell the ranks to stop; their output (a rank that does not exit within a minute is
    killed)."""
    stop_file.touch()
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    return outs


LIFE_START, LIFE_END = 150, 650
"""Iterations (each rank's loop count) between which the healthy-life test injects its
transients."""
LIFE_STEP_S = 0.03
"""About one healthy iteration of the ranks' loop: the unit of the injected extra time."""


def life_schedule(seed: int = 47) -> list[tuple[int, int, float, str]]:
    """The healthy life the ranks act out (issue 47), the same on every rank: ``(first
    iteration, iterations, extra seconds each, kind)`` - noisy-neighbour bursts (3-9
    iterations at 2-3x), data-loader stalls (1-3 iterations at 3-5x) and evaluations whose
    period jitters (2 iterations at 2.5x every 60-140), 20-50 iterations apart."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out: list[tuple[int, int, float, str]] = []
    k, next_eval = LIFE_START, LIFE_START + int(rng.integers(60, 140))
    while k < LIFE_END:
        k += int(rng.integers(20, 50))
        if k >= next_eval:
            out.append((k, 2, 1.5 * LIFE_STEP_S, "eval"))
            next_eval = k + int(rng.integers(60, 140))
        elif rng.random() < 0.6:
            out.append((k, int(rng.integers(3, 10)), rng.uniform(1.0, 2.0) * LIFE_STEP_S, "burst"))
        else:
            out.append((k, int(rng.integers(1, 4)), rng.uniform(2.0, 4.0) * LIFE_STEP_S, "stall"))
        k += out[-1][1]
    return out


@pytest.mark.quiet  # no load beside it under ./dev test (tests/conftest.py)
def test_a_healthy_job_s_transients_start_no_validation(tmp_path: Path) -> None:
    """Issue 47, online: every rank acts out a healthy life (:func:`life_schedule`: bursts,
    loader stalls, jittered evals) under the node's analyzer and publisher and the controller,
    as ``failslow run`` hosts them. The transients pass verification on the times alone, are
    recorded as transients, and none of them is published as an onset - so none starts a
    profiling round or a validation pause. (A slowdown of the shared machine itself may still
    be one, a real one: onsets are checked against the injected episodes and their 2-5x
    levels, and an episode that the machine dragged on - the rank's own iterations after it
    10% slower than before it, until the onset was reported - is one too; reported at once,
    before issue 47, the episodes fail this.)"""
    import numpy as np

    from failslow.core.control import keys
    from failslow.core.control.controller import Controller, State
    from failslow.core.localize.config import DetectionConfig
    from failslow.core.tracking.analyzer import LocalAnalyzer
    from failslow.node.publisher import NodePublisher

    # a round cut short at the end leaves no rank paused for long
    control, ring_dir, stop_file, _job, procs = _spawn(tmp_path, "life", pause_timeout="10")
    done = threading.Event()
    controller: Controller | None = None
    journal: list[dict] = []  # what the controller hands its observers (the run's journal)
    threads: list[threading.Thread] = []
    try:
        _wait_for_rings(ring_dir)
        publisher = NodePublisher(LocalAnalyzer(ring_dir), control)
        threads.append(threading.Thread(target=publisher.run, args=(done.is_set,), daemon=True))
        threads[-1].start()
        deadline = time.monotonic() + 150
        while publisher.iterations.get(0, 0) < LIFE_END + 60:
            assert time.monotonic() < deadline, f"too slow: {publisher.iterations}"
            if controller is None and publisher.iterations.get(0, 0) >= 100:
                controller = Controller(
                    control, world_size=WORLD, log_dir=tmp_path / "logs",
                    detection=DetectionConfig(threshold=2.0), on_event=journal.append,
                )  # fmt: skip
                publisher.on_event = controller.wake.set
                controller.wake_publisher = publisher.ask
                publisher.asked_here = True
                threads.append(
                    threading.Thread(target=controller.run, args=(done.is_set,), daemon=True)
                )
                threads[-1].start()
            time.sleep(0.05)
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=30)
        outs = _stop_ranks(procs, stop_file)
    assert controller is not None
    schedule = life_schedule()
    # the rank whose detector recorded the most (a validation round's own calls can make the
    # tracker find the pattern again, which starts a fresh detector on that rank)
    transients = max((s.detector.transients for s in publisher.analyzer.ranks.values()), key=len)
    onsets = [
        control.get_json(f"{keys.NODE}/onsets/{n}")
        for n in range(1, control.add(f"{keys.NODE}/onsets", 0) + 1)
    ]
    times = publisher.analyzer.ranks[0].iteration_times
    around = {
        o["iteration"]: [round(1e3 * t) for t in times[o["iteration"] - 5 : o["reported_at"] + 3]]
        for o in onsets if o["rank"] == 0 and o["type"] == "onset"
    }  # fmt: skip
    why = json.dumps({"schedule": schedule, "onsets": onsets, "rank 0 ms around onsets": around,
                      "transients": [t.as_dict() for t in transients],
                      "states": [t.state.value for t in controller.history]})  # fmt: skip
    # bursts of 4 points or more pass verification (min_post) and are recorded as transients
    # (all of them on a quiet machine); the test is not vacuous while one is
    assert transients, why
    # the loop's count and the tracker's differ by the iterations before its period was found:
    # the offset is where the transients line up with the injected episodes
    starts = [k for k, *_ in schedule]
    offset = max(
        range(-5, 60),
        key=lambda d: sum(any(abs(t.start + d - k) <= 2 for k in starts) for t in transients),
    )
    for onset in onsets:
        at = onset["iteration"] + offset
        hit = [e for e in schedule if e[0] - 2 <= at <= e[0] + e[1] + 2]
        # the injected episodes are 2-5x; what a busy machine adds around them, 1.1-1.3x for
        # tens of iterations, is a slowdown of its own (a real one: it persisted)
        injected = onset["type"] == "onset" and onset["after_s"] >= 1.5 * onset["before_s"]
        if hit and injected:
            # ... and so is an episode the starved cores drag on: beside a 2-process CPU hog
            # (6 processes on 2 cores) a 2x burst's iterations after it ran at 1.5-2x until the
            # onset was reported (14 slow iterations: enough to persist). The rank's own times
            # say which: the iterations from the episode's end to the report, against the 20
            # before it - the detector's threshold (10%) over them is a real slowdown
            times = publisher.analyzer.ranks[onset["rank"]].iteration_times
            start, end = hit[0][0] - offset, hit[0][0] + hit[0][1] - offset
            before = float(np.median(times[max(0, start - 20) : start]))
            after = times[end : onset["reported_at"] + 1]  # none: reported while it lasted
            dragged = float(np.median(after)) if after else 0.0
            assert dragged >= 1.1 * before, (
                f"an injected transient was reported: {hit}, rank {onset['rank']} "
                f"{1e3 * dragged:.0f} ms per iteration after it vs {1e3 * before:.0f} before; "
                f"{why}"
            )
    if not onsets:  # nothing was slow: the controller never left tracking
        assert {t.state for t in controller.history} == {State.TRACKING}, why
    # every transient was published (as a transient, not an onset), and the controller put
    # those it read into the journal - and did nothing else with them
    published = [
        control.get_json(f"{keys.NODE}/{keys.TRANSIENTS}/{n}")
        for n in range(1, control.add(f"{keys.NODE}/{keys.TRANSIENTS}", 0) + 1)
    ]
    assert len(published) == sum(s.transients for s in publisher.analyzer.ranks.values()), why
    fields = ("rank", "start", "end", "detected_at", "before_s", "after_s")
    journaled = [tuple(e[k] for k in fields) for e in journal if e["kind"] == "transient"]
    assert journaled and set(journaled) <= {tuple(r[k] for k in fields) for r in published}, why
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{out[-3000:]}\n{why}"


def _rank_main(
    rank: int, port: int, url: str, ring_dir: str, stop_file: str, life: bool = False
) -> None:
    import torch
    import torch.distributed as dist

    import failslow.nccl_hook as hook
    from failslow.core.control.resilient import ResilientStore
    from failslow.runtime import rank_control

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    capture = hook.install(ring_dir, global_rank=rank)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    agent = rank_control.attach(capture, ResilientStore(url), poll_s=0.05)
    w = torch.randn(256, 256) / 16
    x = torch.randn(64, 256)
    bias = torch.zeros(1024)
    extra = {k + i: s for k, n, s, _ in (life_schedule() if life else []) for i in range(n)}
    # the healthy life's steps are mostly waiting (an input pipeline's, a GPU's): their times
    # stay steady on shared cores, so what the detector sees is what the schedule injects
    compute, wait = (1, LIFE_STEP_S) if life else (10, 0.01)
    step = 0
    while True:
        for _ in range(compute):
            y = torch.tanh(x @ w)
        grad = (y.T @ x) / 64
        dist.all_reduce(grad)
        # every rank stops after the same iteration: the stop file's sight rides on the bias
        # all-reduce (checked on each rank alone, a rank that saw it one iteration before the
        # others entered the barrier while they entered this all-reduce - a hang, then the
        # kill after a minute: the run beside heavy load that ended with rank 0 at -9)
        bias[0] = float(Path(stop_file).exists())
        dist.all_reduce(bias)
        w -= 1e-3 * grad / WORLD
        if bias[0] > 0:
            break
        time.sleep(wait + extra.get(step, 0.0))
        step += 1
    agent.stop()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    life = len(sys.argv) > 6 and sys.argv[6] == "life"
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], life)
