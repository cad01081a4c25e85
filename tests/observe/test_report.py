"""``failslow report``: the HTML report of a demo run, a ``failslow run`` ring directory and a
simulation, and its one-line errors.

The demo fixture (``tests/data/report/deepspeed_demo``) is a real ``failslow demo --framework
deepspeed --no-live`` run: 4 ranks, rank 2 SIGSTOP-cycled 75% of the time from step 60 to 180,
four diagnoses naming rank 2, an S2 plan applied at step 68 and reverted at step 212 (logs and
parameters left out).
"""

from __future__ import annotations

import io
import json
import shutil
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from failslow.cli import main
from failslow.errors import FailslowError
from failslow.observe.report import load_run, write_report

DEMO = Path(__file__).parents[1] / "data" / "report" / "deepspeed_demo"
SECTIONS = {
    "timeline": "Step-time timeline",
    "heatmap": "Per-rank heat map",
    "validation": "Validation evidence",
    "actions": "Actions",
    "checkpoints": "Checkpoints and updates",
}


class Page(HTMLParser):
    """Every element's tag and attributes, the headings' text and the page's text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.headings: dict[str, str] = {}
        self.text: list[str] = []
        self._heading: str | None = None
        self._section = ""
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.elements.append((tag, a))
        if tag == "section":
            self._section = a.get("id", "")
        if tag == "h2":
            self._heading = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "h2" and self._heading is not None:
            self.headings[self._section] = self._heading
            self._heading = None

    def handle_data(self, data: str) -> None:
        if self._heading is not None:
            self._heading += data
        self.text.append(data)

    def having(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [
            a
            for t, a in self.elements
            if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    @property
    def all_text(self) -> str:
        return " ".join(self.text)


def _report(run_dir: Path, tmp_path: Path) -> Page:
    out = write_report(run_dir, tmp_path / "report.html")
    return Page(out.read_text(encoding="utf-8"))


def _copy_demo(tmp_path: Path, without: tuple[str, ...] = ()) -> Path:
    run = tmp_path / "run"
    shutil.copytree(DEMO, run, ignore=shutil.ignore_patterns(*without))
    return run


def _one_line_error(run: Path, *names: str) -> str:
    with pytest.raises(FailslowError) as info:
        load_run(run)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message
    return message


def _step_times() -> np.ndarray:
    lines = (DEMO / "steps.csv").read_text().splitlines()[1:]
    return np.array([float(line.split(",")[1]) for line in lines])


# ---- the demo run -------------------------------------------------------------------------------
def test_the_demo_report_has_every_section_and_fetches_nothing(tmp_path: Path) -> None:
    out = write_report(DEMO, tmp_path / "report.html")
    text = out.read_text(encoding="utf-8")
    page = Page(text)
    for anchor, heading in SECTIONS.items():
        assert page.headings.get(anchor) == heading
    # the header: what the run was and its phases
    assert "rank 2 SIGSTOP-cycled" in page.all_text and "steps 60-180" in page.all_text
    phases = [row for row in page.all_text.split() if row in ("healthy", "slowed", "mitigated")]
    assert {"healthy", "slowed", "mitigated"} <= set(phases)
    assert "2.54x" in page.all_text  # slowed, x healthy (summary.json)
    # self-contained: no external script, style, image or font
    assert not page.having("link") and not [a for _, a in page.elements if "src" in a]
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text
    # the timeline: the injected window, the four diagnoses, the apply and the revert
    assert page.having("rect", data_kind="injected")
    marks = [(a["data-kind"], float(a["data-step"])) for a in page.having("g", **{"class": "mark"})]
    assert ("apply", 68.0) in marks and ("revert", 212.0) in marks
    assert sum(kind == "diagnosis" for kind, _ in marks) == 4
    assert len(page.having("div", **{"class": "diagnosis"})) == 4
    assert "none recorded" in page.all_text  # no hot updates, no snapshots in a demo


def test_the_straggler_stands_out_in_the_heat_map(tmp_path: Path) -> None:
    page = _report(DEMO, tmp_path)
    rows = {
        int(a["data-rank"]): (float(a["data-shown-mean"]), a["class"])
        for t, a in page.elements
        if t == "g" and a.get("class", "").startswith("hm-row")
    }
    assert sorted(rows) == [0, 1, 2, 3]
    slowest = max(rows, key=lambda r: rows[r][0])
    assert slowest == 2 and "slowest" in rows[2][1]
    assert rows[2][0] - max(m for r, (m, _) in rows.items() if r != 2) > 0.015
    # the cells: rank 2's are the reddest while the slowdown lasts
    cells: dict[int, list[float]] = {}
    rank = None
    for tag, a in page.elements:
        if tag == "g" and a.get("class", "").startswith("hm-row"):
            rank = int(a["data-rank"])
        elif tag == "rect" and "data-ratio" in a and rank is not None:
            cells.setdefault(rank, []).append(float(a["data-ratio"]))
    hot = {r: sum(v > 1.02 for v in values) for r, values in cells.items()}
    assert hot[2] > 2 * max(hot[r] for r in (0, 1, 3))
    assert "Slowest rank in the fail-slow's steps: rank 2" in page.all_text


def test_the_actions_table_shows_the_s2_apply_estimated_against_measured(tmp_path: Path) -> None:
    page = _report(DEMO, tmp_path)
    (apply,) = page.having("tr", data_action="apply")
    (revert,) = page.having("tr", data_action="revert")
    assert apply["data-strategy"].startswith("S2") and apply["data-apply-step"] == "68"
    assert revert["data-apply-step"] == "212"
    # the plan's estimates, from the journal's plan event
    plan = next(
        json.loads(line)
        for line in (DEMO / "events.jsonl").read_text().splitlines()
        if '"kind": "plan"' in line and '"apply"' in line
    )["plan"]
    assert float(apply["data-estimated"]) == pytest.approx(plan["step_time_s"], rel=1e-5)
    assert float(apply["data-baseline"]) == pytest.approx(plan["baseline_step_s"], rel=1e-5)
    # measured: the steps before (from the injection, step 60) and after (until the revert)
    times = _step_times()
    assert float(apply["data-before"]) == pytest.approx(np.median(times[60:68]), rel=1e-5)
    assert float(apply["data-after"]) == pytest.approx(np.median(times[68:212]), rel=1e-5)
    assert float(apply["data-after"]) < float(apply["data-before"])
    assert "faster" in page.all_text and "baseline" in page.all_text


def test_a_demo_run_without_a_journal_still_works(tmp_path: Path) -> None:
    run = _copy_demo(tmp_path, without=("events.jsonl",))
    page = _report(run, tmp_path)
    for anchor, heading in SECTIONS.items():
        assert page.headings.get(anchor) == heading
    assert "no events.jsonl" in page.all_text
    (apply,) = page.having("tr", data_action="apply")
    assert apply["data-apply-step"] == "68" and "data-estimated" not in apply
    assert "data-after" in apply  # measured from the step times all the same
    # the diagnoses from diagnosis-<n>.json, at the step validation paused at
    steps = sorted(float(a["data-step"]) for a in page.having("g", **{"class": "mark"})
                   if a["data-kind"] == "diagnosis")  # fmt: skip
    assert steps == [66.0, 111.0, 133.0, 172.0]
    assert "Validation rounds: none recorded" in page.all_text


# ---- malformed and missing inputs -------------------------------------------------------------
def test_a_malformed_journal_is_a_one_line_error_naming_it(tmp_path: Path) -> None:
    run = _copy_demo(tmp_path)
    lines = (run / "events.jsonl").read_text().splitlines()
    lines.insert(3, '{"kind": "steps", "steps": [[1, 0.2]')  # torn, and not the last line
    (run / "events.jsonl").write_text("\n".join(lines) + "\n")
    _one_line_error(run, "events.jsonl:4")
    (run / "events.jsonl").write_text('{"kind": "plan", "wall": 1.0}\n{"kind": "state"}\n')
    _one_line_error(run, "events.jsonl", "unexpected content")


def test_a_malformed_summary_is_a_one_line_error_naming_it(tmp_path: Path) -> None:
    run = _copy_demo(tmp_path)
    (run / "summary.json").write_text('{"phases": {"healthy": ')
    _one_line_error(run, "summary.json", "not valid JSON")
    (run / "summary.json").write_text("[1, 2]")
    _one_line_error(run, "summary.json", "expected a JSON object")
    (run / "summary.json").write_text('{"phases": {"healthy": {"steps": [0]}}}')
    _one_line_error(run, "summary.json", "unexpected content")


def test_a_malformed_rank_record_names_its_file(tmp_path: Path) -> None:
    run = _copy_demo(tmp_path)
    (run / "steps-rank1.json").write_text('{"first_step": 0}')
    _one_line_error(run, "steps-rank1.json", "step_end")


def test_a_directory_without_a_run_says_what_was_expected(tmp_path: Path) -> None:
    message = _one_line_error(tmp_path, "not a run directory")
    for expected in ("summary.json", "steps-rank<r>.json", "events.jsonl", "results.json"):
        assert expected in message
    _one_line_error(tmp_path / "missing", "not a directory")


def test_the_cli_writes_the_report_or_prints_one_line(tmp_path: Path, capsys) -> None:
    run = _copy_demo(tmp_path)
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").is_file()
    assert str(run / "report.html") in capsys.readouterr().out
    assert main(["report", str(run), "-o", str(tmp_path / "elsewhere.html")]) == 0
    assert (tmp_path / "elsewhere.html").stat().st_size > 10_000
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run" / "nothing-here")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a directory" in err


# ---- a simulation -----------------------------------------------------------------------------
def test_a_simulation_renders_its_policies_and_actions(tmp_path: Path) -> None:
    from rich.console import Console

    from failslow.sim.report import simulate
    from failslow.sim.scenario import load_scenario

    out = tmp_path / "simulate-greyhound-table6-test"
    results = simulate(load_scenario("greyhound-table6"), None, out, Console(file=io.StringIO()))
    page = _report(out, tmp_path)
    assert page.headings.get("policies") == "Policies"
    assert page.headings.get("actions") == "Actions"
    policies = [a["data-policy"] for a in page.having("tr") if "data-policy" in a]
    assert policies == [r.policy for r in results] and "failslow" in policies
    assert page.having("svg", id="policies-chart") and page.having("svg", id="actions-chart")
    assert "greyhound 7.5" in page.all_text  # the scenario's description, from its name
    assert "S2 micro-batches" in page.all_text


# ---- a failslow run ring directory ------------------------------------------------------------
RING_STEPS, RING_STEP_S, RING_SLOW = 300, 0.1, (100, 200)


def _ring_run(run: Path) -> float:
    """Rings of 4 ranks (3 collectives per iteration); from iteration 100 to 200 the step takes
    twice as long and rank 2 reaches every collective last. Returns the wall time of iteration
    0."""
    from failslow.core.events import GroupInfo, OpCode, group_key
    from failslow.core.group_files import groups_path
    from failslow.core.ring import RingWriter, ring_path

    ops = [("allreduce", 4 << 20), ("allreduce", 1 << 20), ("allgather", 1 << 16)]
    key = group_key("dp", [0, 1, 2, 3])
    t0 = time.monotonic_ns() - int(RING_STEPS * RING_STEP_S * 2e9)
    for rank in range(4):
        writer = RingWriter(ring_path(run, rank, 1000 + rank), capacity=4096, global_rank=rank)
        info = GroupInfo(key=key, ranks=(0, 1, 2, 3), name="dp")
        groups_path(writer.path).write_text(info.to_json() + "\n")
        t = t0
        for i in range(RING_STEPS):
            slow = RING_SLOW[0] <= i < RING_SLOW[1]
            step_ns = int(RING_STEP_S * (2.0 if slow else 1.0) * 1e9)
            for k, (op, nbytes) in enumerate(ops):
                end = t + step_ns * (k + 1) // 3
                start = end - int((0.002 if rank == 2 and slow else 0.02) * 1e9)
                writer.write(t_start_ns=start, t_end_ns=end, nbytes=nbytes, group_key=key,
                             op=OpCode.parse(op))  # fmt: skip
            t += step_ns
        writer.close()
    return (t0 + time.time_ns() - time.monotonic_ns()) / 1e9


def _wall(t0: float, iteration: int) -> float:
    """When ``iteration`` started in :func:`_ring_run`'s rings (slow ones take twice as long)."""
    a, b = RING_SLOW
    slow = min(max(iteration - a, 0), b - a)
    return t0 + RING_STEP_S * (min(iteration, a) + 2 * slow + max(iteration - b, 0))


