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
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from failslow import envvars
from failslow.capabilities import Capabilities, Unsupported
from failslow.core.checkpoint.config import CheckpointConfig
from failslow.core.topology import Topology
from failslow.errors import ConfigError, FailslowError
from failslow.runtime.agreement import agree, distributed

log = logging.getLogger(__name__)

PROFILE = "failslow_step_profile"
"""The key of the rank's step profile in its snapshots (removed before an adapter sees them)."""
METRICS = "failslow_metric_history"
"""The key of the rank's recent training metrics in its snapshots (``failslow.report_metrics``;
removed before an adapter sees them): a resumed rank checks against the level the job had.
Kept as one JSON string: a history that grows by a value per step (up to the check's window)
would change the snapshot's structure every step, and every change of structure costs the
snapshot a new layout (:class:`~failslow.core.checkpoint.snapshot.Snapshotter`) - the
DeepSpeed demo job re-planned 32 snapshots out of its first 40 steps; a string is a value."""


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
        profile: Callable[[], dict[str, Any] | None] | None = None,
        metrics: tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]
        | None = None,
    ) -> None:
        self._metrics = metrics
        """The metric check's history: how to read it for a snapshot, and how to take up a
        resumed one."""
        self._profile = profile
        """The rank's step profile, kept in each snapshot: a smaller world that resumes it
        estimates its own step from the old world's (odyssey Eq. 12-13)."""
        self._resumed_profile: dict[str, Any] | None = None
        """The step profile of the snapshot this world resumed, kept in its snapshots until
        this launch measured its own: a rank lost right after a restart in place (a
        reattempt, an eviction by the stop-time ladder) leaves notes that still say what a
        step of this layout costs, for odyssey's choice."""
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
        self.resized: dict[str, Any] | None = None
        """When this process resumed a larger world's step: ``{"step", "old_world", "world",
        "counts"}`` and, from the old ranks' step profiles, ``"before_s"`` / ``"estimated_s"``
        (the old step and this world's, as the model expects them)."""

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

        from failslow.core.checkpoint.placement import backup_holders

        if self._holders is not None:
            return self._holders
        assert self.directory is not None
        path = self.directory / "placement.json"
        found = self._shared_placement(self.directory, self.world_size)
        holders = found if found is not None else backup_holders(self._topology())
        tmp = path.with_name(f"{path.name}.{self.rank}.tmp")  # ranks of a node share the file
        tmp.write_text(json.dumps(list(holders)))
        tmp.replace(path)
        self._holders = holders
        return holders

    def resume(self) -> int | None:
        """Restore the newest snapshot step every rank can obtain (its own node's snapshot, or
        the backup its holder keeps); returns the step (None: nothing to resume, fresh start).
        A job that goes on with fewer ranks (``$FAILSLOW_RESHARD_FROM``) gathers the old
        world's states when its own world has none to restore (:meth:`resume_resharded`)."""
        from failslow.core.checkpoint import restore

        assert self.directory is not None
        sources = reshard_sources()
        before = rollback_before()
        if before is not None:
            self._forget_from(before)
        anything = int(restore.has_committed(self.directory, self.rank))
        if agree(anything, self.world_size)[1] == 0:
            # a fresh job (no rank has a snapshot or a backup), or a smaller world's first start
            if sources:
                return self.resume_resharded(sources, before)
            if before is not None:  # never a silent start from scratch
                self._cannot_resume(f"no snapshot before step {before} to roll back to")
            return None
        if distributed(self.world_size):
            try:
                found = restore.restore(
                    rank=self.rank, holders=self._placement(), directory=self.directory
                )
            except restore.RestoreError as exc:
                if sources:  # the smaller world's snapshots are not complete yet
                    log.warning("failslow: %s; gathering a larger world's states instead", exc)
                    return self.resume_resharded(sources, before)
                self._cannot_resume(exc)
            step, state, source_kind = found.step, found.state(), found.source
        else:
            loaded = self.snapshots.load()
            if loaded is None:
                return None
            step, state = loaded
            source_kind = "local"
        if isinstance(state, dict):
            resumed_profile = state.pop(PROFILE, None)
            if isinstance(resumed_profile, dict):
                self._resumed_profile = resumed_profile
            self._resume_metrics(state.pop(METRICS, None))
        if not self.hooks.failslow_restore_state(state=state, step=step):
            raise Unsupported("snapshots", "no plugin restored the snapshot")
        self.resumed_step = step
        where = "its holder's backup" if source_kind == "backup" else "its own snapshot"
        why = "" if before is None else f" (rolled back: step {before} or later may be bad)"
        log.warning("failslow: rank %d resumed from %s of step %d%s", self.rank, where, step, why)
        return step

    def _resume_metrics(self, history: Any) -> None:
        if isinstance(history, str | bytes):
            try:
                history = json.loads(history)
            except ValueError:
                log.warning("failslow: the snapshot's metric history does not parse; not resumed")
                return
        if self._metrics is not None and isinstance(history, dict):  # dict: older snapshots
            self._metrics[1](history)

    def _forget_from(self, step: int) -> None:
        """A rollback: this rank's snapshots of ``step`` or later, and the backups it holds for
        its wards, are uncommitted before the restore agrees on a step - none of them is
        resumed now, or by a later restart before the job snapshots those steps anew."""
        from failslow.core.checkpoint.backup import forget_backups

        assert self.directory is not None
        gone = self.snapshots.forget_from(step)
        wards: list[int] = []
        if distributed(self.world_size):  # collective: every rank reads the placement
            holders = self._placement()
            wards = [w for w, h in enumerate(holders) if h == self.rank and w != self.rank]
        held = forget_backups(self.directory, wards, step)
        log.warning(
            "failslow: rank %d rolls back before step %d: forgot its snapshots of steps %s and "
            "backups of steps %s", self.rank, step, gone or "none", sorted(held) or "none",
        )  # fmt: skip

    def resume_resharded(self, sources: list[dict[str, Any]], before: int | None = None) -> int:
        """Gather every old rank's state of one step (:mod:`~failslow.core.checkpoint.reshard`)
        from the newest larger world in ``sources`` all of whose ranks' states survive, and let
        the adapter re-cut it for this world (``failslow_restore_resharded``). ``before``: a
        rollback's first bad step (``$FAILSLOW_ROLLBACK_BEFORE``) - no state of it or later is
        gathered, as none is resumed in a world that keeps its size (a machine that the
        stop-time ladder evicted with no standby left: the job goes on without it, from before
        the step it corrupted)."""
        from failslow.core.checkpoint.reshard import restore_resharded
        from failslow.core.checkpoint.restore import RestoreError

        errors = []
        for source in sources:  # the same list on every rank: they fail or succeed together
            directory = Path(source["directory"])
            old_rank = source.get("rank")
            holders = self._shared_placement(directory)  # the old world's
            if holders is None:
                errors.append(f"{directory}: no rank kept its placement.json")
                continue
            try:
                found = restore_resharded(
                    rank=self.rank,
                    world_size=self.world_size,
                    old_rank=old_rank,
                    old_holders=holders,
                    directory=directory,
                    readable={int(j): d for j, d in (source.get("readable") or {}).items()},
                    before_step=_earlier(source.get("before"), before),
                )
            except RestoreError as exc:
                errors.append(f"the {len(holders)}-rank world: {exc}")
                continue
            break
        else:
            self._cannot_resume("; ".join(errors), Path(sources[0]["directory"]).parent)
        states = found.states()
        profiles = [s.pop(PROFILE, None) if isinstance(s, dict) else None for s in states]
        histories = [s.pop(METRICS, None) if isinstance(s, dict) else None for s in states]
        mine = old_rank if isinstance(old_rank, int) and 0 <= old_rank < len(states) else 0
        self._resume_metrics(histories[mine])
        try:
            restored = self.hooks.failslow_restore_resharded(
                states=states, step=found.step, old_rank=old_rank
            )
        except FailslowError as exc:  # the same refusal on every rank: end, do not shrink on
            self._cannot_resume(f"this job cannot go on with {self.world_size} ranks: {exc}")
        if not restored:
            raise Unsupported(
                "snapshots",
                "no plugin restores a snapshot of a larger world (failslow_restore_resharded)",
            )
        self.resumed_step = found.step
        backups = [j for j, kind in enumerate(found.sources) if kind == "backup"]
        log.warning(
            "failslow: rank %d resumed step %d of the %d-rank world on %d ranks (old rank(s) "
            "%s from their holders' backups)",
            self.rank, found.step, len(holders), self.world_size, backups or "none",
        )  # fmt: skip
        self.resized = self._estimate(found.step, profiles)
        return found.step

    def _estimate(self, step: int, profiles: list[Any]) -> dict[str, Any]:
        """This world's layout after a larger one's resume and, on a data-parallel job, its
        step as the old ranks' profiles predict it (logged by rank 0)."""
        from failslow.core.planner.allocation import even_counts
        from failslow.core.planner.measured_step import resized_step_s

        topology = self._topology()
        old_world, dp, m = len(profiles), topology.dp, topology.micro_batches
        counts = even_counts(m, dp)
        record: dict[str, Any] = {
            "step": step, "old_world": old_world, "world": self.world_size, "counts": counts,
        }  # fmt: skip
        chosen = _chosen_layout()
        if chosen is not None:  # the launcher's choice (odyssey on the job's grid)
            record["before_s"], record["estimated_s"] = chosen["before_s"], chosen["estimated_s"]
            if self.rank == 0:
                log.warning(
                    "failslow: odyssey %s - PP%d x DP%d, %d micro-batches per step as %s: step "
                    "estimated %.3f s, %.2fx the %d-rank job's %.3f s",
                    chosen["choice"], topology.pp, dp, m, list(counts), chosen["estimated_s"],
                    chosen["estimated_s"] / chosen["before_s"], old_world, chosen["before_s"],
                )  # fmt: skip
            return record
        if dp != self.world_size or not all(isinstance(p, dict) for p in profiles):
            return record  # one rank per replica is what the old profiles describe
        old_counts = [int(p.get("calls", 0)) for p in profiles]
        if sum(old_counts) != m:
            old_counts = list(even_counts(m, old_world))
        estimate = resized_step_s(profiles, old_counts, counts)
        if estimate is not None:
            record["before_s"], record["estimated_s"] = estimate
            if self.rank == 0:
                log.warning(
                    "failslow: odyssey reroute - %d micro-batches per step on %d replicas as "
                    "%s (was %s): step estimated %.3f s, %.2fx the %d-rank job's %.3f s",
                    m, dp, list(counts), old_counts, estimate[1], estimate[1] / estimate[0],
                    old_world, estimate[0],
                )  # fmt: skip
        return record

    def measured(self, step_times: Any) -> None:
        """Once 16 steps ran after a larger world's resume, rank 0 logs the median of the last 8
        against the estimate (the first ones pay the restart's warm-up, and the launcher's
        warm spares importing beside them)."""
        info = self.resized
        if info is None or "measured_s" in info or "estimated_s" not in info:
            return
        times = [t for s, t in step_times if s > info["step"]]
        if len(times) < 16:
            return
        info["measured_s"] = statistics.median(times[-8:])
        if self.rank == 0:
            log.warning(
                "failslow: on %d ranks the step measured %.3f s against the %.3f s estimated "
                "(%.2fx)",
                self.world_size, info["measured_s"], info["estimated_s"],
                info["measured_s"] / info["estimated_s"],
            )  # fmt: skip

    def _shared_placement(
        self, directory: Path, world_size: int | None = None
    ) -> tuple[int, ...] | None:
        """``directory``'s ``placement.json`` (a list of ``world_size`` holders, any length
        when None) as the first rank that has one read it (collective), else None."""
        import torch.distributed as dist

        try:
            mine = json.loads((directory / "placement.json").read_text())
        except (OSError, ValueError):
            mine = None
        if not isinstance(mine, list) or (world_size is not None and len(mine) != world_size):
            mine = None
        found = [mine]
        if distributed(self.world_size):
            import torch

            first = torch.tensor([self.rank if mine is not None else self.world_size])
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
            if int(first) < self.world_size:
                dist.broadcast_object_list(found, src=int(first))
        return None if found[0] is None else tuple(int(h) for h in found[0])

    def _cannot_resume(self, exc: object, directory: Path | None = None) -> NoReturn:
        from failslow.core.checkpoint import restore

        message = (
            f"failslow: cannot resume from the snapshots in {directory or self.directory}: "
            f"{exc} (remove the directory to start the job afresh)"
        )
        if os.environ.get(envvars.SLOT):  # under failslow's rank launcher
            _unrestorable(message)
        raise restore.RestoreError(message) from None

    def snapshot(self, step: int) -> None:
        """Start this step's snapshot (the copy runs beside the step's forward/backward)."""
        state = self.hooks.failslow_snapshot_state(step=step)
        if state is None:
            raise Unsupported("snapshots", "no plugin returned the training state")
        profile = self._profile() if self._profile is not None else None
        profile = profile if profile is not None else self._resumed_profile
        if profile is not None and isinstance(state, dict):
            state = {**state, PROFILE: profile}
        if self._metrics is not None and isinstance(state, dict):
            state = {**state, METRICS: json.dumps(self._metrics[0]())}
        self.snapshots.start(state, step)
        self.last_snapshot = step
        if self.directory is not None:  # for the launcher, should ranks be lost (odyssey)
            from failslow.core.checkpoint.layout_notes import write_note

            write_note(self.directory, self.rank, self._topology(), profile)

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


