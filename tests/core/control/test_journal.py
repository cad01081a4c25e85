"""The control plane's journal and status record (:mod:`failslow.core.control.journal`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from failslow.core.control import keys
from failslow.core.control.journal import Journal, StatusBoard, event, read_journal
from failslow.core.control.store import open_store
from failslow.errors import FailslowError


def test_journal_appends_one_line_per_event_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "log" / "events.jsonl"
    journal = Journal(path)
    journal(event("state", state="profiling", detail={"onsets": [{"rank": 1}]}))
    journal(event("steps", steps=[[3, 0.5]]))
    journal.close()
    journal(event("steps", steps=[[4, 0.5]]))  # after close: dropped, no error
    got = read_journal(path)
    assert [e["kind"] for e in got] == ["state", "steps"]
    assert got[0]["detail"] == {"onsets": [{"rank": 1}]} and got[0]["wall"] > 0


def test_a_torn_last_line_is_skipped_any_other_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    good = json.dumps(event("steps", steps=[[1, 0.1]]))
    path.write_text(good + "\n" + '{"kind": "st')
    assert len(read_journal(path)) == 1
    path.write_text('{"kind": "st\n' + good + "\n")
    with pytest.raises(FailslowError, match=r"events.jsonl:1: not a JSON event"):
        read_journal(path)
    path.write_text('{"no_kind": 1}\n')
    with pytest.raises(FailslowError, match=r"events.jsonl:1: an event needs a 'kind'"):
        read_journal(path)


def test_status_board_keeps_one_record_in_the_store() -> None:
    with open_store("tcp://127.0.0.1:0?master=1") as store:
        board = StatusBoard(store, world_size=4)
        board(event("state", state="validating", detail={}))
        found = {"kind": "compute", "slow_ranks": [[2, 3.0]], "slow_links": [], "evidence": {}}
        board(event("diagnosis", diagnosis=found))
        plan = {"type": "MicroBatchPlan", "counts": [4, 4, 2, 6]}
        board(event("plan", action="apply", strategy="S2", reason="pays", apply_step=40,
                    committed=True, detail="", in_effect=plan, plan=plan))  # fmt: skip
        board(event("steps", steps=[[41, 0.3], [42, 0.25]]))
        board(event("onset", type="onset", rank=1))  # not part of the status: no write
        status = store.get_json(keys.STATUS)
    assert status["world_size"] == 4 and status["state"] == "validating"
    assert status["diagnoses"] == 1 and status["last_diagnosis"]["slow_ranks"] == [[2, 3.0]]
    assert "evidence" not in status["last_diagnosis"]  # the journal keeps it; the key stays small
    assert status["in_effect"] == plan and status["last_action"]["apply_step"] == 40
    assert (status["step"], status["step_s"]) == (42, 0.25)
