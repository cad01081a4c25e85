"""``failslow update submit|list|rollback|cancel`` against a running launcher, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launcher import Launcher, clean_env, failslow

from failslow.node.hot_update.history import open_history

pytestmark = pytest.mark.timeout(90)


def test_submit_list_rollback_round_trip(launcher: Launcher) -> None:
    launcher.start(JOB_VERSION="1")
    launcher.starts(1)
    state = str(launcher.state_dir)
    out = failslow(
        "update", "submit", "--state-dir", state, "--urgent", "--env", "JOB_VERSION=3",
        "--note", "new lr",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("update 1 (urgent) pending: JOB_VERSION=3")
    assert launcher.starts(2)[1]["version"] == "3"

    rows = json.loads(failslow("update", "list", "--state-dir", state, "--json").stdout)
    assert [(r["id"], r["outcome"], r["note"]) for r in rows] == [(1, "probation", "new lr")]
    assert rows[0]["version"]["env"] == {"JOB_VERSION": "3"}

    out = failslow("update", "rollback", "--state-dir", state)  # the last applied: #1
    assert out.returncode == 0, out.stderr
    assert "roll back #1" in out.stdout
    assert launcher.starts(3)[2]["version"] == "1"

    # inside the job, FAILSLOW_STATE_DIR finds the history without --state-dir
    table = failslow("update", "list", env=clean_env(FAILSLOW_STATE_DIR=state, COLUMNS="200"))
    assert table.returncode == 0, table.stderr
    assert "rolled_back" in table.stdout and "roll back #1" in table.stdout
    rows = json.loads(failslow("update", "list", "--state-dir", state, "--json").stdout)
    assert [r["outcome"] for r in rows] == ["rolled_back", "probation"]
    assert rows[0]["detail"] == "rolled back by #2"

    out = failslow("update", "submit", "--state-dir", state, "--env", "X=1")  # lazy
    assert out.returncode == 0 and "(lazy)" in out.stdout
    assert failslow("update", "cancel", "--state-dir", state, "3").returncode == 0
    assert launcher.finish()[0] == 0
    with open_history(state) as history:
        assert [u.outcome for u in history.updates()] == ["rolled_back", "applied", "cancelled"]


@pytest.fixture
def state(tmp_path: Path) -> str:
    with open_history(tmp_path / "state", create=True) as history:
        history.submit(urgency="lazy", env={"A": "1"})
    return str(tmp_path / "state")


BAD = [
    (("list", "--state-dir", "{tmp}/nowhere"), "no update history at"),
    (("submit", "--state-dir", "{state}"), "must change something"),
    (("submit", "--state-dir", "{state}", "--env", "FOO"), "expected NAME=VALUE"),
    (("submit", "--state-dir", "{state}", "--code-dir", "{tmp}/nowhere"), "not a directory"),
    (("submit", "--state-dir", "{state}", "--command", "'unclosed"), "--command"),
    (("submit", "--state-dir", "{state}", "--urgent", "--env", "A=1", "--window", "5"), "lazy"),
    (("rollback", "--state-dir", "{state}", "99"), "no update 99"),
    (("rollback", "--state-dir", "{state}"), "nothing to roll back"),
    (("rollback", "--state-dir", "{state}", "1"), "is pending, not applied"),
    (("cancel", "--state-dir", "{state}", "7"), "no update 7"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_line(
    args: tuple[str, ...], message: str, state: str, tmp_path: Path
) -> None:
    out = failslow("update", *(a.format(state=state, tmp=tmp_path) for a in args))
    assert out.returncode == 2, out
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("failslow update: ") and message in out.stderr, out.stderr


@pytest.mark.parametrize(
    "option", [("--max-restarts", "-1"), ("--probation", "-5"), ("--code-dir", "/nonexistent")]
)
def test_bad_run_options_are_one_line(option: tuple[str, str], tmp_path: Path) -> None:
    out = failslow("run", "--no-shim", "--ring-dir", str(tmp_path), *option, "--", "true")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("failslow run: ") and option[0] in out.stderr


def test_an_update_submitted_to_another_node_than_0_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """Every node of a several-node job relaunches at node 0's version: an update submitted to
    node 1's launcher would be ignored there, so it is refused, naming where it goes."""
    with open_history(tmp_path, create=True) as history:
        history.set_job("node", {"node_rank": 1, "nnodes": 2})
    out = failslow("update", "submit", "--state-dir", str(tmp_path), "--urgent", "--env", "X=1")
    assert out.returncode != 0
    assert "node 1 of 2: submit updates to node 0's launcher" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    with open_history(tmp_path) as history:
        assert history.updates() == []
