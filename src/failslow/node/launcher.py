"""``failslow run [options] -- CMD ...``: launch a training command with capture turned on.

greyhound 4.2 asks the Monitor to be transparent (R1): no change to the training code. This
launcher gets there from the outside. It starts CMD (``torchrun ...``, ``python train.py``,
``deepspeed ...``) with

* the LD_PRELOAD shim first in ``LD_PRELOAD`` (any existing entries kept after it), which
  records every NCCL call of every process;
* the Python hook turned on in every Python process of CMD (``FAILSLOW_CAPTURE=1`` and a
  ``sitecustomize`` first on ``PYTHONPATH`` that installs it once torch is imported), which
  records every torch.distributed call of any backend (gloo included);
* where the rings go and how they behave: ``FAILSLOW_RING_DIR``, ``FAILSLOW_RING_CAPACITY``
  and ``FAILSLOW_PAUSE_TIMEOUT_S`` (the pause trap's self-release, see ``trap.py``).

CMD runs in its own process group; SIGINT and SIGTERM sent to the launcher are forwarded to
that group, and the launcher returns CMD's exit status (128 + N when a signal N ended it).

The launcher is also the node agent of byterobust 6.1 (in-place hot update): CMD gets a
``FAILSLOW_SNAPSHOT_DIR`` (node-local, the same across restarts) for its in-memory snapshots, and
``failslow update submit --state-dir DIR`` asks the launcher to restart CMD in place with a new
command, environment or code directory (:mod:`failslow.node.hot_update.agent`); ``--max-restarts``
lets it restart CMD after failures too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from failslow import envvars
from failslow.errors import ConfigError, FailslowError
from failslow.runtime import SITE_DIR

if TYPE_CHECKING:
    from failslow.node.control import JobControl
    from failslow.node.hot_update.agent import AgentOptions
    from failslow.node.hot_update.version import Version

SHM = Path("/dev/shm")

PRELOAD_WITH = {
    # what any torch.optim optimizer imports when it is built: torch._dynamo, ~3 s here
    "torch": ("?torch._dynamo",),
    # failslow's adapter, and what deepspeed.initialize imports lazily (its ZeRO optimizer
    # check imports the Muon optimizer, which compiles at import)
    "deepspeed": ("failslow.deepspeed", "?deepspeed.runtime.zero.muon.muon_optimizer"),
    "megatron.core": ("failslow.megatron",),
    "accelerate": ("failslow.accelerate",),
}
"""What ``--preload`` of a module imports with it, so a warm rank's start-up finds it loaded
(``?``: skipped where this version of the framework does not have it)."""


def preloads(names: tuple[str, ...]) -> tuple[str, ...]:
    """What warm processes import for ``--preload names``: torch, each name and what it
    imports with it (:data:`PRELOAD_WITH`), once each, in that order."""
    preload: list[str] = []
    for name in ("torch", *names):
        for module in (name, *PRELOAD_WITH.get(name, ())):
            if module not in preload:
                preload.append(module)
    return tuple(preload)


@dataclass(kw_only=True, slots=True)
class RunOptions:
    """What ``failslow run`` was asked to do."""

    command: list[str] = field(default_factory=list)
    ring_dir: Path | None = None  # default: a fresh directory under /dev/shm (else the temp dir)
    capacity: int | None = None  # records per ring, a power of two
    pause_timeout_s: float | None = None
    shim: bool = True
    python_hook: bool = True
    controller_world_size: int | None = None
    """Run the job's controller in this launcher, for a job of this many ranks."""
    store_url: str | None = None
    """The job's control store, the same on every node (``redis://``, ``rediss://``,
    ``tcp://HOST:PORT``; ``tcp://HOST:PORT?master=1`` hosts it here). None: with
    ``--controller``, an embedded TCPStore on 127.0.0.1 (one node)."""
    job_token: str | None = None
    """The job's shared secret for pause requests and plans (generated when this launcher
    hosts the controller and none is given)."""
    threshold: float | None = None
    """The embedded controller's slow threshold (x the peers' median); None: the job's config
    (``detection.threshold``: ``FAILSLOW__DETECTION__THRESHOLD``, else greyhound 4.3's 1.1)."""
    state_dir: Path | None = None
    """Where the update history lives (default: the ring directory)."""
    snapshot_dir: Path | None = None
    """``FAILSLOW_SNAPSHOT_DIR`` (default: ``<ring dir>/snapshots`` when that is in /dev/shm)."""
    code_dir: Path | None = None
    """CMD's code directory (its working directory; hot updates may replace it)."""
    agent: AgentOptions = field(default_factory=lambda: _agent_options())
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: a free one); None: ``observe.metrics_port``
    of failslow's settings (``FAILSLOW__OBSERVE__METRICS_PORT``), else no endpoint."""
    metrics_addr: str | None = None
    """The metrics endpoint's address (default ``observe.metrics_addr``: 127.0.0.1)."""
    nproc_per_node: int | None = None
    """Start this many ranks here (CMD is ``script.py args`` or ``-m module args``), from warm
    processes, with fail-stop detection and standby slots (:mod:`failslow.node.ranks`); None:
    CMD is a command that starts its own ranks (``torchrun ...``)."""
    standbys: int = 0
    """Standby slots of ``nproc_per_node``: a failed rank's slot is evicted onto one."""
    min_ranks: int | None = None
    """With no standby left, a failed rank's slot is dropped and the job goes on with one rank
    fewer, resharded from memory, while at least this many are left (None: restart in place)."""
    max_stage_layers: int | None = None
    """With ``min_ranks``: the most transformer layers one rank can hold, bounding the layouts
    odyssey may choose for a job that reports its layers (Megatron-core); None: any."""
    hang_after_s: float = 300.0
    """No collective on any rank for this long is a hang: stack aggregation names the group to
    evict (:mod:`failslow.node.hang`); 0: not watched."""
    decline_every_s: float = 0.0
    """With ``--controller``: an unexplained slowdown (step time up, every rank healthy in the
    validation round) is localized by 5 rounds of stack aggregation this many seconds apart, and
    the group flagged in more than half of them evicted if the step time is still up
    (:mod:`failslow.node.decline`); 0: off."""
    stop_checks: bool = True
    """When a rank's metrics went bad, the stop-time checks on every machine come first, and
    the machines they name are evicted (:mod:`failslow.node.stop_checks`)."""
    preload: tuple[str, ...] = ()
    """Modules the warm rank processes import before they get a rank (torch always)."""
    warm: bool = True
    """Keep one warm spare per rank while the job runs."""
    fork_server: bool = True
    """Fork the rank processes from one that imported the preloads (:mod:`.fork_server`)."""
    spare_delay_s: float = 10.0
    """Warm spares start this long after a launch, one at a time."""
    slots_as_hosts: bool = False
    """Each slot a host with its own memory (one machine standing for several: tests, demos)."""
    nnodes: int = 1
    """Nodes of the job, each with its own launcher and ``nproc_per_node`` ranks, agreeing on
    every launch through ``--store`` (:mod:`failslow.node.nodes`)."""
    node_rank: int = 0
    node_addr: str = "127.0.0.1"
    """The address the other nodes reach this node at (node 0 hosts each launch's rendezvous
    there)."""
    rdzv_timeout_s: float = 600.0
    """How long a node waits for node 0's rendezvous of a launch."""


