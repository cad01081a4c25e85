"""The on-demand tracer: stack traces of a job's training processes and their children, taken
with py-spy, for stack aggregation (byterobust 5.1, 7: "implemented using py-spy").

A rank's own process is not the only place a hang sits: data loader workers and checkpoint
processes are its children, so each rank's process tree is walked (``/proc/<pid>/task/*/
children``) and every process in it is dumped (``py-spy dump --json``; ``--native`` where it
works, which adds the C/C++ frames a collective waits in). The dumps run in parallel, each with
a timeout; py-spy pauses a process only for the moment it reads its memory. A process py-spy
cannot read (not Python, gone, no permission) becomes an entry with its error, never a crash.

The training processes are found from the job's ring directory (each ring is named after its
rank and pid, :func:`rank_pids`), the topology from the control store's job record
(``failslow stacks``), and :func:`failslow.core.diagnosis.stacks.aggregate` does the rest.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from failslow.core.diagnosis.stacks import (
    CHILD,
    RANK,
    Aggregation,
    ProcessStack,
    frames_from_py_spy,
)
from failslow.core.topology import Topology
from failslow.errors import ConfigError

_RING = re.compile(r"^rank(\d+)-pid(\d+)(?:-py)?\.ring$")


def py_spy() -> str:
    """The py-spy executable (PATH, or beside this Python); ConfigError if there is none."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if not found:
        raise ConfigError("py-spy is not installed: pip install py-spy (or failslow[robust])")
    return found


def rank_pids(ring_dir: Path, exclude: Collection[int] = ()) -> dict[int, int]:
    """Each rank's live training process, from the ring names in ``ring_dir`` (the newest ring
    of a rank whose process still runs; ``exclude``: pids known gone, a signal in flight)."""
    found: dict[int, tuple[float, int]] = {}
    for path in Path(ring_dir).glob("rank*-pid*.ring"):
        match = _RING.match(path.name)
        if match is None:
            continue
        rank, pid = int(match.group(1)), int(match.group(2))
        if pid in exclude:
            continue
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if alive(pid) and (rank not in found or mtime > found[rank][0]):
            found[rank] = (mtime, pid)
    return {rank: pid for rank, (_, pid) in sorted(found.items())}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of all its threads, recursively)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(c) for c in children.read_text().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in out:
                    out.append(kid)
                    todo.append(kid)
    return out


def dump(pid: int, *, native: bool = False, timeout_s: float = 10.0) -> tuple[list, str]:
    """One process's threads as ``py-spy dump --json`` lists them, and "" - or ``[]`` and why
    not. With ``native`` the C/C++ frames too, falling back to Python frames where py-spy
    cannot unwind them."""
    command = [py_spy(), "dump", "--json", "--pid", str(pid)]
    attempts = [[*command, "--native"], command] if native else [command]
    why = ""
    for argv in attempts:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            why = f"py-spy took over {timeout_s:g} s"
            continue
        if done.returncode == 0:
            try:
                return json.loads(done.stdout), ""
            except ValueError:
                why = "py-spy printed no JSON"
                continue
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = f"py-spy: {lines[-1] if lines else f'exit {done.returncode}'}"
    return [], why


def capture(
    ranks: Mapping[int, int],
    *,
    native: bool = False,
    children: bool = True,
    timeout_s: float = 10.0,
    workers: int = 8,
) -> list[ProcessStack]:
    """The stacks of every rank's process (``ranks``: rank -> pid) and, with ``children``, of
    every process below it, dumped ``workers`` at a time."""
    targets = []
    for rank, pid in ranks.items():
        targets.append((rank, pid, RANK))
        if children:
            targets += [(rank, kid, CHILD) for kid in descendants(pid)]

    def one(target: tuple[int, int, str]) -> ProcessStack:
        rank, pid, kind = target
        threads, why = dump(pid, native=native, timeout_s=timeout_s)
        return ProcessStack(rank, pid, kind, frames_from_py_spy(threads, pid), error=why)

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(one, targets))


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_topology(store_url: str | None) -> Topology | None:
    """The topology in the job record of the control store at ``store_url`` (None: no URL)."""
    if not store_url:
        return None
    from failslow.core.control import keys
    from failslow.core.control.store import open_store

    with open_store(store_url) as store:
        job = store.get_json(keys.JOB)
    if not job or "topology" not in job:
        raise ConfigError(f"{store_url}: no job record with a topology yet")
    return Topology.from_dict(job["topology"])


def print_aggregation(found: Aggregation) -> None:
    """The groups as a table (healthy first), the outliers and what to over-evict."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="stack aggregation (byterobust 5.1): processes grouped by their stacks")
    for col in ("kind", "group", "processes", "ranks", "innermost frames"):
        table.add_column(col)
    for group in found.groups:
        verdict = {True: "healthy", False: "OUTLIER", None: "undecided"}[group.healthy]
        frames = " <- ".join(f.function for f in group.frames[:4])
        table.add_row(group.kind, verdict, str(group.processes), _ranges(group.ranks), frames)
    console = Console()
    console.print(table)
    for rank, pid, why in found.unreadable:
        console.print(f"rank {rank} pid {pid}: no stack ({why})")
    if found.undecided:
        console.print(f"no dominant group among {', '.join(found.undecided)} processes: "
                      "nothing to over-evict on this round")  # fmt: skip
    elif not found.outliers:
        console.print("every process of a kind shows the same stack: nothing stands out")
    elif found.suspects is not None:
        s = found.suspects
        where = f"machines {', '.join(s.hosts)}" if s.hosts else f"ranks {_ranges(s.ranks)}"
        console.print(
            f"outliers: ranks {_ranges(found.outliers)}; they share "
            f"{len(s.groups)} {s.kind.upper()} group(s) - over-evict {where}"
        )


def _ranges(ranks: Sequence[int]) -> str:
    """``0-3,8,10-11``."""
    parts: list[str] = []
    for r in ranks:
        if parts and "-" in parts[-1] and int(parts[-1].split("-")[1]) == r - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        elif parts and "-" not in parts[-1] and int(parts[-1]) == r - 1:
            parts[-1] = f"{parts[-1]}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)
