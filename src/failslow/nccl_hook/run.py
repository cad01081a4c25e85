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
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from failslow.errors import ConfigError, FailslowError
from failslow.nccl_hook.capture import RING_CAPACITY_ENV, RING_DIR_ENV, STORE_ENV
from failslow.nccl_hook.trap import PAUSE_TIMEOUT_ENV

CAPTURE_ENV = "FAILSLOW_CAPTURE"  # the name failslow.nccl_hook.auto reads
SITE_DIR = Path(__file__).resolve().parent / "_site"
SHM = Path("/dev/shm")


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
    """Run the controller embedded in the launcher for a job of this many ranks (one node)."""
    threshold: float = 1.1
    """The embedded controller's slow threshold (x the peers' median; greyhound 4.3: 1.1)."""


@dataclass(slots=True)
class Launch:
    """The resolved launch: the command with its executable found, and its environment."""

    argv: list[str]
    env: dict[str, str]
    ring_dir: Path
    shim: str | None


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
    cap = options.capacity
    if cap is not None and (cap <= 0 or cap & (cap - 1)):
        raise ConfigError(f"--capacity must be a positive power of two, got {cap}")
    if options.pause_timeout_s is not None and not options.pause_timeout_s > 0:
        raise ConfigError(f"--pause-timeout must be > 0 seconds, got {options.pause_timeout_s}")


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
    executable = _find_executable(options.command[0], env)
    shim = _shim_path() if options.shim else None
    ring_dir = (options.ring_dir or default_ring_dir()).absolute()
    try:
        ring_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FailslowError(
            f"cannot create the ring directory {ring_dir}: {exc.strerror}"
        ) from None
    env[RING_DIR_ENV] = str(ring_dir)
    if options.capacity is not None:
        env[RING_CAPACITY_ENV] = str(options.capacity)
    if options.pause_timeout_s is not None:
        env[PAUSE_TIMEOUT_ENV] = repr(float(options.pause_timeout_s))
    if shim is not None:
        previous = env.get("LD_PRELOAD", "").strip()
        kept = [p for p in previous.replace(" ", ":").split(":") if p and p != shim]
        env["LD_PRELOAD"] = ":".join([shim, *kept])
    if options.python_hook:
        env[CAPTURE_ENV] = "1"
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
        env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *paths])
    return Launch([executable, *options.command[1:]], env, ring_dir, shim)


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run(options: RunOptions) -> int:
    """Launch, wait, return the command's exit status."""
    launch = prepare(options)
    say = _stderr_line
    say(f"rings in {launch.ring_dir}")
    say(
        f"LD_PRELOAD shim: {launch.shim or 'off'}; Python hook: "
        f"{'on' if options.python_hook else 'off'}"
    )
    spawn: dict[str, Any] = (
        {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    )
    if options.controller_world_size:
        _host_control_store(launch)
    try:
        child = subprocess.Popen(launch.argv, env=launch.env, **spawn)
    except OSError as exc:
        raise FailslowError(f"cannot start {options.command[0]!r}: {exc.strerror}") from None

    embedded = _Embedded(options, launch) if options.controller_world_size else None

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if embedded is not None:
            embedded.start()
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if embedded is not None:
            embedded.stop()
    status = _exit_status(returncode)
    say(
        f"{options.command[0]} exited with status {status}; rings kept in {launch.ring_dir} "
        f"(failslow export {launch.ring_dir})"
    )
    return status


_control: dict[str, Any] = {}


def _host_control_store(launch: Launch) -> None:
    """The embedded control store (a TCPStore on 127.0.0.1, port 0) the ranks' agents use."""
    from failslow.core.control.store import open_store

    store = open_store("tcp://127.0.0.1:0?master=1")
    _control["store"] = store
    launch.env[STORE_ENV] = f"tcp://127.0.0.1:{store.port}"  # type: ignore[attr-defined]


class _Embedded:
    """The job's control plane beside it (publisher, controller, mitigator; one-node jobs)."""

    def __init__(self, options: RunOptions, launch: Launch) -> None:
        self.options, self.launch = options, launch
        self.plane: Any = None

    def start(self) -> None:
        from failslow.config import load_config
        from failslow.control_plane import ControlPlane

        assert self.options.controller_world_size is not None
        log_dir = self.launch.ring_dir / "diagnoses"
        config = load_config(overrides={"detection.threshold": self.options.threshold})
        say = _stderr_line
        self.plane = ControlPlane(
            _control["store"],
            config,
            world_size=self.options.controller_world_size,
            ring_dir=self.launch.ring_dir,
            log_dir=log_dir,
            on_diagnosis=lambda d: say(f"diagnosis {d.to_json()}"),
        ).start()
        say(
            f"controller embedded ({self.options.controller_world_size} ranks); "
            f"diagnoses in {log_dir}"
        )

    def stop(self) -> None:
        if self.plane is not None:
            self.plane.stop()


def _stderr_line(text: str) -> None:
    print(f"failslow run: {text}", file=sys.stderr, flush=True)