@dataclass(slots=True)
class Launch:
    """The resolved launch: the command with its executable found, and its environment."""

    argv: list[str]
    env: dict[str, str]
    ring_dir: Path
    shim: str | None
    snapshot_dir: Path | None = None


def default_ring_dir() -> Path:
    """``/dev/shm/failslow-<time>-<pid>`` when /dev/shm is usable, else the same in $TMPDIR."""
    base = (
        SHM if SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
    )
    return base / f"failslow-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def _shim_path() -> str:
    try:
        from failslow.nccl_hook.native import shim_path
    except ImportError as exc:
        raise FailslowError(
            f"the LD_PRELOAD shim is not part of this install ({exc}); run with --no-shim"
        ) from None
    try:
        return str(shim_path())
    except FailslowError as exc:
        text = str(exc)
        raise FailslowError(
            text if "--no-shim" in text else f"{text}; or run with --no-shim"
        ) from None


def _check_options(options: RunOptions) -> None:
    if not options.command:
        raise FailslowError("no command to run: failslow run [options] -- CMD [ARGS...]")
    if options.store_url is not None:
        from failslow.core.control.store import parse_store_url

        parse_store_url(options.store_url)  # a malformed URL is one line, before anything starts
        if not options.controller_world_size and not options.job_token:
            raise ConfigError(
                "failslow run --store without --controller: pass the job's token with "
                "--job-token (or $FAILSLOW_JOB_TOKEN), the same on every node's launcher"
            )
    cap = options.capacity
    if cap is not None and (cap <= 0 or cap & (cap - 1)):
        raise ConfigError(f"--capacity must be a positive power of two, got {cap}")
    if options.pause_timeout_s is not None and not options.pause_timeout_s > 0:
        raise ConfigError(f"--pause-timeout must be > 0 seconds, got {options.pause_timeout_s}")
    agent = options.agent
    if agent.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {agent.max_restarts}")
    for name, value in (
        ("--probation", agent.probation_s),
        ("--update-window", agent.window_s),
        ("--stop-timeout", agent.stop_timeout_s),
    ):
        if not value >= 0:
            raise ConfigError(f"{name} must be >= 0 seconds, got {value}")
    if not agent.poll_s > 0:
        raise ConfigError(f"--update-poll must be > 0 seconds, got {agent.poll_s}")
    if options.metrics_port is not None and not 0 <= options.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be a port (0-65535), got {options.metrics_port}")
    if options.code_dir is not None and not options.code_dir.is_dir():
        raise ConfigError(f"--code-dir {options.code_dir}: not a directory")
    local = options.nproc_per_node and options.controller_world_size
    if options.decline_every_s > 0 and not local and options.node_rank == 0:
        raise ConfigError(
            "--decline-every needs --nproc-per-node and --controller: the controller's "
            "validation round finds a slowdown unexplained, and the node's launcher dumps its "
            "ranks' stacks (with --nnodes: node 0's; the other nodes answer it)"
        )
    if options.nproc_per_node is not None:
        if options.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {options.nproc_per_node}")
        if options.standbys < 0:
            raise ConfigError(f"--standbys must be >= 0, got {options.standbys}")
        k = options.min_ranks
        if k is not None and not 1 <= k <= options.nproc_per_node:
            raise ConfigError(
                f"--min-ranks must be between 1 and --nproc-per-node "
                f"({options.nproc_per_node}), got {k}"
            )
        if not options.decline_every_s >= 0:
            raise ConfigError(
                f"--decline-every must be >= 0 seconds, got {options.decline_every_s}"
            )
        if not options.hang_after_s >= 0:
            raise ConfigError(f"--hang-after must be >= 0 seconds, got {options.hang_after_s}")
        layers = options.max_stage_layers
        if layers is not None and (k is None or layers < 1):
            raise ConfigError(
                f"--max-stage-layers needs --min-ranks and must be >= 1, got {layers}"
            )
        if not options.spare_delay_s >= 0:
            raise ConfigError(f"--spare-delay must be >= 0 seconds, got {options.spare_delay_s}")
        if options.command[0] == "-m" and len(options.command) < 2:
            raise FailslowError("failslow run --nproc-per-node: -m needs a module name")
        if options.command[0].startswith("-") and options.command[0] != "-m":
            raise FailslowError(
                f"failslow run --nproc-per-node runs SCRIPT or -m MODULE, got {options.command[0]}"
            )
        import importlib.util

        for name in options.preload:
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise ConfigError(f"--preload {name}: no such module in this Python")
    elif options.standbys or options.preload or options.slots_as_hosts or options.min_ranks:
        raise ConfigError(
            "--standbys, --min-ranks, --preload and --slots-as-hosts need --nproc-per-node"
        )
    _check_nodes(options)


