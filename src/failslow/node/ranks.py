"""``failslow run --nproc-per-node N``: this node's ranks, started from warm processes, a dead
rank noticed at once, its slot replaced by a standby (byterobust 6.2 warm standbys, 6.3
restart from memory; greyhound 5.2 S4).

With ``torchrun`` as CMD the launcher only sees CMD: a rank that dies is noticed by torchrun
(gloo peers get a reset connection; NCCL peers hang until the collective timeout) and every
restart pays Python, torch and the framework's imports again. Here the launcher is the node's
rank agent itself:

- **warm processes** (:mod:`failslow.node.warm`): each rank runs in a process that had already
  imported ``--preload`` (torch and the framework) before it was given its rank; while the job
  trains, the launcher keeps one warm spare per rank, so a restart in place (a fail-stop, a hot
  update) skips the imports; all of them are forked from one process per environment that
  imported ``--preload`` once (:mod:`failslow.node.fork_server`);
- **fail-stop detection**: every rank process is watched through its pidfd, so a rank that
  exits with a failure (a crash, SIGKILL, the OOM killer) is seen within milliseconds, whatever
  the survivors are doing; the survivors are then released - SIGTERM to each rank's process
  group, SIGKILL after ``kill_grace_s`` - instead of waiting in a collective for a peer that will
  never come;
- **slots and standbys**: the node has ``N + standbys`` slots (devices; ``$FAILSLOW_SLOT``);
  ranks run on the first N. The slot of a rank that failed is evicted while a standby slot is
  left, and the rank restarts on the standby; without one it restarts where it was - or, with
  ``min_ranks``, its slot is dropped and the job goes on with one rank fewer (odyssey III-IV):
  a new :class:`World` with its own snapshot directories, whose ranks gather the larger
  world's states from memory (``$FAILSLOW_RESHARD_FROM``) until they have snapshots of their own;
- **hangs** (``hang_after_s``, :mod:`failslow.node.hang`): no collective on any rank's ring for
  that long, and stack aggregation names the ranks whose stacks stand out - they are evicted as
  dead ones would be (cause ``hung``), and the job restarts;
- on a grid that notes its layers (Megatron-core), the smaller world's layout is odyssey's
  choice between dropping the replicas that lost a rank and a new PP x DP grid
  (``$FAILSLOW_LAYOUT``, :mod:`failslow.core.planner.odyssey.rigid`);
- the :class:`~failslow.node.hot_update.agent.Agent` restarts the group (``--max-restarts``) and
  every rank resumes from the in-memory snapshots (:mod:`failslow.runtime.snapshot_service`).

Rendezvous: the launcher hosts a fresh TCPStore per launch and the ranks use it as torchrun's
agent store (``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``), so ``env://``
initialization works unchanged. Several nodes (``--nnodes``, :mod:`failslow.node.nodes`): node
0's launcher hosts it, each node's ranks are its part of the job's world, and a fail-stop on any
node restarts every node's ranks, and so does a hang, which node 0 looks at across the nodes
(replay and the stop-time checks stay one node's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from failslow import envvars
from failslow.errors import ConfigError, FailslowError
from failslow.node.fork_server import ForkServer, available, read_nowait
from failslow.node.rank_group import HUNG, FailStop, RankGroup, RankProcess, _signal_group

__all__ = ["HUNG", "FailStop", "LocalRanks", "RankGroup", "RankOptions", "World"]

PER_LAUNCH = frozenset({envvars.RESTART, envvars.UPDATE_ID, envvars.ROLLBACK_BEFORE})
"""Variables that change at every launch: set at activation, not part of a warm process's key."""
CODE = frozenset({envvars.CODE_DIR, envvars.CODE_VERSION})
"""What a code update changes (with the code directory's place on ``PYTHONPATH``): not part of
a warm process's key while no preloaded module comes from the code directory - the process
takes the new code directory's place on ``sys.path`` at activation (:mod:`failslow.node.warm`),
and the job's own modules are imported after it."""


