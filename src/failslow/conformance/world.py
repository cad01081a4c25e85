"""The test-process side of a conformance world: spawn the ranks, pause them, read the results.

The pytest process owns the TCPStore (127.0.0.1, port 0) and starts one
``python -m failslow.conformance.worker`` per rank, which imports the adapter's harness by
``module:Class``. While the ranks run, this process plays the validator's part of greyhound
4.3: when every rank stands at the pause scenario's handshake it requests the pause trap on
every rank's ring (:mod:`failslow.nccl_hook.trap`), lets the ranks go, waits until each one is
parked in its next collective, checks that nothing was recorded while parked, and releases them.
Afterwards it reads each rank's result files and its event ring (:mod:`failslow.core.ring`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from failslow import envvars
from failslow.conformance.harness import AdapterHarness
from failslow.core.events import CommEvent, GroupInfo, is_marker, records_to_events
from failslow.core.group_files import read_groups
from failslow.core.ring import RingReader, find_rings

PAUSE_S = 0.5
"""How long the ranks stay parked (unpaused, a rank records a call every few ms)."""
PARK_TIMEOUT_S = 30.0


class WorldError(AssertionError):
    """The world (or one layout of it) did not run to the end; carries the ranks' log tails."""


@dataclass
class RankRun:
    """What one rank recorded for one layout."""

    rank: int
    result: dict[str, Any]
    events: list[CommEvent]
    """The calls this rank recorded (step markers apart: :attr:`markers`)."""
    groups: dict[int, GroupInfo]
    out: Path
    markers: list[CommEvent] = field(default_factory=list)
    """The step markers of this rank's ring (:mod:`failslow.nccl_hook.step_marker`)."""

    def run(self, name: str) -> dict[str, Any]:
        return self.result["runs"][name]

    def window(self, name: str, step: int) -> list[CommEvent]:
        """This rank's calls issued during step ``step`` of run ``name``, in issue order."""
        t0, t1 = self.run(name)["windows"][step]
        return sorted(
            (e for e in self.events if t0 <= e.t_start_ns <= t1), key=lambda e: e.t_start_ns
        )

    def parameters(self, name: str) -> dict[str, np.ndarray]:
        layout = self.result["layout"]
        with np.load(self.out / f"{layout}.{name}.rank{self.rank}.npz") as data:
            return {key: data[key] for key in data.files}


@dataclass
class LayoutRun:
    layout: str
    ranks: list[RankRun]
    pause: dict[str, Any]
    """The test process's observations of the pause (see :func:`_pause_every_rank`)."""

    @property
    def capabilities(self) -> dict[str, str]:
        return self.ranks[0].result["capabilities"]