def _check_nodes(options: RunOptions) -> None:
    """``--nnodes``: what several nodes' launchers need, and what they cannot do yet."""
    from failslow.node.nodes import NodeOptions

    if options.nnodes == 1 and options.node_rank == 0:
        return
    NodeOptions(nnodes=options.nnodes, node_rank=options.node_rank)  # the ranges, one line
    if options.nproc_per_node is None:
        raise ConfigError(
            "--nnodes needs --nproc-per-node (or run torchrun --nnodes under failslow run)"
        )
    if options.store_url is None:
        raise ConfigError("--nnodes needs --store: the job's store, the same on every node")
    if options.min_ranks is not None:
        raise ConfigError(
            "--min-ranks works on one node only (each node would reshape the world on its own)"
        )
    if not options.rdzv_timeout_s > 0:
        raise ConfigError(f"--rdzv-timeout must be > 0 seconds, got {options.rdzv_timeout_s}")


def _find_executable(name: str, env: Mapping[str, str]) -> str:
    if os.sep in name:
        if os.path.isfile(name) and os.access(name, os.X_OK):
            return name
    else:
        found = shutil.which(name, path=env.get("PATH", os.defpath))
        if found:
            return found
    raise FailslowError(f"{name!r} is not an executable command (looked on $PATH)")


