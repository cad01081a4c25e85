"""In-memory snapshots of one rank: every N steps, backed up on a peer, resumed at start.

byterobust 6.3 checkpoints every step in memory and keeps a backup of each rank's state on a
peer outside the rank's parallel groups, so a restart after a hot update or an eviction needs no
remote storage. This is the rank runtime's side of it, over :mod:`failslow.core.checkpoint`:

- :meth:`SnapshotService.start` requires the adapter's ``snapshots`` capability, resumes from
  the newest step every rank can restore (its own node's snapshot, or the backup its holder
  keeps), then backs every sealed snapshot up on its holder;
- :meth:`SnapshotService.snapshot` takes the adapter's state by reference
  (``failslow_snapshot_state``) and copies it on a background thread; only the optimizer step
  waits for the copy (:meth:`SnapshotService.before_optimizer_step`);
- :meth:`SnapshotService.commit` seals one step's snapshot on every rank (a hot update's stop).

Three slots and waiting when busy: every rank keeps the same steps, so restore agrees.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from failslow import envvars
from failslow.capabilities import Capabilities, Unsupported
from failslow.core.checkpoint.config import CheckpointConfig
from failslow.core.topology import Topology
from failslow.runtime.agreement import agree, distributed

log = logging.getLogger(__name__)


class SnapshotService:
    def __init__(
        self,
        config: CheckpointConfig,
        hooks: Any,
        *,
        rank: int,
        world_size: int,
        topology: Callable[[], Topology],
        capabilities: Callable[[], Capabilities],
        wait_timeout_s: float,
    ) -> None:
        self.config = config
        self.hooks = hooks
        self.rank = rank
        self.world_size = world_size
        self._topology = topology
        self._capabilities = capabilities
        self.wait_timeout_s = wait_timeout_s
        self.snapshots: Any = None
        """The rank's :class:`~failslow.core.checkpoint.snapshot.Snapshotter` once started."""
        self.backup: Any = None
        self._holders: tuple[int, ...] | None = None
        self.directory: Path | None = None
        self.last_snapshot: int | None = None
        self.resumed_step: int | None = None
        """The step this process resumed at (None: a fresh start)."""

    def start(self) -> SnapshotService:
        from failslow.core.checkpoint.snapshot import Snapshotter

        self._capabilities().require("snapshots")
        cfg = self.config
        directory = cfg.directory or os.environ.get(envvars.SNAPSHOT_DIR)
        self.directory = Path(directory) if directory else None
        # three slots and waiting when busy: every rank keeps the same steps (restore agrees)
        self.snapshots = Snapshotter(self.directory, rank=self.rank, slots=3, on_busy="wait")
        if self.directory is not None:
            self.resume()
        if cfg.backup and self.world_size > 1:
            if self.directory is None:
                log.warning("failslow: no snapshot directory, so no backups on peers")
                return self
            from failslow.core.checkpoint.backup import BackupService

            after = self.resumed_step if self.resumed_step is not None else -1
            self.backup = BackupService(
                self.snapshots,
                self._placement(),
                self.rank,
                self.directory,
                every=cfg.every_steps,
                after_step=after,
            )
        return self

    def due(self, step: int) -> bool:
        every = self.config.every_steps
        return bool(every) and step % every == 0

    def _placement(self) -> tuple[int, ...]:
        """Backup holders: the placement recorded by an earlier run of this job (restore must
        find the backups where they were made), else a new one for the current topology."""
        import torch.distributed as dist

        from failslow.core.checkpoint.placement import backup_holders

        if self._holders is not None:
            return self._holders
        assert self.directory is not None
        path = self.directory / "placement.json"
        try:
            mine = json.loads(path.read_text())
        except (OSError, ValueError):
            mine = None
        if not isinstance(mine, list) or len(mine) != self.world_size:
            mine = None
        found = [mine]
        if distributed(self.world_size):
            import torch

            first = torch.tensor([self.rank if mine is not None else self.world_size])
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
            if int(first) < self.world_size:
                dist.broadcast_object_list(found, src=int(first))
        holders = tuple(found[0]) if found[0] is not None else backup_holders(self._topology())
        tmp = path.with_name(f"{path.name}.{self.rank}.tmp")  # ranks of a node share the file
        tmp.write_text(json.dumps(list(holders)))
        tmp.replace(path)
        self._holders = holders
        return holders

    def resume(self) -> int | None:
        """Restore the newest snapshot step every rank can obtain (its own node's snapshot, or
        the backup its holder keeps); returns the step (None: nothing to resume, fresh start)."""
        from failslow.core.checkpoint import restore

        assert self.directory is not None
        anything = int(restore.has_committed(self.directory, self.rank))
        if agree(anything, self.world_size)[1] == 0:
            return None  # a fresh job: no rank has a snapshot or a backup
        if distributed(self.world_size):
            try:
                found = restore.restore(
                    rank=self.rank, holders=self._placement(), directory=self.directory
                )
            except restore.RestoreError as exc:
                message = (
                    f"failslow: cannot resume from the snapshots in {self.directory}: {exc} "
                    "(remove the directory to start the job afresh)"
                )
                if os.environ.get(envvars.SLOT):  # under failslow's rank launcher
                    _unrestorable(message)
                raise restore.RestoreError(message) from None
            step, state, source = found.step, found.state(), found.source
        else:
            loaded = self.snapshots.load()
            if loaded is None:
                return None
            step, state = loaded
            source = "local"
        if not self.hooks.failslow_restore_state(state=state, step=step):
            raise Unsupported("snapshots", "no plugin restored the snapshot")
        self.resumed_step = step
        where = "its holder's backup" if source == "backup" else "its own snapshot"
        log.warning("failslow: rank %d resumed from %s of step %d", self.rank, where, step)
        return step

    def snapshot(self, step: int) -> None:
        """Start this step's snapshot (the copy runs beside the step's forward/backward)."""
        state = self.hooks.failslow_snapshot_state(step=step)
        if state is None:
            raise Unsupported("snapshots", "no plugin returned the training state")
        self.snapshots.start(state, step)
        self.last_snapshot = step

    def before_optimizer_step(self) -> None:
        """The pending snapshot's copy must be complete before the optimizer mutates the
        state (byterobust 6.3)."""
        if self.snapshots is not None:
            self.snapshots.wait_consistent()

    def commit(self, step: int) -> None:
        """Snapshot ``step`` and wait until it is sealed (a hot update stops after this)."""
        self.snapshot(step)
        self.snapshots.wait_consistent()
        sealed = self.snapshots.wait_sealed(timeout_s=self.wait_timeout_s)
        if sealed != step:
            raise RuntimeError(f"failslow: snapshot of step {step} not sealed for the update")

    def close(self) -> None:
        """Seal the last snapshot, finish its backup (the same last step on every rank) and
        stop the background threads."""
        if self.snapshots is None:
            return
        self.snapshots.wait_sealed(timeout_s=self.wait_timeout_s)
        if self.backup is not None:
            self.backup.close(last_step=self.last_snapshot, timeout_s=self.wait_timeout_s)
            self.backup = None
        self.snapshots.close()
        self.snapshots = None


def _unrestorable(message: str) -> None:
    """End this rank with :data:`EXIT_UNRESTORABLE`: every rank failed the same collective
    restore, and the node launcher must stop the job rather than restart it again."""
    import sys

    from failslow.core.control.stop import EXIT_UNRESTORABLE

    log.error("%s", message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_UNRESTORABLE)  # no teardown: gloo threads may wait for peers in the same state
