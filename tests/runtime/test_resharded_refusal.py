"""A job whose adapter cannot go on in a smaller world ends with one clear line instead of
crashing every rank (which the launcher would take for deaths and shrink the job on, again and
again): failslow.runtime.snapshot_service.SnapshotService.resume_resharded.

A one-rank gloo world resumes a two-rank world's step from the node memory it kept (old rank
0's snapshot and the backup it held for rank 1), and the adapter refuses it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from failslow import hookimpl
from failslow.capabilities import SUPPORTED, Capabilities
from failslow.core.checkpoint.backup import backup_path
from failslow.core.checkpoint.config import CheckpointConfig
from failslow.core.checkpoint.restore import RestoreError, local_snapshot_paths
from failslow.core.checkpoint.snapshot import Snapshotter
from failslow.core.topology import Topology
from failslow.errors import ConfigError
from failslow.plugins import plugin_manager
from failslow.runtime.snapshot_service import SnapshotService


class _Refusing:
    @hookimpl
    def failslow_restore_resharded(self, states, step, old_rank):
        assert [s["w"].item() for s in states] == [0.0, 1.0] and old_rank == 0
        raise ConfigError("this framework's pipeline engine is not re-cut")


@pytest.fixture
def one_rank_world(tmp_path: Path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_an_adapter_that_cannot_go_on_ends_the_restore_with_one_line(
    tmp_path: Path, one_rank_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = tmp_path / "old-node0"  # the node memory new rank 0 kept from the two-rank world
    for rank in (0, 1):
        with Snapshotter(tmp_path / f"rank{rank}", rank=rank, slots=3) as snapshots:
            snapshots.start({"w": torch.tensor(float(rank))}, 5)
            assert snapshots.wait_sealed(timeout_s=30) == 5
    old.mkdir()
    for path in local_snapshot_paths(tmp_path / "rank0", 0):
        shutil.copy(path, old / path.name)
    [held] = local_snapshot_paths(tmp_path / "rank1", 1)[:1]
    shutil.copy(held, backup_path(old, 1, 0))  # a holder's copy is the sealed snapshot
    (old / "placement.json").write_text(json.dumps([1, 0]))
    monkeypatch.setenv("FAILSLOW_RESHARD_FROM", json.dumps([{"directory": str(old), "rank": 0}]))
    monkeypatch.delenv("FAILSLOW_SLOT", raising=False)  # not under the launcher: raises
    pm = plugin_manager([_Refusing()], autoload=False)
    topology = Topology(tp=1, dp=1, pp=1, coords=((0, 0, 0),), hosts=("h",), micro_batches=1)
    service = SnapshotService(
        CheckpointConfig(every_steps=1, directory=str(tmp_path / "world1"), backup=False),
        pm.hook, rank=0, world_size=1, topology=lambda: topology,
        capabilities=lambda: Capabilities(
            microbatch_plans="n/a", topology_plans="n/a", snapshots=SUPPORTED, hot_update="n/a"
        ), wait_timeout_s=30,
    )  # fmt: skip
    with pytest.raises(RestoreError) as caught:
        service.start()
    message = str(caught.value)
    assert "this job cannot go on with 1 ranks: this framework's pipeline engine is not re-cut" in (
        message
    )
    assert "\n" not in message