def test_a_ring_directory_with_journal_and_update_history(tmp_path: Path) -> None:
    from failslow.node.hot_update.history import open_history

    run = tmp_path / "rings"
    t0 = _ring_run(run)
    evidence = {"round": 1, "paused_s": 0.4, "suspects": [], "onsets": []}
    diagnosis = {
        "kind": "compute",
        "slow_ranks": [[2, 3.5]],
        "slow_links": [],
        "evidence": evidence,
    }
    events = [
        {"kind": "onset", "rank": 2, "type": "onset", "iteration": 100, "wall": _wall(t0, 102)},
        {"kind": "state", "state": "profiling", "detail": {}, "wall": _wall(t0, 103)},
        {"kind": "state", "state": "validating", "detail": {"suspects": [{"ranks": [2]}]},
         "wall": _wall(t0, 104)},
        {"kind": "state", "state": "diagnosed", "detail": {"healthy": False, "paused_s": 0.4},
         "wall": _wall(t0, 110)},
        {"kind": "diagnosis", "diagnosis": diagnosis, "wall": _wall(t0, 110)},
        {"kind": "plan", "action": "apply", "strategy": "S2 micro-batches", "apply_step": 115,
         "committed": True, "reason": "impact >= overhead", "detail": "",
         "plan": {"type": "MicroBatchPlan", "counts": [5, 5, 1, 5], "step_time_s": 0.12,
                  "baseline_step_s": 0.3, "overhead_s": 0.5}, "wall": _wall(t0, 112)},
        {"kind": "onset", "rank": 2, "type": "relief", "iteration": 200, "wall": _wall(t0, 203)},
        # slowdowns over before they persisted (issue 47): drawn, never windows or rounds
        {"kind": "transient", "rank": 1, "start": 40, "end": 46, "detected_at": 47,
         "before_s": 0.2, "after_s": 0.5, "wall": _wall(t0, 48)},
        {"kind": "transient", "rank": 3, "start": 150, "end": 153, "detected_at": 154,
         "before_s": 0.2, "after_s": 0.3, "wall": _wall(t0, 155)},
    ]  # fmt: skip
    (run / "diagnoses").mkdir()
    (run / "diagnoses" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    with open_history(run, create=True) as history:
        history.submit(urgency="lazy", env={"LR": "0.1"}, note="lower the learning rate")

    page = _report(run, tmp_path)
    for anchor, heading in SECTIONS.items():
        assert page.headings.get(anchor) == heading
    shown = {int(a["data-rank"]): float(a["data-shown-mean"]) for a in page.having("g")
             if "data-shown-mean" in a}  # fmt: skip
    assert max(shown, key=shown.__getitem__) == 2 and shown[2] > 1.05
    assert len(page.having("rect", data_kind="onset")) == 1  # onset to relief, from the journal
    bars = page.having("rect", **{"class": "transient"})
    assert [b["data-rank"] for b in bars] == ["1", "3"]
    assert "2 transient slowdowns on ranks 1, 3" in page.all_text
    assert "transient on rank 1: iterations 40-46, x2.50" in page.all_text
    assert "transient: over before it persisted" in page.all_text  # the legend
    (mark,) = [a for a in page.having("g", **{"class": "mark"}) if a["data-kind"] == "diagnosis"]
    assert abs(float(mark["data-step"]) - 110) <= 2  # placed by its wall time
    (apply,) = page.having("tr", data_action="apply")
    assert float(apply["data-before"]) == pytest.approx(0.2, rel=0.05)
    assert "LR=0.1" in page.all_text and "pending" in page.all_text
    assert "fail-slow confirmed" in page.all_text


def test_a_corrupt_update_history_names_its_file(tmp_path: Path) -> None:
    run = tmp_path / "rings"
    _ring_run(run)
    (run / "updates.sqlite").write_bytes(b"not a database at all" * 100)
    _one_line_error(run, "updates.sqlite")