def prepare(options: RunOptions, base_env: Mapping[str, str] | None = None) -> Launch:
    """Resolve the command and build its environment; creates the ring directory."""
    _check_options(options)
    env = dict(os.environ if base_env is None else base_env)
    if options.nproc_per_node is None:
        argv = [_find_executable(options.command[0], env), *options.command[1:]]
    else:  # what follows python in each rank (node/ranks.py)
        argv = list(options.command)
        script = Path(options.code_dir or ".") / argv[0]
        if argv[0] != "-m" and not script.is_file():
            raise FailslowError(f"{argv[0]!r}: no such script (failslow run --nproc-per-node)")
    shim = _shim_path() if options.shim else None
    ring_dir = (options.ring_dir or default_ring_dir()).absolute()
    try:
        ring_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FailslowError(
            f"cannot create the ring directory {ring_dir}: {exc.strerror}"
        ) from None
    env[envvars.RING_DIR] = str(ring_dir)
    snapshot_dir = (options.snapshot_dir or default_snapshot_dir(ring_dir)).absolute()
    env[envvars.SNAPSHOT_DIR] = str(snapshot_dir)
    if options.capacity is not None:
        env[envvars.RING_CAPACITY] = str(options.capacity)
    if options.pause_timeout_s is not None:
        env[envvars.PAUSE_TIMEOUT_S] = repr(float(options.pause_timeout_s))
    if shim is not None:
        previous = env.get("LD_PRELOAD", "").strip()
        kept = [p for p in previous.replace(" ", ":").split(":") if p and p != shim]
        env["LD_PRELOAD"] = ":".join([shim, *kept])
    if options.python_hook:
        env[envvars.CAPTURE] = "1"
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
        env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *paths])
    return Launch(argv, env, ring_dir, shim, snapshot_dir)


