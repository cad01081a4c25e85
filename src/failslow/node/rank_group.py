"""One launch of the node's ranks, seen by the agent as one child (:class:`RankGroup`), and
its fail-stops (:class:`FailStop`; byterobust 6.2-6.3).

Every rank process is watched through its pidfd, so a rank that exits with a failure is seen
within milliseconds; the survivors are released - SIGTERM to each rank's process group, SIGKILL
after the grace period - instead of waiting in a collective for a peer that will never come. A
rank that stopped as asked (an update, an S4 restart plan, a restore that cannot be done) is not
a fail-stop; a hang named by stack aggregation (:mod:`failslow.node.hang`) is one, with
:data:`HUNG`. What happens to a failed rank's slot is the launcher's business
(:class:`failslow.node.ranks.LocalRanks`, the ``on_failstop`` callback).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from failslow.core.control.stop import (
    EXIT_EVICTED,
    EXIT_FOR_RESTART,
    EXIT_FOR_UPDATE,
    EXIT_ROLLBACK,
    EXIT_UNRESTORABLE,
    rollback_requested_at,
)
from failslow.node.fork_server import Forked

RankProcess = subprocess.Popen[bytes] | Forked
"""A rank's process: started by the launcher, or forked by its fork server."""

HUNG = 124
"""The status a hung rank's fail-stop carries (``timeout``'s): the launch ends with it and the
agent restarts the job from memory."""


@dataclass(frozen=True, slots=True)
class FailStop:
    """A rank that ended with a failure while the others were running."""

    rank: int
    slot: int
    pid: int
    status: int
    """The exit status (128 + N for signal N)."""
    launch: int
    wall: float
    """When the launcher saw it (time.time(); the pidfd wakes it as the process ends)."""
    replaced_by: int | None = None
    """The standby slot the rank moves to (None: restarts on its own slot)."""
    cause: str = "died"
    """``died`` (a fail-stop), ``evicted`` (an S4 restart plan named its host), ``hung``
    (the job hung and stack aggregation named its group, :mod:`failslow.node.hang`) or
    ``replay`` (dual-phase replay named its machine, :mod:`failslow.node.replay`), ``checks``
    (the stop-time checks named it, :mod:`failslow.node.stop_checks`) or ``declined`` (an
    unexplained slowdown's rounds of stack aggregation flagged its group,
    :mod:`failslow.node.decline`)."""
    ranks_left: int | None = None
    """No standby left and ``--min-ranks`` allows it: the slot is dropped and the job goes on
    with this many ranks (None: not dropped)."""

    def describe(self) -> str:
        if self.cause == "evicted":
            where = (
                f"standby slot {self.replaced_by} takes rank {self.rank}"
                if self.replaced_by is not None
                else f"no standby left: rank {self.rank} restarts on slot {self.slot}"
            )
            return f"S4: rank {self.rank} (slot {self.slot}) evicted by the restart plan; {where}"
        how = f"signal {self.status - 128}" if self.status > 128 else f"status {self.status}"
        what = {"hung": "hung (stack aggregation named it)",
                "replay": "corrupts its steps (dual-phase replay named it)",
                "checks": "failed the stop-time checks (they named it)",
                "declined": "slows the job (stack aggregation flagged its group)"}.get(
            self.cause, f"died ({how})"
        )  # fmt: skip
        if self.replaced_by is not None:
            where = (
                f"slot {self.slot} evicted, standby slot {self.replaced_by} takes rank {self.rank}"
            )
        elif self.ranks_left is not None:
            where = (
                f"no standby left: slot {self.slot} dropped, the job goes on with "
                f"{self.ranks_left} ranks from memory"
            )
        else:
            where = f"no standby left: rank {self.rank} restarts on slot {self.slot}"
        return f"rank {self.rank} (slot {self.slot}, pid {self.pid}) {what}; {where}"


KILLED = 128 + signal.SIGKILL
STOPPED = (0, EXIT_FOR_UPDATE, EXIT_FOR_RESTART, EXIT_EVICTED, EXIT_UNRESTORABLE, EXIT_ROLLBACK)
"""Statuses of ranks that stopped as asked or agreed (never a fail-stop)."""
ENDS_LAUNCH = (EXIT_UNRESTORABLE, EXIT_ROLLBACK)
"""Statuses after which no rank can go on in this launch (its state is gone, or bad): every
rank is stopped, and no peer that fails meanwhile is a fail-stop."""


