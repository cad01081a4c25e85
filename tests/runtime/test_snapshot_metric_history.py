"""The metric history a snapshot carries (failslow.runtime.snapshot_service.METRICS): a history
that grows by a value per step must not change the snapshot's structure, or every snapshot of
a job's first window of steps plans a new layout (measured on the DeepSpeed demo job: 32 of its
first 40 snapshots); and a restart in place takes the history up again, NaN included."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from failslow import hookimpl
from failslow.capabilities import SUPPORTED, Capabilities
from failslow.core.checkpoint import snapshot as snapshot_module
from failslow.core.checkpoint.config import CheckpointConfig
from failslow.core.topology import Topology
from failslow.plugins import plugin_manager
from failslow.runtime.snapshot_service import SnapshotService


class _Job:
    def __init__(self) -> None:
        self.w = torch.zeros(4)
        self.restored: int | None = None

    @hookimpl
    def failslow_snapshot_state(self, step: int) -> Any:
        return {"w": self.w, "step": step}

    @hookimpl
    def failslow_restore_state(self, state: Any, step: int) -> bool:
        self.w.copy_(state["w"])
        self.restored = step
        return True


def _service(directory: Path, job: _Job, history: dict[str, list[float]], taken: list) -> Any:
    topology = Topology(tp=1, dp=1, pp=1, coords=((0, 0, 0),), hosts=("h",), micro_batches=1)
    return SnapshotService(
        CheckpointConfig(every_steps=1, directory=str(directory), backup=False),
        plugin_manager([job], autoload=False).hook, rank=0, world_size=1,
        topology=lambda: topology,
        capabilities=lambda: Capabilities(
            microbatch_plans="n/a", topology_plans="n/a", snapshots=SUPPORTED, hot_update="n/a"
        ),
        wait_timeout_s=30,
        metrics=(lambda: {k: list(v) for k, v in history.items()}, taken.append),
    )  # fmt: skip


def test_a_growing_metric_history_keeps_the_snapshot_layout_and_is_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = []
    plan = snapshot_module._LayoutCache.plan.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, state: Any) -> Any:
        plans.append(state)
        return plan(cls, state)

    monkeypatch.setattr(snapshot_module._LayoutCache, "plan", classmethod(counting))
    history: dict[str, list[float]] = {"loss": []}
    job = _Job()
    service = _service(tmp_path, job, history, []).start()
    for step in range(12):
        history["loss"].append(1.0 / (step + 1))
        job.w += 1
        service.snapshot(step)
        service.before_optimizer_step()
    history["loss"].append(math.nan)  # a NaN loss is what the history is kept for
    service.commit(12)
    service.close()
    assert len(plans) == 1, f"{len(plans)} layouts planned for 13 snapshots of one structure"

    taken: list[dict[str, list[float]]] = []
    again = _Job()
    restarted = _service(tmp_path, again, {"loss": []}, taken).start()
    try:
        assert again.restored == 12 and torch.equal(again.w, job.w)
        (resumed,) = taken
        assert resumed["loss"][:12] == [1.0 / (s + 1) for s in range(12)]
        assert math.isnan(resumed["loss"][12]) and len(resumed["loss"]) == 13
    finally:
        restarted.close()
