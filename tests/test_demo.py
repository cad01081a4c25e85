"""`failslow demo` end to end: a real 4-rank gloo job, a real SIGSTOP slowdown, detection."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_demo_detects_injected_slowdown(tmp_path) -> None:
    out = tmp_path / "run"
    exe = os.path.join(os.path.dirname(sys.executable), "failslow")
    proc = subprocess.run(
        [
            exe,
            "demo",
            "--no-live",
            "--iterations",
            "160",
            "--slow-start",
            "60",
            "--slow-end",
            "110",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "summary.json").is_file(), tail
    summary = json.loads((out / "summary.json").read_text())
    why = "demo summary: " + json.dumps(summary)  # every failure says what the run saw
    times = np.loadtxt(out / "iteration_times.csv", delimiter=",", skiprows=1)[:, 1]
    # Did the job come back to its level before the injected onset (within 1.1x: the detector's
    # line)? Where the machine stays slower, a relief is not the detector's to be sure of - see
    # the relief's checks below - and the demo exits 1 when it reports none.
    end = summary["injected"]["end_iteration"]
    assert summary["injected_onset"] is not None, why
    baseline = summary["injected_onset"]["before_s"]
    after = float(np.median(times[end + 3 : end + 33]))
    back = after <= 1.1 * baseline
    why += f"; after the throttle: {after:.3f} s, {after / baseline:.2f}x {baseline:.3f} s before"
    relief_missed = summary["relief_latency_iterations"] is None
    assert proc.returncode == 0 or (relief_missed and not back), tail + why
    # An onset other than the injected one is either a real slowdown of this shared machine
    # (seen: +26% for 16 iterations on all four ranks; in one suite run two, +19% at iteration 25
    # and +35% for 30 iterations at 121, by the job's own iteration times) or a false alarm. A
    # real one is right to report; at most one may be a false alarm - a change the job's
    # iteration times do not show (median of the 10 after vs the 12 before, under +10%). The
    # detector's false alarm rate is measured on the labeled corpus (test_corpus.py).
    unseen = [
        o for o in summary["other_onsets"]
        if np.median(times[o["iteration"] : o["iteration"] + 10])
        < 1.1 * np.median(times[max(0, o["iteration"] - 12) : o["iteration"]])
    ]  # fmt: skip
    assert len(unseen) <= 1 and len(summary["other_onsets"]) <= 3, why
    # Latency bound: single iterations here carry ~20-30% scheduling noise (4 ranks on 2 shared
    # cores) and the throttle's effective slowdown varies with load (+20% to +55% measured), so
    # verification (1.5 standard errors past the 10% line) may need ~20 iterations; the detector's
    # own latency targets are checked on the labeled corpus (tests/core/tracking/test_corpus.py).
    onset_latency = summary["onset_latency_iterations"]
    relief_latency = summary["relief_latency_iterations"]
    assert onset_latency is not None, why
    assert 0 <= onset_latency <= 25, why
    # Relief, in two parts: where the detector puts the recovery, and how long it took to say
    # so. The job itself can stay slower for a while after the throttle ends (a suite run:
    # 0.173-0.18 s per iteration for the 18 iterations after it against 0.164 s before, then
    # 0.16 s; the relief's change point was iteration 132 of 110, reported 10 later - 32 from
    # the end, over the former bound of 30 on the sum). A noisy recovery is confirmed once 12
    # settled iterations sit back at the baseline.
    # Both bounds hold where the job comes back to its level before the onset. Where the
    # machine itself stays slower (a CI run: its whole job slowed from 0.307 to 0.40 s ten
    # iterations before the throttle, and ran at 0.343 s after it - 1.12x the baseline, above
    # the 10% line), the detector first takes the drop for a partial recovery and reports the
    # relief once that level has settled within half the slowdown, which the noise decides:
    # 16 iterations after its change point in that run; `python benchmarks/relief_latency.py`
    # - back to the baseline at the demo's noise (0.07-0.13 per iteration): at most 13; back to
    # 1.1-1.13x: up to 46, or not within 50 iterations in up to 1 run in 6 (a suite run here:
    # the job 0.16 s, 0.19 s from iteration 26 - reported - and 0.217 s after the throttle,
    # 1.14x its level before the injected onset; no relief, the demo exited 1). There only the
    # change point is checked, when a relief came.
    reliefs = [e for e in summary["detected"] if e["type"] == "relief" and e["reported_at"] >= end]
    assert relief_latency is not None or not back, why
    if reliefs:
        relief = reliefs[0]
        assert relief["reported_at"] - end == relief_latency >= 0, why  # the one the demo reports
        assert relief["iteration"] - end <= 30, why
        if back:
            assert 0 <= relief["reported_at"] - relief["iteration"] <= 15, why
    errors = summary["iteration_time_rel_error"]
    # 10-iteration means track the ranks' own step timers closely; single iterations carry the
    # scheduling noise of 4 ranks on 2 cores, so they are only checked to be in the right range.
    assert len(errors) == 4, why
    assert max(e["per_10_iterations"] for e in errors.values()) < 0.05, why  # measured 1.1-3.3%
    assert max(e["per_iteration"] for e in errors.values()) < 0.25, why
    assert summary["events_lost"] == 0, why
    assert summary["events_exported"] > 4 * 160, why
    for name in ("iteration_times.csv", "events.jsonl", "iteration_times.png"):
        assert (out / name).stat().st_size > 0
    # The CSV the demo writes is itself a valid `failslow analyze` input.
    analyzed = subprocess.run(
        [exe, "analyze", str(out / "iteration_times.csv"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert analyzed.returncode == 0, analyzed.stderr
    events = json.loads(analyzed.stdout)[str(out / "iteration_times.csv")]["events"]
    # One rank's series (noisier than the four the live view merges) shows at least the onset.
    assert [e["type"] for e in events][:1] == ["onset"], analyzed.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_kill_demo_restarts_from_memory_and_keeps_the_model(tmp_path) -> None:
    """``failslow demo --framework deepspeed --fault kill`` as users run it: two ranks killed,
    the job restarted from memory (the first victim onto the standby slot), the summary's
    restarts, lost steps and downtime, and the parameters bitwise those of a run without kills.
    With 70 steps (kills at steps 20 and 45) the kills do not wait for warm spares (30 steps
    before the end they kill anyway): the warm restart is checked by
    ``tests/e2e/test_failstop.py``."""
    pytest.importorskip("deepspeed", reason="needs the deepspeed extra")
    out = tmp_path / "run"
    exe = os.path.join(os.path.dirname(sys.executable), "failslow")
    proc = subprocess.run(
        [exe, "demo", "--framework", "deepspeed", "--fault", "kill", "--no-live",
         "--iterations", "70", "--out", str(out)],
        capture_output=True, text=True, timeout=850,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    why = "demo summary: " + json.dumps(summary)
    assert summary["fault"] == "kill" and len(summary["restarts"]) == 2, why
    first, second = summary["restarts"]
    assert (first["rank"], second["rank"]) == (2, 1), why  # --slow-rank 2, then (2 + 3) % 4
    assert [s["replaced_by"] for s in summary["failstops"]] == [4, None], why
    for restart in summary["restarts"]:
        assert 0 <= restart["lost_steps"] <= 2, why
        assert restart["downtime_s"] is not None and restart["downtime_s"] > 0, why
        assert restart["detected_s"] < 5.0, why
    assert summary["lost_steps"] == first["lost_steps"] + second["lost_steps"], why
    # one machine stands for five: the first victim's slot was evicted with its memory, so its
    # rank's state came from its holder's backup; the second restarted on its own slot
    assert first["restored_from"] == "holder's backup", why
    assert second["restored_from"] == "own snapshot", why
    assert summary["parameters"]["compared"] and summary["parameters"]["equal"], why
    assert "bitwise equal" in proc.stdout
    # the controller ran (its journal is there) and bought nothing: a plan would change the sums
    assert (out / "events.jsonl").is_file() and summary["plans"] == [], why


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_ladder_demo_climbs_s2_then_s4_and_walks_back(tmp_path) -> None:
    """``failslow demo --framework deepspeed --strategies S2,S3,S4`` as users run it (issue 44:
    the ladder in a real job; greyhound 5.1-5.2, byterobust 6.2-6.3): rank 2's process is
    duty-cycled from outside once the warm spares are ready (75% stopped, ~4x slower: a slow
    GPU). The controller detects, validates and names it; the planner (Algorithm 1's
    break-even over every strategy the job can apply - DeepSpeed cannot swap its topology, so
    S3 is declared unavailable with that reason) buys S2 first: every rank checks that it ran
    its new count and the plan is in effect, measured against its prediction. A rank 4x slower
    still costs time under S2, so the restart is bought once that has paid for it: every rank
    commits its snapshot at one step boundary and exits, and the launcher restarts every rank
    from memory with rank 2 on the standby slot - a new process the throttle does not touch,
    its state from its holder's backup, the S2 split carried in the snapshot. Then a
    re-validation finds every rank healthy and S2 is reverted (the walk back), in effect on
    every rank - unless S2 did not pay what it predicted, when it was reverted before the
    restart with that reason. The parameters equal the job's without the slowdown within 1e-6
    relative (S2 sums the same gradients in another order; the restart is bitwise). One
    standby: exactly one restart, whatever a loaded machine makes the re-validations see after
    it."""
    pytest.importorskip("deepspeed", reason="needs the deepspeed extra")
    out = tmp_path / "run"
    exe = os.path.join(os.path.dirname(sys.executable), "failslow")
    proc = subprocess.run(
        [exe, "demo", "--framework", "deepspeed", "--strategies", "S2,S3,S4", "--no-live",
         "--out", str(out)],
        capture_output=True, text=True, timeout=850,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    why = "demo summary: " + json.dumps(summary)[-6000:]
    assert summary["strategies"] == ["S2", "S3", "S4"] and summary["slow_rank_moved"], why
    assert "cannot rebuild its process groups" in summary["unavailable"]["S3 topology"], why
    # the climb: S2 in effect, then the restart; S2 back to the even split, in effect - after
    # the restart on relief (the walk back), or before it, when its measured step did not pay
    # what it promised (seen on a loaded machine: 0.368 s against 0.274 s predicted)
    committed = [a for a in summary["actions"] if a["committed"]]
    s2 = [a for a in committed if a["strategy"] == "S2 micro-batches"]
    s4 = [a for a in committed if a["strategy"] == "S4 restart"]
    assert s2 and s4 and s2[0]["action"] == "apply", why
    assert s2[0]["apply_step"] < s4[0]["apply_step"], why
    assert s2[0]["counts"][2] == min(s2[0]["counts"]) < 4 and s2[0]["effect"] == "in effect", why
    back = s2[-1]
    assert back["action"] == "revert" and back["counts"] == [4, 4, 4, 4], why
    assert back["effect"] == "in effect", why
    if back["apply_step"] < s4[0]["apply_step"]:
        assert back["reason"].startswith("did not pay: measured"), why
        assert s2[-2]["outcome"]["verdict"] == "short", why
    else:  # relief; or, on a loaded machine, a re-validation that names only a noisy link
        assert back["reason"] in (
            "fail-slow relieved",
            "the communication fail-slow left is not one it mitigates",
        ), why
    assert s4[0]["effect"] == "in effect", why  # the job registered again without rank 2's host
    # the event log has each bought action's predicted and measured step time - or says why
    # it has none: a plan replaced (by the restart, a re-plan) before its window was complete
    # (CI: an action in effect with no outcome at all failed this)
    for a in committed:
        if a["action"] in ("apply", "replan") and a["effect"] == "in effect":
            outcome = a["outcome"]
            assert outcome is not None and outcome["predicted_s"] > 0, (a, why)
            if outcome["verdict"] == "not measured":
                assert outcome["measured_s"] is None, (a, why)
                assert outcome["reason"].endswith("before its window"), (a, why)
            else:
                assert outcome["measured_s"] > 0, (a, why)
    (restart,) = summary["restarts"]
    (moved,) = restart["moved"]
    assert (moved["rank"], moved["slot"], moved["onto"]) == (2, 2, 4), why
    assert moved["restored_from"] == "holder's backup", why
    assert restart["lost_steps"] == 0 and restart["downtime_s"] > 0, why
    assert restart["reason"].startswith("slow impact"), why  # Algorithm 1's break-even
    assert any(r[0] == 2 for d in summary["diagnoses"] for r in d["slow_ranks"]), why
    # the phases' step times are in the table and the plot, measured, not asserted
    assert {"healthy", "slowed", "S2", "mitigated"} <= set(summary["phases"]), why
    assert summary["parameters"]["compared"] and summary["parameters"]["equal"], why
    assert summary["parameters"]["tolerance"].startswith("1e-6 relative"), why
    assert "final parameters vs the same job without the slowdown: equal" in proc.stdout
    assert (out / "steps.csv").is_file()
    report = (out / "report.html").read_text()  # failslow report of the run
    assert "apply S4" in report or "S4 restart" in report