@dataclass
class World:
    layouts: dict[str, LayoutRun] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    self_releases: dict[int, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def layout(self, name: str) -> LayoutRun:
        if name in self.errors:
            raise WorldError(self.errors[name])
        if name not in self.layouts:
            raise WorldError(f"layout {name!r} was not run (ran: {sorted(self.layouts)})")
        return self.layouts[name]


def harness_path(harness: type[AdapterHarness]) -> tuple[str, Path]:
    """``module:QualName`` of the harness and the sys.path root its module imports from."""
    module = sys.modules[harness.__module__]
    if harness.__module__ == "__main__" or module.__file__ is None:
        raise WorldError(f"{harness.__qualname__}: the harness must live in an importable module")
    root = Path(module.__file__).resolve().parent
    if Path(module.__file__).name == "__init__.py":
        root = root.parent
    for _ in range(harness.__module__.count(".")):
        root = root.parent
    return f"{harness.__module__}:{harness.__qualname__}", root


def run_world(
    harness: type[AdapterHarness],
    tmp: Path,
    *,
    layouts: list[str] | None = None,
    timeout_s: float = 240.0,
) -> World:
    """Run every scenario of every layout in one spawned world of ``harness.world_size``."""
    import torch.distributed as dist

    instance = harness()
    world_size = int(instance.world_size)
    layouts = list(layouts if layouts is not None else instance.layouts())
    ring_dir, out, sync = tmp / "rings", tmp / "out", tmp / "sync"
    for d in (ring_dir, out, sync):
        d.mkdir(parents=True, exist_ok=True)
    path, root = harness_path(harness)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
    env.update(instance.rank_env())
    env.update(OMP_NUM_THREADS="1", FAILSLOW_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    t_start = time.monotonic()
    procs, logs = [], []
    for rank in range(world_size):
        logs.append(open(out / f"rank{rank}.log", "w"))  # closed below
        cmd = [
            sys.executable, "-m", "failslow.conformance.worker", "--harness", path,
            "--layouts", ",".join(layouts), "--rank", str(rank), "--world", str(world_size),
            "--port", str(store.port), "--ring-dir", str(ring_dir), "--out", str(out),
            "--sync", str(sync),
        ]  # fmt: skip
        rank_env = {**env, envvars.HOST: f"conformance-host{rank}"}  # a host per rank (S3)
        procs.append(
            subprocess.Popen(cmd, env=rank_env, stdout=logs[-1], stderr=subprocess.STDOUT)
        )
    pauses: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            for layout in layouts:
                if layout not in pauses and all(
                    (sync / f"{layout}.hold.rank{r}").exists() for r in range(world_size)
                ):
                    pauses[layout] = _pause_every_rank(ring_dir, sync / f"{layout}.go", world_size)
            time.sleep(0.005)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
        del store
    world = World(wall_s=time.monotonic() - t_start)
    _collect(world, layouts, procs, out, ring_dir, pauses, timed_out, timeout_s)
    return world


def _rings_by_rank(ring_dir: Path) -> dict[int, Path]:
    rings: dict[int, Path] = {}
    for path in find_rings(ring_dir):
        reader = RingReader(path)
        rank = reader.global_rank
        reader.close()
        if rank in rings:
            raise WorldError(f"two rings for rank {rank}: {rings[rank]} and {path}")
        rings[rank] = path
    return rings


def _pause_every_rank(ring_dir: Path, go: Path, world_size: int) -> dict[str, Any]:
    """Every rank stands at the handshake: pause them all at their next call, then release."""
    from failslow.nccl_hook import trap

    rings = _rings_by_rank(ring_dir)
    obs: dict[str, Any] = {"rings": len(rings)}
    if sorted(rings) != list(range(world_size)):
        obs["error"] = f"rings for ranks {sorted(rings)}, expected 0..{world_size - 1}"
        go.touch()
        return obs
    order = [rings[r] for r in range(world_size)]
    obs["parked_before"] = [trap.parked(ring) for ring in order]
    for ring in order:
        trap.request_pause(ring)
    go.touch()
    obs["parked"] = [trap.wait_parked(ring, timeout_s=PARK_TIMEOUT_S) for ring in order]
    readers = [RingReader(ring) for ring in order]
    obs["write_index_at_park"] = [r.write_index for r in readers]
    time.sleep(PAUSE_S)
    obs["write_index_after_pause"] = [r.write_index for r in readers]
    obs["parked_word"] = [trap.parked(ring) for ring in order]
    obs["pause_s"] = PAUSE_S
    obs["t_release_ns"] = time.monotonic_ns()  # before the first release: every later call
    for ring in order:
        trap.release(ring)
    for reader in readers:
        reader.close()
    return obs


def _tail(out: Path, rank: int) -> str:
    log = out / f"rank{rank}.log"
    return log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"


def _collect(
    world: World,
    layouts: list[str],
    procs: list[subprocess.Popen[bytes]],
    out: Path,
    ring_dir: Path,
    pauses: dict[str, dict[str, Any]],
    timed_out: bool,
    timeout_s: float,
) -> None:
    from failslow.nccl_hook import trap

    failed = {r: p.returncode for r, p in enumerate(procs) if p.returncode != 0}
    why = f"the world did not finish in {timeout_s:.0f} s" if timed_out else ""
    if failed and not why:
        why = f"ranks exited with {failed}"
    tails = "\n".join(f"--- rank {r} log ---\n{_tail(out, r)}" for r in failed)
    rings = _rings_by_rank(ring_dir)
    world.self_releases = {r: trap.self_releases(p) for r, p in rings.items()}
    events: dict[int, tuple[list[CommEvent], list[CommEvent], int]] = {}
    for rank, path in rings.items():
        reader = RingReader(path)
        records = reader.poll()
        marks = is_marker(records)
        events[rank] = (
            records_to_events(records[~marks]), records_to_events(records[marks]),
            reader.writer_dropped,
        )
        reader.close()
    for layout in layouts:
        ranks: list[RankRun] = []
        problem = ""
        for rank in range(len(procs)):
            path = out / f"{layout}.rank{rank}.json"
            if not path.exists():
                problem = f"layout {layout!r}: rank {rank} wrote no result ({why or 'no reason'})"
                break
            result = json.loads(path.read_text())
            if "error" in result:
                problem = f"layout {layout!r}: rank {rank} raised:\n{result['error']}"
                break
            if rank not in rings:
                problem = f"layout {layout!r}: rank {rank} has no event ring in {ring_dir}"
                break
            rank_events, markers, result["ring_dropped"] = events[rank]
            ranks.append(
                RankRun(rank, result, rank_events, read_groups(rings[rank]), out, markers)
            )
        if problem:
            world.errors[layout] = f"{problem}\n{tails}" if tails else problem
            continue
        world.layouts[layout] = LayoutRun(layout, ranks, pauses.get(layout, {}))