def default_snapshot_dir(ring_dir: Path) -> Path:
    """``<ring dir>/snapshots`` when the ring directory is in /dev/shm; else a directory in
    /dev/shm named after the ring directory, so a relaunch with the same rings finds it again."""
    ring_dir = ring_dir.absolute()
    if ring_dir.is_relative_to(SHM) or not SHM.is_dir():
        return ring_dir / "snapshots"
    tag = hashlib.sha256(str(ring_dir).encode()).hexdigest()[:10]
    return SHM / f"failslow-{ring_dir.name}-{tag}" / "snapshots"


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run(options: RunOptions) -> int:
    """Launch, wait (restarting CMD in place for hot updates), return CMD's exit status."""
    from failslow.node.hot_update.agent import Agent
    from failslow.node.hot_update.history import open_history
    from failslow.node.hot_update.version import Version, code_version

    launch = prepare(options)
    say = _stderr_line
    say(f"rings in {launch.ring_dir}")
    say(
        f"LD_PRELOAD shim: {launch.shim or 'off'}; Python hook: "
        f"{'on' if options.python_hook else 'off'}"
    )
    state_dir = (options.state_dir or launch.ring_dir).absolute()
    history = open_history(state_dir, create=True)
    launch.env[envvars.STATE_DIR] = str(state_dir)
    launcher = {"pid": os.getpid(), "started_at": time.time(), "ring_dir": str(launch.ring_dir)}
    history.set_job("launcher", {**launcher, "snapshot_dir": str(launch.snapshot_dir)})
    history.set_job("node", {"node_rank": options.node_rank, "nnodes": options.nnodes})
    say(f"snapshots in {launch.snapshot_dir}")
    if options.node_rank == 0:
        say(f"hot updates: failslow update submit --state-dir {state_dir} ...")
    else:
        say("hot updates: submit them to node 0's launcher (every node runs its version)")
    code_dir = str(options.code_dir.absolute()) if options.code_dir else None
    base = Version(
        command=tuple(options.command),
        code_dir=code_dir,
        code_version=code_version(code_dir) if code_dir else None,
    )
    metrics = _metrics_endpoint(options)
    control = (
        _job_control(options, launch, metrics)
        if options.controller_world_size or options.store_url
        else None
    )
    spawn_options: dict[str, Any] = (
        {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    )
    nodes = _node_group(options, launch.env[envvars.STORE]) if options.nnodes > 1 else None
    ranks = _local_ranks(options, state_dir, nodes) if options.nproc_per_node else None

    def spawn(version: Version, env: dict[str, str]) -> Any:
        if nodes is not None and ranks is not None:  # every node at node 0's version
            version, env = _node_version(nodes, ranks.launches, version, env, launch.env)
        if ranks is not None:
            if control is not None and control.publisher is not None:
                # the same job again after a fail-stop: its detectors go on (no warm-up, and a
                # slower standby is a change they see)
                same = ranks.same_job_next(list(version.command), env, version.code_dir)
                control.publisher.analyzer.carry_over(same)
            group = ranks.spawn(list(version.command), env, version.code_dir)
            if control is not None:
                control.start()
                _publish_standbys(control.store, ranks)
            return group
        name = version.command[0]
        if version.code_dir and os.sep in name and not os.path.isabs(name):
            name = os.path.join(version.code_dir, name)
        executable = _find_executable(name, env)
        try:
            child = subprocess.Popen(
                [executable, *version.command[1:]], env=env, cwd=version.code_dir, **spawn_options
            )
        except OSError as exc:
            raise FailslowError(f"cannot start {version.command[0]!r}: {exc.strerror}") from None
        if control is not None:
            control.start()  # once, with the first launch (idempotent)
        return child

    agent = Agent(
        history,
        base,
        launch.env,
        spawn,
        options=replace(options.agent, follower=options.node_rank != 0),
        store=control.store if control is not None and options.controller_world_size else None,
        say=say,
    )
    if nodes is not None and ranks is not None:  # one stop-time ladder: node 0's
        agent.ladder.across(nodes, lambda: ranks.last_launch)
    if ranks is not None:
        ranks.listeners.append(lambda _: agent.incidents.update(["failstop"]))
        if control is not None and control.plane is not None:
            control.plane.observers.append(decline_trigger(ranks))
            if control.publisher is not None:
                ranks.step_time = control.publisher.step_time
        if launch.snapshot_dir is not None and options.nnodes == 1:
            agent.replay = _replayer(ranks, state_dir, say)
        if launch.snapshot_dir is not None and options.stop_checks:
            agent.check = _checker(ranks, state_dir, say, nodes)
    try:
        if metrics is not None:
            _node_metrics(metrics[0], control, launch, state_dir, agent)
            server = metrics[1].start()
            say(f"metrics on {server.url}")
        status = agent.run()
    finally:
        if ranks is not None:
            ranks.close()
        if nodes is not None:
            nodes.store.close()
        if metrics is not None:
            metrics[1].stop()
        if control is not None:
            control.stop()
            control.store.close()
        history.close()
    say(
        f"{' '.join(options.command[: 2 if options.command[0] == '-m' else 1])} exited with "
        f"status {status}; rings kept in {launch.ring_dir} "
        f"(failslow export {launch.ring_dir}; failslow report {launch.ring_dir})"
    )
    return status


def _replayer(ranks: Any, state_dir: Path, say: Any) -> Any:
    """The agent's replay rung on this node's ranks (:mod:`failslow.node.replay`): the
    machines it names are evicted (standby, ``--min-ranks`` drop, or in place)."""
    from failslow.config import load_config
    from failslow.node import replay

    def run(version: Any, env: dict[str, str], until: int, incident: dict[str, Any]) -> Any:
        outcome = replay.run(
            ranks, list(version.command), env, version.code_dir, until=until,
            incident=incident, state_dir=state_dir, jump=load_config().checks.jump, say=say,
        )  # fmt: skip
        for rank in sorted(outcome.suspects):
            ranks.evict(rank, "replay")
        return outcome

    return run


def decline_trigger(ranks: Any) -> Callable[[dict[str, Any]], None]:
    """The controller's observer that starts the node's decline watch (byterobust 5.1,
    :mod:`failslow.node.decline`): a validation round for a new onset that found every rank
    healthy - the step time is up and nothing was localized - triggers it, with the levels of
    the latest onset (its step time before and after); a relief (the step time came back) or a
    diagnosis (the fail-slow path localized it) cancels it."""
    levels: list[float | None] = [None, None]

    def observe(ev: dict[str, Any]) -> None:
        watch = ranks.decline_watch
        if watch is None:
            return
        detail = ev.get("detail") or {}
        if ev.get("kind") == "onset" and ev.get("type") == "onset":
            levels[:] = [ev.get("before_s"), ev.get("after_s")]
        elif ev.get("kind") == "state" and ev.get("state") == "diagnosed":
            if detail.get("healthy") and not detail.get("recheck"):
                watch.trigger("the step time is up and the validation round found every "
                              "rank's GEMM and links healthy", *levels)  # fmt: skip
        elif (ev.get("kind") == "onset" and ev.get("type") == "relief") or (
            ev.get("kind") == "diagnosis"
        ):  # the step time came back, or the fail-slow path localized it after all
            watch.cancel()

    return observe


def _checker(ranks: Any, state_dir: Path, say: Any, nodes: Any = None) -> Any:
    """The agent's stop-time checks on the job's machines (:mod:`failslow.node.stop_checks`;
    with several nodes, every node's): the machines they name on this node are evicted
    (standby, ``--min-ranks`` drop, or in place)."""
    from failslow.node import stop_checks

    def run(env: dict[str, str], incident: dict[str, Any]) -> Any:
        outcome = stop_checks.run(
            ranks, env, incident=incident, state_dir=state_dir, say=say, nodes=nodes
        )
        mine = range(ranks.first_rank, ranks.first_rank + len(ranks.slots))
        for rank in sorted(r for r in outcome.suspects if r in mine):
            ranks.evict(rank, "checks")
        return outcome

    return run


def _publish_standbys(store: Any, ranks: Any) -> None:
    """This node's free standby slots, for the planner (S4 evicts no more hosts than they can
    replace): one store write per launch."""
    import socket

    from failslow.core.control import keys

    node = os.environ.get(envvars.HOST) or socket.gethostname()
    record = {"free": len(ranks.standby_slots), "slots": list(ranks.standby_slots)}
    try:
        store.set_json(f"{keys.STANDBYS}/{node}", {**record, "wall": time.time()})
    except FailslowError as exc:  # a store that is down leaves the controller blind as well
        _stderr_line(f"could not publish the free standby slots ({exc})")


def _node_group(options: RunOptions, url: str) -> Any:
    """This node's part in a job of several (``--nnodes``), joined to the job's run: its own
    connection to the job's store, waited for up to ``--rdzv-timeout`` (node 0's launcher may
    host the store and start later)."""
    from failslow.core.control.store import StoreUnavailable, open_store
    from failslow.node.nodes import NodeGroup, NodeOptions

    node = NodeOptions(nnodes=options.nnodes, node_rank=options.node_rank,
                       addr=options.node_addr, rdzv_timeout_s=options.rdzv_timeout_s)  # fmt: skip
    deadline = time.monotonic() + options.rdzv_timeout_s
    while True:
        try:
            store = open_store(url)
            break
        except StoreUnavailable as exc:
            if time.monotonic() > deadline:
                raise FailslowError(f"node {options.node_rank}: {exc}") from None
            time.sleep(1.0)
    group = NodeGroup(node, store, say=_stderr_line)
    run = group.join()
    n = options.nproc_per_node or 0
    _stderr_line(
        f"node {options.node_rank} of {options.nnodes} (run {run}): ranks "
        f"{options.node_rank * n}-{options.node_rank * n + n - 1} of {options.nnodes * n}; "
        "every launch starts together with the other nodes', node 0 looks at a hang or an "
        "unexplained slowdown across them, and node 0's stop-time ladder decides every "
        "node's rung after an incident (its stop-time checks test every node's machines; "
        "replay works on one node only: off)"
    )
    return group


def _node_version(
    nodes: Any, launch: int, version: Version, env: dict[str, str], base: dict[str, str]
) -> tuple[Version, dict[str, str]]:
    """Launch ``launch``'s version on this node: node 0's (:meth:`NodeGroup.version`), with
    its environment (``base``: the launcher's) and the launch's count and rollback step (the
    ladder's ``$FAILSLOW_ROLLBACK_BEFORE``: node 0's rung) - node 0 publishes its own."""
    from failslow.node.hot_update.version import Version

    published = Version.from_dict(nodes.version(launch, version.to_dict()))
    if published == version:
        return version, env
    if published.code_dir is not None and not Path(published.code_dir).is_dir():
        raise FailslowError(
            f"node {nodes.node_rank}: node 0 runs launch {launch} from "
            f"{published.code_dir!r}, which this node does not have (put the update's code "
            "directory at the same path on every node)"
        )
    _stderr_line(f"node {nodes.node_rank}: launch {launch} runs at node 0's version")
    from failslow.node.ranks import PER_LAUNCH

    # this node's own update id would name an update of its own history: none
    this_launch = {k: env[k] for k in PER_LAUNCH - {envvars.UPDATE_ID} if k in env}
    return published, {**published.environment(base), **this_launch}


def _local_ranks(options: RunOptions, state_dir: Path, nodes: Any = None) -> Any:
    """The node's ranks (``--nproc-per-node``); each fail-stop is also a line of
    ``<state dir>/failstops.jsonl``."""
    import json
    from dataclasses import asdict

    from failslow.node.ranks import LocalRanks, RankOptions

    assert options.nproc_per_node is not None
    preload = preloads(options.preload)
    ranks = LocalRanks(
        RankOptions(
            nproc=options.nproc_per_node,
            standbys=options.standbys,
            min_ranks=options.min_ranks,
            max_stage_layers=options.max_stage_layers,
            hang_after_s=options.hang_after_s,
            preload=preload,
            warm=options.warm,
            fork_server=options.fork_server,
            kill_grace_s=options.agent.kill_grace_s,
            refill_delay_s=options.spare_delay_s,
            slots_as_hosts=options.slots_as_hosts,
            check_spares=options.warm and options.stop_checks,
            decline_every_s=options.decline_every_s,
            nodes=nodes,
        ),
        say=_stderr_line,
    )
    _stderr_line(
        f"{options.nproc_per_node} ranks on slots 0-{options.nproc_per_node - 1}, "
        f"{options.standbys} standby slots; warm processes preload "
        f"{', '.join(m.lstrip('?') for m in preload)}"
    )
    log = state_dir / "failstops.jsonl"

    def record(failstop: Any) -> None:
        with log.open("a") as f:
            f.write(json.dumps(asdict(failstop)) + "\n")

    ranks.listeners.append(record)
    return ranks


def _agent_options() -> AgentOptions:
    from failslow.node.hot_update.agent import AgentOptions

    return AgentOptions()


def _metrics_endpoint(options: RunOptions) -> tuple[Any, Any] | None:
    """The registry and (not yet started) server of ``--metrics-port``, else of
    ``observe.metrics_port``; None when neither asks for one."""
    from failslow.config import load_config

    observe = load_config().observe
    port = options.metrics_port if options.metrics_port is not None else observe.metrics_port
    if port is None:
        return None
    from failslow.observe.metrics import MetricsServer, new_registry

    registry = new_registry()
    addr = options.metrics_addr or observe.metrics_addr
    return registry, MetricsServer(registry, port=port, addr=addr)


def _node_metrics(
    registry: Any, control: JobControl | None, launch: Launch, state_dir: Path, agent: Any
) -> None:
    """This node's collector: its ranks' tracker state (the publisher's), its snapshot
    directory, the job's update history and the agent's incidents - read at scrape time."""
    from failslow.node.hot_update.history import open_history
    from failslow.observe.metrics import NodeCollector

    publisher = control.publisher if control is not None else None

    def updates() -> list[str]:
        with open_history(state_dir) as history:  # sqlite: a connection for this thread
            return [u.outcome for u in history.updates()]

    registry.register(
        NodeCollector(
            rank_states=(lambda: publisher.latest_states) if publisher is not None else None,
            snapshot_dir=launch.snapshot_dir,
            updates=updates,
            incidents=lambda: dict(agent.incidents),
        )
    )


def _job_control(
    options: RunOptions, launch: Launch, metrics: tuple[Any, Any] | None = None
) -> JobControl:
    """This node's part of the job's control, started with CMD: the node publisher over this
    node's rings and, with ``--controller N``, the job's controller and mitigator. The store is
    ``--store`` (every node the same) or, without it, an embedded TCPStore on 127.0.0.1; CMD's
    ranks get its URL (``FAILSLOW_STORE``) and the job's token (``FAILSLOW_JOB_TOKEN``)."""
    import secrets

    from failslow.config import load_config
    from failslow.core.control.resilient import ResilientStore
    from failslow.core.control.store import open_store, parse_store_url, redacted
    from failslow.node.control import JobControl, host_store

    say = _stderr_line
    world_size = options.controller_world_size
    token = options.job_token
    if not token:  # _check_options made sure this launcher hosts the controller
        token = secrets.token_hex(16)
        if options.store_url:
            say(f"job token {token}: pass --job-token {token} to every other node's launcher")
    url = options.store_url
    if url is None:
        store: Any = host_store()
    elif parse_store_url(url)[3].get("master") == "1":
        store = open_store(url)  # this launcher hosts the TCPStore every node uses
    else:
        store = ResilientStore(url)  # a store that dies never takes the launcher down
    launch.env[envvars.STORE] = store.url if url is None or "master=1" in url else url
    launch.env[envvars.JOB_TOKEN] = token
    options.agent.job_token = token
    if world_size:
        options.agent.world_size = world_size
    log_dir = launch.ring_dir / "diagnoses"
    overrides: dict[str, Any] = {"job_token": token}
    if options.threshold is not None:  # else the environment's setting, or the default
        overrides["detection.threshold"] = options.threshold
    observers = []
    if metrics is not None and world_size:
        from failslow.observe.metrics import ControlMetrics

        observers.append(ControlMetrics(metrics[0]))
    control = JobControl(
        store,
        load_config(overrides=overrides),
        world_size=world_size,
        ring_dir=launch.ring_dir,
        log_dir=log_dir,
        on_diagnosis=lambda d: say(f"diagnosis {d.to_json()}"),
        observers=observers,
    )
    where = redacted(url) if url else f"embedded, {store.url}"
    if world_size:
        say(f"controller ({world_size} ranks), store {where}; diagnoses in {log_dir}")
        say(f"watch it: failslow top --store {redacted(launch.env[envvars.STORE])}")
    else:
        say(f"node publisher, store {where}")
    return control


def _stderr_line(text: str) -> None:
    print(f"failslow run: {text}", file=sys.stderr, flush=True)
