"""TensorBoard and W&B notifiers: built-in plugins turned on by config, never breaking training.

The hooks are called through a real plugin manager, as a rank's session and the control plane
call them; what TensorBoard received is read back from its event files with tensorboard's own
reader. W&B is not a test dependency: its test is the missing backend (one warning, training
goes on), plus a real offline run where ``wandb`` happens to be installed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from failslow.config import load_config
from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner.plans import MicroBatchPlan
from failslow.plugins import plugin_manager

DIAGNOSIS = Diagnosis(
    kind=Kind.BOTH, slow_ranks=(SlowRank(2, 3.5),), slow_links=(SlowLink(0, 1, 4.0),)
)
PLAN = MicroBatchPlan(counts=(5, 5, 2, 4), weights=(1.25, 1.25, 0.5, 1.0), step_time_s=0.3)


def _events(directory: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_gets_rank0_steps_and_the_controllers_decisions(tmp_path: Path) -> None:
    config = load_config({"observe": {"tensorboard_dir": str(tmp_path)}}, environ={})
    pm = plugin_manager(autoload=False)
    # a rank's session: rank 0 writes, rank 1 (another process in a real job) does not
    pm.hook.failslow_session_start(config=config, rank=0, world_size=2)
    for step in range(5):
        pm.hook.failslow_on_step(step=step, step_time_s=0.1 * (step + 1))
    pm.hook.failslow_session_end(rank=0)
    pm.hook.failslow_session_start(config=config, rank=1, world_size=2)
    pm.hook.failslow_on_step(step=0, step_time_s=9.0)
    pm.hook.failslow_session_end(rank=1)
    # the control plane's process
    pm.hook.failslow_control_start(config=config, world_size=2)
    pm.hook.failslow_on_diagnosis(diagnosis=DIAGNOSIS)
    pm.hook.failslow_on_plan(plan=PLAN, action="apply", reason="break-even")
    pm.hook.failslow_on_plan_result(plan=PLAN, step=40, outcome="committed", detail="")
    pm.hook.failslow_control_end()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["failslow-controller", "failslow-rank0"]
    rank0 = _events(tmp_path / "failslow-rank0")
    steps = [(e.step, round(e.value, 6)) for e in rank0.Scalars("failslow/step_time_s")]
    assert steps == [(s, round(0.1 * (s + 1), 6)) for s in range(5)]
    ctl = _events(tmp_path / "failslow-controller")
    assert [e.value for e in ctl.Scalars("failslow/slowdown/rank2")] == [3.5]
    assert [e.value for e in ctl.Scalars("failslow/slowdown/link0-1")] == [4.0]
    texts = {tag: [t.tensor_proto.string_val[0].decode() for t in ctl.Tensors(tag)]
             for tag in ctl.Tags()["tensors"]}  # fmt: skip
    assert any('"kind": "both"' in t for t in texts["failslow/diagnoses/text_summary"])
    plans = texts["failslow/plans/text_summary"]
    assert plans[0].startswith("apply MicroBatchPlan counts [5, 5, 2, 4], estimated step 0.300 s")
    assert plans[1] == "MicroBatchPlan committed from step 40 "


def test_a_failing_backend_warns_once_and_training_goes_on(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the log directory should be")
    config = load_config({"observe": {"tensorboard_dir": str(blocker)}}, environ={})
    pm = plugin_manager(autoload=False)
    with caplog.at_level(logging.WARNING, logger="failslow"):
        pm.hook.failslow_session_start(config=config, rank=0, world_size=1)
        for step in range(3):
            pm.hook.failslow_on_step(step=step, step_time_s=0.1)
        pm.hook.failslow_session_end(rank=0)
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard notifier" in r.getMessage()]
    assert len(warnings) == 1 and "off for this process" in warnings[0], warnings


def test_wandb_missing_is_one_warning_not_an_error(caplog) -> None:
    try:
        import wandb  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("wandb is installed here: the missing-backend case cannot be shown")
    config = load_config(
        {"observe": {"wandb_project": "failslow-test", "wandb_mode": "offline"}}, environ={}
    )
    pm = plugin_manager(autoload=False)
    with caplog.at_level(logging.WARNING, logger="failslow"):
        pm.hook.failslow_control_start(config=config, world_size=2)
        pm.hook.failslow_on_diagnosis(diagnosis=DIAGNOSIS)
        pm.hook.failslow_control_end()
        pm.hook.failslow_session_start(config=config, rank=0, world_size=2)
        pm.hook.failslow_on_step(step=0, step_time_s=0.1)
        pm.hook.failslow_session_end(rank=0)
    warnings = [r.getMessage() for r in caplog.records if "W&B notifier" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one per process role that tried to start it
    assert all("ModuleNotFoundError" in w and "wandb" in w for w in warnings), warnings


def test_notifiers_stay_off_without_their_setting(tmp_path: Path, monkeypatch) -> None:
    from failslow.builtin import tensorboard_notifier, wandb_notifier

    monkeypatch.chdir(tmp_path)
    pm = plugin_manager(autoload=False)
    pm.hook.failslow_session_start(config=load_config({}, environ={}), rank=0, world_size=1)
    assert tensorboard_notifier.NOTIFIER.sink is None and wandb_notifier.NOTIFIER.sink is None
    pm.hook.failslow_on_step(step=0, step_time_s=0.1)
    pm.hook.failslow_session_end(rank=0)
    assert list(tmp_path.iterdir()) == []
