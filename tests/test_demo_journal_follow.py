"""The demo's view of a ``failslow run --controller`` job, read from the launcher's journal
(:mod:`failslow.demo.journal_follow`): the same fields the demo builds from an in-process control
plane, a line still being written read on a later poll."""

from __future__ import annotations

import json
from pathlib import Path

from failslow.core.control.journal import Journal, event
from failslow.demo.journal_follow import JournalFollower
from failslow.demo.mitigation_report import effect_text

S2 = "S2 micro-batches"


def test_the_journal_gives_plans_with_their_effect_and_outcome(tmp_path: Path) -> None:
    path = tmp_path / "diagnoses" / "events.jsonl"
    follower = JournalFollower(path)
    follower.poll()  # no journal yet: nothing, no error
    assert follower.actions == [] and follower.state == "-"

    journal = Journal(path)
    journal(event("state", state="validating", detail={}))
    journal(event("diagnosis", diagnosis={"kind": "compute", "slow_ranks": [[2, 3.4]]}))
    apply = {"type": "microbatch", "counts": [5, 5, 1, 5], "step_time_s": 0.28}
    journal(event("plan", action="apply", strategy=S2, plan=apply, reason="ski rental: buy",
                  epoch=1, apply_step=68, committed=True, detail="committed"))  # fmt: skip
    journal(event("plan", action="apply", strategy="S3 topology", plan={"hosts": [1, 0]},
                  reason="buy", epoch=2, apply_step=None, committed=False,
                  detail="refused by rank 1: no swap here"))  # fmt: skip
    journal(event("unavailable", strategy="S3 topology", reason="no swap here"))
    journal(event("effect", action="apply", strategy=S2, plan=apply, epoch=1, apply_step=68,
                  state="in effect", detail=None))  # fmt: skip
    follower.poll()
    journal(event("outcome", action="apply", strategy=S2, plan=apply, apply_step=68,
                  before_s=0.41, predicted_s=0.28, measured_s=0.26, verdict="pays",
                  reason="measured 0.260 s"))  # fmt: skip
    journal(event("drift", action="apply", strategy=S2, plan=apply, apply_step=68,
                  before_s=0.41, predicted_s=0.28, measured_s=0.40, verdict="stopped paying",
                  reason="measured 0.400 s", then="revert", then_reason="did not pay"))  # fmt: skip
    journal.close()
    line = json.dumps(event("plan", action="revert", strategy=S2, epoch=3)) + "\n"
    with path.open("a") as f:  # the launcher is writing its next line
        f.write(line[:20])
    follower.poll()

    assert follower.state == "validating"
    assert [json.loads(d)["slow_ranks"] for d in follower.diagnoses] == [[[2, 3.4]]]
    assert follower.unavailable == {"S3 topology": "no swap here"}
    first, refused = follower.actions
    assert first["counts"] == [5, 5, 1, 5] and first["apply_step"] == 68 and first["committed"]
    assert first["reason"] == "ski rental: buy" and first["effect"] == "in effect"
    assert first["outcome"]["verdict"] == "pays" and first["outcome"]["measured_s"] == 0.26
    # watched after its verdict: it stopped paying later, and what was done is said beside it
    assert first["drift"] == {"measured_s": 0.40, "reason": "measured 0.400 s", "then": "revert"}
    assert effect_text(first) == (
        ", in effect; measured 0.260 s vs 0.280 s predicted (pays); later stopped paying "
        "(0.400 s): revert"
    )
    # an uncommitted plan says why it was not (the dispatch's reason), as the demo's view does
    assert not refused["committed"] and refused["reason"] == "refused by rank 1: no swap here"
    assert refused["effect"] is None and refused["outcome"] is None

    with path.open("a") as f:  # the rest of the line arrives
        f.write(line[20:])
    follower.poll()
    assert [a["action"] for a in follower.actions] == ["apply", "apply", "revert"]