def _first(stop: dict[str, Any], at: float) -> bool:
    """Did the failure another node claimed (``stop``) come before one here at ``at`` (wall)?
    A rank killed by a signal always did: a peer's failure makes a rank raise (its collective
    fails), never kills it, and a killed process leaves no time of its own."""
    return int(stop.get("status", 0)) > 128 or float(stop.get("at", 0.0)) <= at


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(process: RankProcess, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


class RankGroup:
    """One launch of the node's ranks, seen by the agent as one child (``poll``, ``wait``,
    ``signal_group``). Its status: :data:`EXIT_UNRESTORABLE` when a rank could not restore its
    state, else :data:`EXIT_ROLLBACK` when a rank's metrics went bad, else the first failed
    rank's, else :data:`EXIT_FOR_RESTART` when the ranks stopped
    for an S4 restart plan, else :data:`EXIT_FOR_UPDATE` when a rank stopped for an update,
    else 0."""

    def __init__(
        self,
        ranks: dict[int, tuple[int, RankProcess]],
        *,
        launch: int,
        on_failstop: Callable[[FailStop], FailStop],
        kill_grace_s: float,
        store: Any = None,
        on_tick: Callable[[], None] | None = None,
        keep_going: bool = False,
        nodes: Any = None,
        on_remote: Callable[[dict[str, Any]], None] | None = None,
        state_dir: str | None = None,
    ) -> None:
        self._state_dir = state_dir
        """Where the ranks' exception records are (``$FAILSLOW_STATE_DIR``)."""
        self.ranks = ranks
        self._nodes = nodes
        """The job's other nodes (:class:`failslow.node.nodes.NodeGroup`; None: one node)."""
        self._on_remote = on_remote
        self.remote: dict[str, Any] | None = None
        """The stop another node claimed for this launch (its failed rank), once seen."""
        self._held: dict[int, float] = {}
        """This node's ranks that exited with a status, and when they failed (wall clock): a
        consequence of another node's failure (their gloo peers reset) until ``settle_s``
        passed without an earlier claim."""
        self._next_check = 0.0
        self._keep_going = keep_going
        """A failed rank does not stop its peers (the stop-time checks: each machine's tests
        are its own)."""
        self._on_tick = on_tick
        self.launch = launch
        self._on_failstop = on_failstop
        self._kill_grace_s = kill_grace_s
        self._store = store  # the launch's rendezvous store, alive as long as the group
        self.failstops: list[FailStop] = []
        """This launch's fail-stops, in the order they were seen."""
        self.evictions: list[FailStop] = []
        """This launch's ranks evicted by an S4 restart plan."""
        self._recorded: set[int] = set()
        self._released_at: float | None = None
        self._killed = False
        self._incident_claimed = False
        self.returncode: int | None = None
        self._fds: dict[int, int] = {}
        for rank, (_, process) in ranks.items():
            with contextlib.suppress(OSError, AttributeError):
                self._fds[rank] = os.pidfd_open(process.pid)

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._on_tick is not None:
            self._on_tick()
        now = time.monotonic()
        statuses = {
            rank: _status(code)
            for rank, (_, process) in self.ranks.items()
            if (code := process.poll()) is not None
        }
        if self._nodes is not None and self._released_at is None:
            self._check_peers(now)
        if set(statuses.values()) & set(ENDS_LAUNCH):
            # before any peer is judged: a peer that failed because this rank left (its gloo
            # connection reset) exited after it, so it is in ``statuses`` only if this rank is
            self._claim_incident(statuses)
            self.release()
        failed: list[int] = []
        for rank, status in statuses.items():
            if status == EXIT_EVICTED and rank not in self._recorded:
                self._recorded.add(rank)  # a planned eviction: the rank moves to a standby
                self.evictions.append(self._on_failstop(self._record(rank, status, "evicted")))
            if status in STOPPED or rank in self._recorded:
                continue
            # a fail-stop: any failure before the survivors were released; after it, a SIGKILL
            # that was not ours (a rank that died together with the first: a lost machine)
            if self._released_at is None or (status == KILLED and not self._killed):
                failed.append(rank)
        if self._nodes is not None:
            failed = self._first_here(failed, statuses)
        for rank in failed:
            self._fail(rank, statuses[rank])
        if self._released_at is not None and not self._killed:
            if now - self._released_at > self._kill_grace_s:
                self._killed = True
                self._send(signal.SIGKILL)
        if len(statuses) < len(self.ranks) or self._held:
            return None
        if self._released_at is not None:
            self._send(signal.SIGKILL)  # what is left of the ranks' process groups
        self._close_fds()
        bad = [s for s in statuses.values() if s not in STOPPED]
        if EXIT_UNRESTORABLE in statuses.values():
            self.returncode = EXIT_UNRESTORABLE  # before any fail-stop: do not restart
        elif EXIT_ROLLBACK in statuses.values():
            self.returncode = EXIT_ROLLBACK  # the agent climbs the ladder (node/incidents.py)
        elif self.failstops:
            self.returncode = self.failstops[0].status
        elif self.remote is not None:  # another node's rank failed: the same restart here
            self.returncode = int(self.remote["status"])
        elif bad:  # the agent stopped the ranks (a signal to the launcher)
            self.returncode = bad[0]
        elif {EXIT_FOR_RESTART, EXIT_EVICTED} & set(statuses.values()):
            self.returncode = EXIT_FOR_RESTART
        elif EXIT_FOR_UPDATE in statuses.values():
            self.returncode = EXIT_FOR_UPDATE
        else:
            self.returncode = 0
        self._store = None
        return self.returncode

    def _claim_incident(self, statuses: dict[int, int]) -> None:
        """Several nodes: a rank here that reported an incident (:data:`EXIT_ROLLBACK`) claims
        the launch's stop, once - the other nodes release their ranks, whose failures are then
        consequences, and the nodes climb one ladder (:mod:`failslow.node.incidents`)."""
        if self._nodes is None or self._incident_claimed or self.remote is not None:
            return
        reported = sorted(r for r, status in statuses.items() if status == EXIT_ROLLBACK)
        if reported:
            self._incident_claimed = True
            at = time.time()
            if self._state_dir is not None:
                at = min(at, rollback_requested_at(self._state_dir, reported[0]) or at)
            self._claim(reported[0], EXIT_ROLLBACK, at, "incident")

    def _check_peers(self, now: float) -> None:
        """Every ``check_every_s`` while running: did another node claim this launch's stop?
        Then this node's ranks are released (one store read per tick, not per rank)."""
        if now < self._next_check:
            return
        self._next_check = now + self._nodes.options.check_every_s
        stop = self._nodes.stopped(self.launch)
        if stop is not None and stop.get("node") != self._nodes.node_rank:
            self._remote_stop(stop)

    def _remote_stop(self, stop: dict[str, Any]) -> None:
        if self.remote is None:
            self.remote = stop
            if self._on_remote is not None:
                self._on_remote(stop)
        self._held.clear()  # consequences of it
        self.release()

    def _first_here(self, failed: list[int], statuses: dict[int, int]) -> list[int]:
        """Which of this node's failed ranks are fail-stops (module docstring of
        :mod:`failslow.node.nodes`): one killed by a signal at once (its claim published);
        one that exited with a status is held until ``settle_s`` after it failed - its
        exception's time where it left a record, else when it was seen - and is a consequence
        if another node claims meanwhile a rank killed by a signal, or one that failed no
        later than it."""
        out = []
        for rank in failed:
            if statuses[rank] > 128 or self.remote is not None:
                # a crash or kill here: a failure whoever claimed first (a lost machine)
                self._claim(rank, statuses[rank], time.time())
                out.append(rank)
            elif rank not in self._held:
                self._held[rank] = self._failed_at(rank)
                self._recorded.add(rank)  # judged below, never again as a new failure
                self.release()
        if not self._held:
            return out
        nodes = self._nodes
        stop = nodes.stopped(self.launch)
        wall = time.time()
        for rank, at in sorted(self._held.items(), key=lambda item: item[1]):
            if stop is None and wall < at + nodes.options.settle_s:
                continue
            del self._held[rank]
            claim = stop if stop is not None else self._claim(rank, statuses[rank], at)
            mine = claim.get("node") == nodes.node_rank and claim.get("rank") == rank
            if not mine and _first(claim, at):  # it failed first: this rank followed it
                if claim.get("node") != nodes.node_rank:
                    self._remote_stop(claim)
                    return out
                continue  # a consequence of this node's own first failure
            out.append(rank)  # the first failure of the launch (or as early as the first)
        return out

    def _failed_at(self, rank: int) -> float:
        """When ``rank`` failed: its uncaught exception's time if it recorded one (the
        runtime's exception hook, under ``failslow run``), else now."""
        if self._state_dir is not None:
            from failslow.runtime.crash_record import raised_at

            at = raised_at(self._state_dir, self.ranks[rank][1].pid)
            if at is not None:
                return min(at, time.time())
        return time.time()

    def _claim(self, rank: int, status: int, at: float, cause: str = "died") -> dict[str, Any]:
        pid = self.ranks[rank][1].pid
        record = {"rank": rank, "status": status, "at": at, "pid": pid, "cause": cause}
        return self._nodes.claim(self.launch, record)  # type: ignore[no-any-return]

    def running(self) -> bool:
        """Every rank runs and none was told to stop."""
        return self._released_at is None and all(
            process.returncode is None for _, process in self.ranks.values()
        )

    def _record(self, rank: int, status: int, cause: str = "died") -> FailStop:
        slot, process = self.ranks[rank]
        return FailStop(
            rank=rank, slot=slot, pid=process.pid, status=status, launch=self.launch,
            wall=time.time(), cause=cause,
        )  # fmt: skip

    def _fail(self, rank: int, status: int) -> None:
        self._recorded.add(rank)
        self.failstops.append(self._on_failstop(self._record(rank, status)))
        if not self._keep_going:
            self.release()

    def hang(self, ranks: list[int], cause: str = "hung") -> None:
        """The job hung (or slowed down, ``cause`` ``declined``) and stack aggregation named
        ``ranks``: each is a fail-stop (its slot evicted onto a standby while one is left, ...)
        with status :data:`HUNG`, and every rank is stopped for the restart from memory. On
        several nodes the launch's stop is claimed first, so the other nodes release their
        ranks and take their failures for consequences."""
        named = [rank for rank in ranks if rank in self.ranks and rank not in self._recorded]
        if self._nodes is not None and named and self._released_at is None:
            self._claim(named[0], HUNG, time.time(), cause)
        for rank in named:
            self._recorded.add(rank)
            self.failstops.append(self._on_failstop(self._record(rank, HUNG, cause)))
        self.release()

    def release(self) -> None:
        """Stop every rank still running: SIGTERM now, SIGKILL after the grace period."""
        if self._released_at is None:
            self._released_at = time.monotonic()
            self._send(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 0.05 if deadline is None else min(deadline - time.monotonic(), 0.5)
            if self._nodes is not None:  # another node's claim is read at each poll
                left = min(left, self._nodes.options.check_every_s)
            if left <= 0:
                raise subprocess.TimeoutExpired("failslow ranks", timeout or 0.0)
            self._sleep(left)
        return code

    def _sleep(self, seconds: float) -> None:
        """Until a rank exits (its pidfd is readable) or ``seconds`` pass."""
        live = {
            fd: rank for rank, fd in self._fds.items() if self.ranks[rank][1].returncode is None
        }
        if not live:
            time.sleep(min(seconds, 0.05))
            return
        with selectors.DefaultSelector() as selector:
            for fd in live:
                selector.register(fd, selectors.EVENT_READ)
            selector.select(seconds)

    def signal_group(self, signum: int) -> None:
        """The agent's signal to the job (forwarded, or its stop for an update): ranks that end
        from it are not fail-stops."""
        if self._released_at is None:
            self._released_at = time.monotonic()
            self._killed = True  # the agent escalates on its own
        self._send(signum)

    def _send(self, signum: int) -> None:
        """``signum`` to each rank's process group - a dead rank's too: its children (data
        loader workers, say) outlive it there."""
        for _, process in self.ranks.values():
            _signal_group(process, signum)

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