def _earlier(a: int | None, b: int | None) -> int | None:
    """The earlier of two optional step bounds."""
    return b if a is None else a if b is None else min(int(a), int(b))


def reshard_sources() -> list[dict[str, Any]]:
    """``$FAILSLOW_RESHARD_FROM`` (see :mod:`failslow.envvars`), else empty."""
    text = os.environ.get(envvars.RESHARD_FROM)
    if not text:
        return []
    try:
        sources = json.loads(text)
    except ValueError:
        sources = None
    if not isinstance(sources, list) or not all(
        isinstance(s, dict) and isinstance(s.get("directory"), str) for s in sources
    ):
        raise ConfigError(
            f"${envvars.RESHARD_FROM}: not a list of {{'directory': ..., 'rank': ...}}: {text}"
        )
    return sources


def rollback_before() -> int | None:
    """``$FAILSLOW_ROLLBACK_BEFORE`` (see :mod:`failslow.envvars`), else None."""
    text = os.environ.get(envvars.ROLLBACK_BEFORE)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"${envvars.ROLLBACK_BEFORE}: expected a step, got {text!r}") from None


def _chosen_layout() -> dict[str, Any] | None:
    """``$FAILSLOW_LAYOUT`` with its estimates, else None."""
    try:
        layout = json.loads(os.environ.get(envvars.LAYOUT) or "null")
        if layout is not None:
            float(layout["estimated_s"]), float(layout["before_s"])
    except (ValueError, KeyError, TypeError):
        return None
    return layout if isinstance(layout, dict) and float(layout["before_s"]) > 0 else None


def _unrestorable(message: str) -> NoReturn:
    """End this rank with :data:`EXIT_UNRESTORABLE`: every rank failed the same collective
    restore, and the node launcher must stop the job rather than restart it again."""
    import sys

    from failslow.core.control.stop import EXIT_UNRESTORABLE

    log.error("%s", message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_UNRESTORABLE)  # no teardown: gloo threads may wait for peers in the same state
