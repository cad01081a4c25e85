"""``failslow.report_metrics`` inside one process: the check reaches the user's call, and
without a way to roll back an incident stops the script in one line (failslow.runtime.metric_watch).
The rollback itself - a request, exit 79, every rank relaunched from memory - runs for real in
tests/e2e/test_failstop.py and, at the launcher, tests/node/hot_update/test_agent.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import failslow
from failslow import MetricIncidentError
from failslow.runtime import metric_watch
from failslow.runtime.session import Session, current


@pytest.fixture(autouse=True)
def _fresh_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metric_watch, "_default", None)
    for name in ("FAILSLOW_STATE_DIR", "FAILSLOW__CHECKS__JUMP"):
        monkeypatch.delenv(name, raising=False)


def test_without_a_session_a_nan_loss_stops_the_script_in_one_line() -> None:
    failslow.report_metrics(0, loss=1.0, lr=1e-3, note="warmup")  # not watched: not checked
    with pytest.raises(MetricIncidentError) as info:
        failslow.report_metrics(1, **{"train/loss": math.nan, "lr": 1e-3})
    text = str(info.value)
    assert "train/loss is nan at step 1" in text and "failslow run" in text and "\n" not in text


def test_tensors_and_numpy_scalars_are_read_and_a_bad_value_is_named() -> None:
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    failslow.report_metrics(0, loss=torch.tensor(2.0), grad_norm=np.float32(0.5))
    with pytest.raises(failslow.errors.FailslowError, match="'loss' must be a number, got str"):
        failslow.report_metrics(1, loss="2.0x")
    with pytest.raises(MetricIncidentError, match="grad_norm is inf at step 2"):
        failslow.report_metrics(2, grad_norm=torch.tensor(math.inf))


def test_the_jump_rule_follows_the_checks_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAILSLOW__CHECKS__JUMP", "2")
    for step in range(8):
        failslow.report_metrics(step, loss=1.0)
    with pytest.raises(MetricIncidentError, match=r"2\.5x its recent level"):
        failslow.report_metrics(8, loss=2.5)


def test_a_session_checks_with_its_own_settings_and_without_snapshots_cannot_roll_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAILSLOW_STATE_DIR", str(tmp_path))  # under failslow run, say
    session = Session({"capture": False, "checks": {"jump": 3, "warmup": 2}}, source="test")
    session.start()
    try:
        assert current() is session
        for step in range(2):
            failslow.report_metrics(step, loss=1.0)
        with pytest.raises(MetricIncidentError, match=r"3\.0x its recent level"):
            failslow.report_metrics(2, loss=3.0)
        assert not (tmp_path / "rollback-requests").exists()  # nothing could resume it
    finally:
        session.close()
    assert current() is None


def test_a_rank_that_can_roll_back_leaves_its_request_and_exits_79(tmp_path: Path) -> None:
    """In a process of its own (it ends with ``os._exit``): a session whose snapshots live in
    node memory under ``failslow run`` (the state and snapshot directories set)."""
    script = textwrap.dedent(
        """
        import math, failslow
        from failslow.runtime.session import Session

        class State:
            @failslow.hookimpl
            def failslow_report_topology(self):
                from failslow.core.topology import Topology
                return Topology.megatron(tp=1, dp=1, pp=1, gpus_per_host=1, micro_batches=1)

            @failslow.hookimpl
            def failslow_capabilities(self):
                from failslow.capabilities import Capabilities
                return Capabilities(microbatch_plans="x", topology_plans="x", snapshots="",
                                    hot_update="x")

            @failslow.hookimpl
            def failslow_snapshot_state(self, step):
                return {"step": step}

            @failslow.hookimpl
            def failslow_restore_state(self, state, step):
                assert state == {"step": step}
                return True

        import os, sys
        if os.environ.get("FAILSLOW_ROLLBACK_BEFORE"):  # the relaunch
            try:
                session = Session({"capture": False, "checkpoint": {"every_steps": 1}},
                                  source="test", plugins=[State()]).start()
            except Exception as exc:
                print(f"error: {exc}")
                sys.exit(1)
            print(f"resumed {session.resumed_step}")
            sys.exit(0)
        session = Session({"capture": False, "checkpoint": {"every_steps": 1}}, source="test",
                          plugins=[State()]).start()
        for step in range(3):
            session.step_boundary(step)
            failslow.report_metrics(step, loss=1.0)
        session.step_boundary(3)
        failslow.report_metrics(3, loss=math.nan)
        print("not reached")
        """
    )
    env = {
        "FAILSLOW_STATE_DIR": str(tmp_path / "state"),
        "FAILSLOW_SNAPSHOT_DIR": str(tmp_path / "snapshots"),
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 79, done.stderr
    assert "not reached" not in done.stdout
    assert "loss is nan at step 3 - asking the launcher to roll back before step 3" in done.stderr
    [request] = (tmp_path / "state" / "rollback-requests").glob("rank*.json")
    record = json.loads(request.read_text())
    assert (record["rank"], record["step"], record["metric"], record["kind"]) == (
        0, 3, "loss", "nan",
    )  # fmt: skip

    # the relaunch: snapshot 3 (taken before the NaN was seen) is forgotten, 2 is resumed;
    # rolling back before the oldest snapshot kept is an error, never a fresh start
    relaunches = (("3", "resumed 2"), ("3", "resumed 2"), ("1", "no snapshot before step 1"))
    for before, said in relaunches:
        again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               env={**env, "FAILSLOW_ROLLBACK_BEFORE": before}, timeout=120)
        assert said in again.stdout, again.stdout + again.stderr