def _without_code(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the code version: its variables, and its directory on PYTHONPATH."""
    code_dir = env.get(envvars.CODE_DIR)
    out = {k: v for k, v in env.items() if k not in CODE}
    if code_dir and "PYTHONPATH" in out:
        paths = [p for p in out["PYTHONPATH"].split(os.pathsep) if p != code_dir]
        out["PYTHONPATH"] = os.pathsep.join(paths)
    return out


def preloads_code(preload: tuple[str, ...], code_dir: str | None) -> bool:
    """Whether a preloaded module's top-level package is in ``code_dir`` (a warm process that
    imported it holds that version of the job's code)."""
    import importlib.machinery

    if not code_dir:
        return False
    tops = {name.lstrip("?").split(".")[0] for name in preload}
    return any(importlib.machinery.PathFinder.find_spec(t, [code_dir]) for t in tops)


@dataclass(slots=True)
class _Warm:
    process: RankProcess
    sock: socket.socket
    key: str
    ready: bool = False

    def check(self) -> None:
        """Read what the process said so far (``ready`` or ``error ...``), without blocking."""
        if self.ready:
            return
        data = read_nowait(self.sock)
        if data is None:
            return
        if data.startswith(b"ready"):
            self.ready = True
        elif data.startswith(b"error"):
            raise FailslowError(f"warm rank process: {data.decode(errors='replace').strip()}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass(slots=True)
class World:
    """One size of the job: where its ranks keep their snapshots, which slot runs which rank,
    and the larger world its first restore gathers from (odyssey: the job goes on without
    lost ranks)."""

    directory: Path | None
    """Its snapshot base (per slot below it with ``slots_as_hosts``); None: no snapshots."""
    slots: list[int]
    source: World | None = None
    """The larger world it was cut from."""
    layout: dict[str, Any] | None = None
    """The grid the launcher chose for it (``$FAILSLOW_LAYOUT``); None: the job's own."""


@dataclass(kw_only=True, slots=True)
class RankOptions:
    nproc: int
    standbys: int = 0
    preload: tuple[str, ...] = ("torch",)
    warm: bool = True
    """Keep one warm spare per rank while the job runs (restarts skip the imports)."""
    fork_server: bool = True
    """Fork every warm process from one process per environment that imported ``preload``
    once (:mod:`failslow.node.fork_server`; Linux); False: each imports for itself."""
    min_ranks: int | None = None
    """With no standby left, a dead rank's slot is dropped and the job goes on with one rank
    fewer while at least this many are left (the ranks reshard the larger world's snapshots:
    ``$FAILSLOW_RESHARD_FROM``); None: the rank restarts on its own slot."""
    max_stage_layers: int | None = None
    """With ``min_ranks``, on a job whose ranks report their layers (Megatron-core): the most
    transformer layers one rank can hold (memory), which bounds the layouts odyssey may choose
    (:mod:`failslow.core.planner.odyssey.rigid`); None: any."""
    hang_after_s: float = 0.0
    """A job whose ranks all committed no collective for this long is hung: stack
    aggregation names whom to evict (:mod:`failslow.node.hang`); 0: not watched."""
    kill_grace_s: float = 10.0
    refill_delay_s: float = 10.0
    """Warm spares start this long after a launch (its ranks' own start-up goes first)."""
    slots_as_hosts: bool = False
    """One machine standing for several (tests, demos): each slot is a host of its own
    (``FAILSLOW_HOST``) with its own node memory (a snapshot directory per slot), and an
    evicted slot's memory is gone with it, as a machine's would be - the rank that replaces it
    restores from its holder's backup."""
    python: str = field(default_factory=lambda: sys.executable)
    decline_every_s: float = 0.0
    """An unexplained slowdown (the controller's healthy round for a new onset;
    :func:`failslow.node.launcher.decline_trigger`) is localized by stack aggregation every this
    many seconds (:mod:`failslow.node.decline`); 0: not at all."""
    decline_rounds: int = 5
    """Rounds of it before the most flagged group is evicted."""
    decline_settle_s: float = 15.0
    """Its rounds start no sooner than this after a launch (a restart's warm-up)."""
    check_spares: bool = False
    """Also keep one warm process per slot, torch imported, for the stop-time checks
    (:meth:`LocalRanks.spawn_check`), started after the job's own spares: the checks then skip
    torch's import (seconds per incident)."""
    nodes: Any = None
    """The job's other nodes (:class:`failslow.node.nodes.NodeGroup`, ``--nnodes``): this node
    runs ranks ``node_rank * nproc ...`` of a world of ``nnodes * nproc``, each launch's
    rendezvous is node 0's, and a fail-stop on any node restarts every node's ranks. None: the
    job is this node's ranks."""


CHECK_PRELOAD = ("torch",)
_CHECK_DROPPED = (envvars.STORE, envvars.RING_DIR, envvars.CAPTURE, envvars.SNAPSHOT_DIR)
"""Not in a stop-time check's environment: no rings, no control store, no snapshots."""


def _launch_of(command: list[str], env: dict[str, str], cwd: str | None) -> str:
    """What a launch runs, but its per-launch variables (:data:`PER_LAUNCH`)."""
    return json.dumps([command, cwd, sorted((k, v) for k, v in env.items() if k not in PER_LAUNCH)])


def _check_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _CHECK_DROPPED}


class LocalRanks:
    """The node's slots, its pool of warm processes and the launches of its ranks (the agent's
    ``spawn``). Owns every process it starts: :meth:`close` ends the pool."""

    def __init__(self, options: RankOptions, *, say: Callable[[str], None] = print) -> None:
        if options.nproc < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {options.nproc}")
        if options.standbys < 0:
            raise ConfigError(f"--standbys must be >= 0, got {options.standbys}")
        self.options = options
        self.say = say
        self.slots = list(range(options.nproc))
        """The slot of each rank."""
        self.standby_slots = list(range(options.nproc, options.nproc + options.standbys))
        self.evicted: list[int] = []
        self.failstops: list[FailStop] = []
        self.launches = 0
        self._pool: list[_Warm] = []
        self._refill: tuple[str, dict[str, str], float] | None = None
        self._check_pool: list[_Warm] = []
        """Warm processes for the stop-time checks (``check_spares``)."""
        self._check_refill: dict[str, str] | None = None
        """The environment to start them with, once the job's spares are ready."""
        self._servers: dict[tuple[str, tuple[str, ...]], ForkServer] = {}
        """The fork servers, by the key and the preloads of the processes they fork."""
        self.group: RankGroup | None = None
        """The last launch."""
        self._snapshot_base: Path | None = None
        self._dropping: list[int] = []
        self._last_launch: str | None = None
        """What the last launch ran: its command, environment (code included) and directory."""
        """Slots of dead ranks to drop at the next launch (``min_ranks``)."""
        self.worlds: list[World] = []
        """Each world size the job ran with, the current one last."""
        self.listeners: list[Callable[[FailStop], None]] = []
        """Told of each fail-stop (the launcher records it and counts the incident)."""
        self._hang_watch: Any = None
        self._exchange: Any = None
        """Stack aggregation across the nodes for the running launch (several nodes only)."""
        self.decline_watch: Any = None
        """The unexplained slowdown's rounds of stack aggregation (``decline_every_s``)."""
        self.step_time: Callable[[], float | None] = lambda: None
        """The node's current step time (the launcher's node publisher,
        :meth:`~failslow.node.publisher.NodePublisher.step_time`), for the decline watch's last
        guard: is the step time still up when its rounds end."""

    # -- the agent's spawn ---------------------------------------------------------------------
    def spawn(self, command: list[str], env: dict[str, str], cwd: str | None) -> RankGroup:
        """Start the ranks of one launch: ``command`` is what follows ``python`` (``script.py
        args`` or ``-m module args``)."""

        if not command:
            raise FailslowError("no script to run: failslow run --nproc-per-node N -- SCRIPT ...")
        key = self._key(env)
        self._last_launch = _launch_of(command, env, cwd)
        base = env.get(envvars.SNAPSHOT_DIR)
        self._snapshot_base = Path(base) if base else None
        world, sources = self._world()
        memory = [self._memory(world, sources, slot) for slot in self.slots]
        store, ranks = self._start_ranks(
            key, command, env, cwd, list(self.slots), memory, nodes=self.options.nodes
        )  # fmt: skip
        group = RankGroup(
            ranks,
            launch=self.launches,
            on_failstop=self._failstop,
            kill_grace_s=self.options.kill_grace_s,
            store=store,
            on_tick=self.tick,
            nodes=self.options.nodes,
            on_remote=self._remote_failure,
            state_dir=env.get(envvars.STATE_DIR),
        )
        self.launches += 1
        self.group = group
        if self.options.nodes is not None:
            from failslow.node.stack_exchange import StackExchange

            self._exchange = StackExchange(self.options.nodes, group.launch, say=self.say)
        self._watch_hangs(env)
        self._watch_declines(env)
        for warm in [w for w in self._pool if w.key != key]:
            self._pool.remove(warm)  # started for another version: of no use now
            self._retire(warm)
        keep = {key, self._key(_check_env(env))}
        for at, server in list(self._servers.items()):
            if at[0] not in keep and server.idle():
                del self._servers[at]  # for another version, and no process of its left
                server.close()
        if self.options.warm:
            self._refill = (key, env, time.monotonic() + self.options.refill_delay_s)
        return group

    def spawn_replay(
        self, command: list[str], env: dict[str, str], cwd: str | None, name: str,
        ranks: list[int], replay: dict[str, Any], roles: list[int] | None = None,
    ) -> RankGroup:  # fmt: skip
        """Start a replay group of the stop-time ladder (byterobust 4.2): the current world's
        ``ranks`` (machines), on their slots, as a world of their own (in the current world's
        layout) that resumes the world's snapshot before ``replay["until"]`` - every old
        rank's state read where it is kept (every machine is alive during a replay) - and
        trains to it (``$FAILSLOW_REPLAY``; its ranks write their results in the state
        directory). ``roles``: per rank, the old rank whose place it takes (a re-formed
        pipeline's stage; default: its own). No slot changes, no control store, nothing is
        written to the world's snapshots, and its rings go to ``replay-<name>`` below the
        job's ring directory (the node's analyzer took them for restarts of the job's ranks)."""
        world = self.worlds[-1]
        slots = [world.slots[r] for r in ranks]
        base = self._snapshot_base
        replay_world = World(
            None if base is None else base / f"replay-{name}", slots, layout=world.layout
        )
        readable = {
            str(j): str(d) for j, slot in enumerate(world.slots)
            if (d := self._dir(world, slot)) is not None
        }  # fmt: skip
        memory = []
        for role, slot in zip(roles or ranks, slots, strict=True):
            own = self._memory(replay_world, [], slot)
            source = {"directory": readable.get(str(role)), "rank": role, "readable": readable,
                      "before": int(replay["until"])}  # fmt: skip
            own[envvars.RESHARD_FROM] = json.dumps([source])
            own[envvars.REPLAY] = json.dumps({**replay, "name": name})
            memory.append(own)
        replay_env = {k: v for k, v in env.items() if k != envvars.STORE}
        if env.get(envvars.RING_DIR):  # its own rings, out of the node analyzer's sight
            rings = Path(env[envvars.RING_DIR]) / f"replay-{name}"
            rings.mkdir(parents=True, exist_ok=True)
            replay_env[envvars.RING_DIR] = str(rings)
        store, started = self._start_ranks(self._key(env), command, replay_env, cwd, slots, memory)
        return RankGroup(
            started, launch=self.launches, on_failstop=lambda stop: stop,
            kill_grace_s=self.options.kill_grace_s, store=store,
        )  # fmt: skip

    def spawn_check(self, env: dict[str, str], name: str, spec: dict[str, Any]) -> RankGroup:
        """Start the stop-time checks of the ladder's first rung (byterobust 4.2, "Diagnose";
        :mod:`failslow.runtime.stop_check`): one process per slot of the current world, as a
        world of its own. They start cold with torch alone, so the warm spares stay for the
        relaunch (with ``check_spares``, from warm processes of their own, torch imported); no
        rings, no control store, no snapshots. With several nodes, the world is every node's
        machines (node 0's rendezvous): the link test's ring crosses the nodes."""
        slots = list(self.worlds[-1].slots)
        check_env = _check_env(env)
        spec_env = {envvars.STOP_CHECK: json.dumps({**spec, "name": name})}
        store, started = self._start_ranks(
            self._key(check_env), ["-m", "failslow.runtime.stop_check"], check_env, None, slots,
            [dict(spec_env) for _ in slots], take=self._take_check, nodes=self.options.nodes,
            what="check/",
        )  # fmt: skip
        if self.options.check_spares:
            self._check_refill = env  # after the job's own spares
        return RankGroup(
            started, launch=self.launches, on_failstop=lambda stop: stop,
            kill_grace_s=self.options.kill_grace_s, store=store, keep_going=True,
        )  # fmt: skip

    def grid(self) -> tuple[int, int]:
        """``(TP, PP)`` of the current world as its ranks noted them with their snapshots
        (``(1, 1)`` when they noted nothing: a data-parallel job)."""
        notes = self._notes()
        return (max((int(n.get("tp") or 1) for n in notes), default=1),
                max((int(n.get("pp") or 1) for n in notes), default=1))  # fmt: skip

    def coords(self) -> dict[int, tuple[int, int, int]]:
        """Each rank's ``(t, d, s)`` in the current world's grid, as it noted it."""
        return {int(n["rank"]): (int(n["coord"][0]), int(n["coord"][1]), int(n["coord"][2]))
                for n in self._notes() if len(n.get("coord") or ()) == 3}  # fmt: skip

    def _notes(self) -> list[dict[str, Any]]:
        from failslow.core.checkpoint.layout_notes import read_notes

        world = self.worlds[-1]
        return read_notes(
            [(d, r) for r, slot in enumerate(world.slots) if (d := self._dir(world, slot))]
        )

    def forget_replay(self, name: str) -> None:
        """Remove replay group ``name``'s own snapshots (of no use once it ended)."""
        if self._snapshot_base is not None:
            shutil.rmtree(self._snapshot_base / f"replay-{name}", ignore_errors=True)

    def evict(self, rank: int, cause: str) -> FailStop:
        """Evict the current world's ``rank`` (its slot) as a fail-stop would be, for ``cause``
        (``replay``: dual-phase replay named its machine; ``checks``: the stop-time checks
        did): onto a standby while one is left,
        dropped with ``--min-ranks``, else it restarts in place."""
        slot = self.slots[rank - self.first_rank]
        record = FailStop(rank=rank, slot=slot, pid=0, status=0, launch=self.last_launch,
                          wall=time.time(), cause=cause)  # fmt: skip
        return self._failstop(record)

    def _start_ranks(
        self, key: str, command: list[str], env: dict[str, str], cwd: str | None,
        slots: list[int], memory: list[dict[str, str]],
        take: Callable[[str, dict[str, str]], _Warm] | None = None, nodes: Any = None,
        what: str = "",
    ) -> tuple[Any, dict[int, tuple[int, RankProcess]]]:  # fmt: skip
        """One rank per slot, from warm processes (``take``; default: the pool's), with a
        fresh rendezvous store (node 0's, with several nodes: ``nodes``, for the job's next
        launch, or ``what`` after the last one - the stop-time checks). The ranks are keyed by
        their rank in the job."""
        from failslow.node.control import host_store, port_of

        n = len(slots)
        if nodes is None:
            store = host_store()  # a fresh rendezvous per launch: no stale keys from the last one
            addr, port = "127.0.0.1", port_of(store)
            first, world, node, nnodes = 0, n, 0, 1
        else:
            launch = self.last_launch if what else self.launches
            store, addr, port = nodes.rendezvous(launch, host_store, what)
            node, nnodes = nodes.node_rank, nodes.options.nnodes
            first, world = node * n, nnodes * n
        ranks: dict[int, tuple[int, RankProcess]] = {}
        try:
            for local in range(n):
                rank = first + local
                warm = (take or self._take)(key, env)
                rank_env = {
                    **env,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local),
                    "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(n),
                    "GROUP_RANK": str(node),
                    "GROUP_WORLD_SIZE": str(nnodes),
                    "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(world),
                    "MASTER_ADDR": addr,
                    "MASTER_PORT": str(port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "TORCHELASTIC_RESTART_COUNT": str(self.launches),
                    envvars.SLOT: str(slots[local]),
                }
                rank_env.update(memory[local])
                message = {"env": rank_env, "cwd": cwd or os.getcwd(), "argv": list(command)}
                try:
                    warm.sock.sendall(json.dumps(message).encode() + b"\n")
                except OSError as exc:
                    why = f"its warm process is gone ({exc})"
                    raise FailslowError(f"cannot start rank {rank}: {why}") from None
                warm.close()
                ranks[rank] = (slots[local], warm.process)
        except BaseException:
            for _, process in ranks.values():
                _signal_group(process, signal.SIGKILL)
                process.wait()
            raise
        return store, ranks

    def _watch_hangs(self, env: dict[str, str]) -> None:
        """Watch this launch's rings for a hang (``hang_after_s``; needs the ring directory)."""
        ring_dir = env.get(envvars.RING_DIR)
        if not self.options.hang_after_s > 0 or not ring_dir:
            self._hang_watch = None
            return
        from failslow.node.hang import HangWatch
        from failslow.node.stacks import job_topology

        state = env.get(envvars.STATE_DIR)
        store = env.get(envvars.STORE)
        self._hang_watch = HangWatch(
            Path(ring_dir), self.options.hang_after_s, Path(state) if state else None,
            topology=lambda: job_topology(store), say=self.say, exchange=self._exchange,
        )  # fmt: skip

    def _watch_declines(self, env: dict[str, str]) -> None:
        """A new launch's ranks: a decline is looked for again when the controller sees one."""
        if not self.options.decline_every_s > 0:
            return
        if self.decline_watch is None:
            from failslow.node.decline import DeclineWatch
            from failslow.node.stacks import job_topology

            state = env.get(envvars.STATE_DIR)
            self.decline_watch = DeclineWatch(
                every_s=self.options.decline_every_s, rounds=self.options.decline_rounds,
                settle_s=self.options.decline_settle_s, state_dir=Path(state) if state else None,
                step_time=lambda: self.step_time(), say=self.say,
            )  # fmt: skip
        store = env.get(envvars.STORE)
        self.decline_watch.topology = lambda: job_topology(store)
        self.decline_watch.exchange = self._exchange
        self.decline_watch.reset()

    def tick(self) -> None:
        """Watch for a hang and localize a decline; start the next warm spare when it is due:
        ``refill_delay_s`` after the launch, then one at a time, each when the last one
        finished its imports - spares importing torch beside ranks that are starting would
        slow the very restart they are for."""
        group, watch = self.group, self._hang_watch
        if watch is not None and group is not None and group.running():
            pids = {rank: process.pid for rank, (_, process) in group.ranks.items()}
            hung = watch.check(pids)
            if hung:
                group.hang(hung)
        exchange = self._exchange
        if exchange is not None and not exchange.leads and group is not None and group.running():
            pids = {rank: process.pid for rank, (_, process) in group.ranks.items()}
            named = exchange.follow(pids, watch.quiet if watch is not None else None)
            if named:  # node 0's look named ranks of this node
                group.hang(named[0], cause=named[1])
        decline = self.decline_watch
        if decline is not None and decline.active and group is not None and group.running():
            pids = {rank: process.pid for rank, (_, process) in group.ranks.items()}
            slow = decline.check(pids)
            if slow:
                group.hang(slow, cause="declined")
        if self._refill is not None:
            key, env, due = self._refill
            if time.monotonic() < due:
                return
            full = self._grow(self._pool, key, env)
            if full is None:
                self._refill = None
            elif full:
                self._refill = None
                self.say(f"{len(self._pool)} warm spares ready: a restart skips the imports")
                if self.options.check_spares:
                    self._check_refill = env
            return
        if self._check_refill is not None:
            env = _check_env(self._check_refill)
            full = self._grow(self._check_pool, self._key(env), env, CHECK_PRELOAD)
            if full is not False:
                self._check_refill = None
            if full:
                self.say(f"{len(self._check_pool)} warm processes ready for the stop-time checks")

    def _grow(
        self, pool: list[_Warm], key: str, env: dict[str, str],
        preload: tuple[str, ...] | None = None,
    ) -> bool | None:  # fmt: skip
        """Start ``pool``'s next warm process once the last one finished its imports: True
        when it holds one per slot, None when a start failed (said; the pool stops growing)."""
        if pool and not pool[-1].ready:
            try:
                pool[-1].check()
            except FailslowError as exc:
                self.say(f"no warm spares: {exc}")
                self._retire(pool.pop())
                return None
            if not pool[-1].ready:
                return False
        if len(pool) >= len(self.slots):
            return True
        try:
            if not self._can_start(key, env, preload):
                return False  # its fork server is still importing
            pool.append(self._start(key, env, preload))
        except FailslowError as exc:
            self.say(f"no warm spares: {exc}")
            return None
        return False

    def _world(self) -> tuple[World, list[World]]:
        """The world this launch runs in - a new, smaller one when slots were dropped - and,
        while its own snapshots are not complete, the larger worlds its ranks may restore from
        (newest first: the ranks take the first one every old rank's state survives in)."""
        if not self.worlds:
            self.worlds.append(World(self._snapshot_base, list(self.slots)))
        current = self.worlds[-1]
        if self._dropping:
            current.slots = list(self.slots)
            layout = self._choose_layout(current)
            if layout is None:
                self.slots = [s for s in self.slots if s not in self._dropping]
            else:
                idle = [s for s in self.slots if s not in self._dropping]
                self.slots = [current.slots[r] for r in layout.pop("keep")]
                idle = [s for s in idle if s not in self.slots]
                self.standby_slots += idle
                if idle:
                    self.say(f"slots {idle} stand by (odyssey {layout['choice']})")
            self._dropping = []
            base = self._snapshot_base
            directory = None if base is None else base / f"world{len(self.worlds)}"
            current = World(directory, list(self.slots), current, layout)
            self.worlds.append(current)
            self.say(f"the job goes on with {len(self.slots)} ranks on slots {self.slots}")
        current.slots = list(self.slots)
        sources: list[World] = []
        if not self._complete(current):
            older = current.source
            while older is not None:
                sources.append(older)
                older = older.source
        return current, sources

    def _choose_layout(self, world: World) -> dict[str, Any] | None:
        """Odyssey's reroute-or-reconfigure for a job whose ranks noted a rigid grid with its
        layers (:mod:`failslow.core.planner.odyssey.rigid`): the new grid, the old ranks that
        go on in new rank order (``keep``) and the estimates. None for a job that did not note
        its layers (data-parallel jobs go on with every survivor)."""
        from failslow.core.checkpoint.layout_notes import read_notes
        from failslow.core.planner.odyssey.rigid import choose_rigid_layout, rigid_job_from_notes

        places = [
            (d, rank)
            for rank, slot in enumerate(world.slots)
            if (d := self._dir(world, slot)) is not None
        ]
        notes = read_notes(places)
        if not notes or not all(n.get("layers") for n in notes):
            return None
        job = rigid_job_from_notes(notes, len(world.slots))
        if job is None:
            self.say("the ranks' layout notes do not describe one grid: going on with every "
                     "survivor")  # fmt: skip
            return None
        lost = [world.slots.index(s) for s in self._dropping]
        choice = choose_rigid_layout(
            job, lost, min_ranks=self.options.min_ranks or 1,
            max_stage_layers=self.options.max_stage_layers,
        )  # fmt: skip
        options = ", ".join(f"{k} {v:.3f} s" for k, v in choice.alternatives.items())
        self.say(
            f"odyssey {choice.choice}: PP{job.pp}xDP{job.dp} -> {choice.name} on "
            f"{len(choice.keep)} ranks, step estimated {choice.step_time_s:.3f} s against "
            f"{choice.before_s:.3f} s before ({options})"
        )
        return {
            "tp": choice.tp, "pp": choice.pp, "dp": choice.dp, "choice": choice.choice,
            "estimated_s": choice.step_time_s, "before_s": choice.before_s,
            "alternatives": choice.alternatives, "keep": list(choice.keep),
        }  # fmt: skip

    def _complete(self, world: World) -> bool:
        """Whether every rank of ``world`` has a committed snapshot of its own (headers only)."""
        from failslow.core.checkpoint.restore import has_snapshot

        return world.directory is not None and all(
            (d := self._dir(world, slot)) is not None and has_snapshot(d, rank)
            for rank, slot in enumerate(world.slots)
        )

    def _dir(self, world: World, slot: int) -> Path | None:
        """Where ``slot``'s host keeps ``world``'s snapshots."""
        if world.directory is None:
            return None
        return world.directory / f"slot{slot}" if self.options.slots_as_hosts else world.directory

    def _memory(self, world: World, sources: list[World], slot: int) -> dict[str, str]:
        """A rank's host and node memory: its snapshot directory in ``world`` and, while the
        world restores from larger ones, theirs (``$FAILSLOW_RESHARD_FROM``)."""
        out: dict[str, str] = {}
        if self.options.slots_as_hosts:
            out[envvars.HOST] = f"{socket.gethostname()}-slot{slot}"
        directory = self._dir(world, slot)
        if directory is not None:
            out[envvars.SNAPSHOT_DIR] = str(directory)
        chain = [
            {"directory": str(old), "rank": w.slots.index(slot) if slot in w.slots else None}
            for w in sources
            if (old := self._dir(w, slot)) is not None
        ]
        if chain:
            out[envvars.RESHARD_FROM] = json.dumps(chain)
        if world.layout is not None:
            out[envvars.LAYOUT] = json.dumps(world.layout)
        return out

    def _failstop(self, record: FailStop) -> FailStop:
        replaced_by = None
        ranks_left = None
        gone = False
        if self.standby_slots:
            replaced_by = self.standby_slots.pop(0)
            self.evicted.append(record.slot)
            self.slots[record.rank - self.first_rank] = replaced_by
            gone = True
        elif record.cause in ("died", "hung", "replay", "checks", "declined") and self._may_drop():
            self._dropping.append(record.slot)
            self.evicted.append(record.slot)
            ranks_left = len(self.slots) - len(self._dropping)
            gone = True
        if gone and self.options.slots_as_hosts:
            # the evicted machine's memory is gone with it (its snapshots, the backups it held
            # for its wards), in every world it kept
            for world in self.worlds:
                directory = self._dir(world, record.slot)
                if directory is not None:
                    shutil.rmtree(directory, ignore_errors=True)
        record = FailStop(
            **{**asdict(record), "replaced_by": replaced_by, "ranks_left": ranks_left}
        )
        self.failstops.append(record)
        self.say(record.describe())
        for listener in self.listeners:
            listener(record)
        return record

    def same_job_next(self, command: list[str], env: dict[str, str], cwd: str | None) -> bool:
        """Whether the next launch runs the job as the last one did - the same world (no slot
        dropped), command, environment and code - after a fail-stop or a rollback, not a
        planned S4 restart or an update: its ranks' iteration times then go on measuring the
        same thing (:meth:`~failslow.core.tracking.analyzer.LocalAnalyzer.carry_over`)."""
        from failslow.core.control.stop import EXIT_FOR_RESTART, EXIT_FOR_UPDATE

        last = self.group
        if last is None or self._dropping or self._last_launch != _launch_of(command, env, cwd):
            return False
        return last.returncode not in (EXIT_FOR_RESTART, EXIT_FOR_UPDATE)

    @property
    def first_rank(self) -> int:
        """The job's rank of this node's first slot (0 on one node)."""
        nodes = self.options.nodes
        return 0 if nodes is None else nodes.node_rank * self.options.nproc

    @property
    def last_launch(self) -> int:
        """The index of the last launch started (``launches - 1``)."""
        return self.launches - 1

    def _remote_failure(self, stop: dict[str, Any]) -> None:
        status = int(stop["status"])
        how = f"signal {status - 128}" if status > 128 else f"status {status}"
        if stop.get("cause") == "incident":
            self.say(
                f"node {stop['node']}'s rank {stop['rank']} reported an incident (its metrics "
                "went bad): this node's ranks stop, and node 0's stop-time ladder decides "
                "for every node"
            )
            return
        what = {"hung": "hung (stack aggregation named it)",
                "declined": "slows the job (stack aggregation flagged its group)"}.get(
            str(stop.get("cause")), f"failed ({how})"
        )  # fmt: skip
        self.say(
            f"node {stop['node']}'s rank {stop['rank']} {what}: this node's ranks stop, and "
            "every node restarts from memory"
        )

    def _may_drop(self) -> bool:
        k = self.options.min_ranks
        return k is not None and len(self.slots) - len(self._dropping) - 1 >= k

    # -- the pool ------------------------------------------------------------------------------
    def _key(self, env: dict[str, str]) -> str:
        """What a warm process's start depended on: its whole environment but the per-launch
        variables and, unless a preload comes from it, the code version (a hot update of the
        code takes the warm spares; one that changes the environment gets fresh processes)."""
        if not preloads_code(self.options.preload, env.get(envvars.CODE_DIR)):
            env = _without_code(env)
        return json.dumps(sorted((k, v) for k, v in env.items() if k not in PER_LAUNCH))

    def _take(
        self, key: str, env: dict[str, str], pool: list[_Warm] | None = None,
        preload: tuple[str, ...] | None = None,
    ) -> _Warm:  # fmt: skip
        """A warm process of ``pool`` (default: the job's spares) started for ``key``, else a
        new one (importing ``preload``, default the job's)."""
        pool = self._pool if pool is None else pool
        while pool:
            warm = pool.pop(0)
            if warm.key == key and warm.process.poll() is None:
                warm.check()
                return warm
            self._retire(warm)
        return self._start(key, env, preload)

    def _take_check(self, key: str, env: dict[str, str]) -> _Warm:
        """A warm process for a stop-time check, else a cold one (torch only)."""
        return self._take(key, env, self._check_pool, CHECK_PRELOAD)

    def _preload(self, preload: tuple[str, ...] | None = None) -> tuple[str, ...]:
        return self.options.preload if preload is None else preload

    def _server(self, key: str, env: dict[str, str], preload: tuple[str, ...]) -> ForkServer:
        server = self._servers.get((key, preload))
        if server is not None:
            server.pump()  # a server that died is seen here
        if server is not None and server.gone and server.ready:
            server.close()  # died after its imports (said): a new one takes its place
            server = None
        if server is None:
            child_env = {k: v for k, v in env.items() if k not in PER_LAUNCH}
            server = ForkServer(self.options.python, child_env, preload, say=self.say)
            self._servers[(key, preload)] = server
        return server

    def _can_start(self, key: str, env: dict[str, str], preload: tuple[str, ...] | None) -> bool:
        """Whether :meth:`_start` returns at once (its fork server, if any, is ready)."""
        if not (self.options.fork_server and available()):
            return True
        return self._server(key, env, self._preload(preload)).check()

    def _start(
        self, key: str, env: dict[str, str], preload: tuple[str, ...] | None = None
    ) -> _Warm:
        if self.options.fork_server and available():
            server = self._server(key, env, self._preload(preload))
            try:
                forked, sock = server.fork()
            except FailslowError:
                if not (server.gone and server.ready):
                    raise  # its imports failed
                # it died (said) since it was last looked at: once more, with a new one
                forked, sock = self._server(key, env, self._preload(preload)).fork()
            return _Warm(forked, sock, key)
        ours, theirs = socket.socketpair()
        child_env = {k: v for k, v in env.items() if k not in PER_LAUNCH}
        child_env[envvars.WARM_FD] = str(theirs.fileno())
        child_env[envvars.WARM_PRELOAD] = ",".join(self._preload(preload))
        try:
            process = subprocess.Popen(
                [self.options.python, "-m", "failslow.node.warm"],
                env=child_env,
                pass_fds=(theirs.fileno(),),
                process_group=0,
            )
        except OSError as exc:
            ours.close()
            raise FailslowError(f"cannot start a rank process: {exc.strerror}") from None
        finally:
            theirs.close()
        return _Warm(process, ours, key)

    @staticmethod
    def _retire(warm: _Warm) -> None:
        """End a warm process that was never given a rank (it holds no state)."""
        warm.close()
        _signal_group(warm.process, signal.SIGKILL)
        warm.process.wait()

    def ready_spares(self, *, checks: bool = False) -> int:
        """Warm spares that finished their imports (``checks``: those for the stop-time
        checks)."""
        pool = self._check_pool if checks else self._pool
        for warm in pool:
            with contextlib.suppress(FailslowError):
                warm.check()
        return sum(w.ready for w in pool)

    def close(self) -> None:
        """End the warm pool, and the last launch's ranks if they still run (the launcher is
        leaving: nothing it started may outlive it)."""
        group, self.group = self.group, None
        if group is not None and group.poll() is None:
            group.signal_group(signal.SIGKILL)
            for _, process in group.ranks.values():
                process.wait()
        pool, self._pool = self._pool + self._check_pool, []
        self._check_pool = []
        for warm in pool:
            self._retire(warm)
        servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.close()
