"""What every demo rank shares with the demo launcher (:mod:`failslow.demo.mitigation`): the
rendezvous, the stop file, the progress file the launcher injects by and the record it reads."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from failslow import envvars


@dataclass(frozen=True)
class WorkerEnv:
    """A demo rank's settings from the launcher's environment."""

    rank: int
    world: int
    steps: int
    per_replica: int
    out: Path


def worker_env() -> WorkerEnv:
    """Read RANK, WORLD_SIZE, FAILSLOW_DEMO_STEPS, FAILSLOW_DEMO_MICRO_BATCHES (per replica) and
    FAILSLOW_DEMO_OUT; with FAILSLOW_DEMO_CRASH_AT_START, end at once (a bad update in the
    hot-update tests). One torch thread per rank (the ranks share the machine's cores). Writes
    the rank's PID (``pid-rank<r>`` in the output directory): the demo slows a rank from outside,
    and under a launcher (torchrun, ``accelerate launch``) only the rank knows its process."""
    import torch

    if os.environ.get("FAILSLOW_DEMO_CRASH_AT_START"):
        raise SystemExit(f"rank {os.environ.get('RANK')}: crashing at start as configured")
    torch.set_num_threads(1)
    env = WorkerEnv(
        rank=int(os.environ["RANK"]),
        world=int(os.environ["WORLD_SIZE"]),
        steps=int(os.environ.get("FAILSLOW_DEMO_STEPS", "200")),
        per_replica=int(os.environ.get("FAILSLOW_DEMO_MICRO_BATCHES", "4")),
        out=Path(os.environ["FAILSLOW_DEMO_OUT"]),
    )
    (env.out / f"pid-rank{env.rank}").write_text(str(os.getpid()))
    return env


def launch_env(out: Path, steps: int, **extra: str) -> dict[str, str]:
    """The environment a launcher starts a demo worker with (what :func:`worker_env` reads):
    this process's without failslow's variables, one thread, DeepSpeed on the CPU, the steps,
    the output directory and ``extra``. The job's failslow block (``FAILSLOW_DEMO_CONFIG``, which
    the ranks put in their framework's config) is set as ``FAILSLOW__SECTION__KEY`` variables
    too, unless ``extra`` sets one itself: a ``failslow run --controller`` launcher reads its
    settings from the environment, and without them its controller planned with the defaults -
    every strategy - while the ranks were told none (issue 49: a micro-batch plan bought on a
    busy machine in a job whose model is compared bitwise)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW")}
    env.update(
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        FAILSLOW_DEMO_STEPS=str(steps),
        FAILSLOW_DEMO_OUT=str(out),
        **extra,
    )
    for name, value in settings_env(json.loads(extra.get("FAILSLOW_DEMO_CONFIG", "{}"))).items():
        env.setdefault(name, value)
    return env


def settings_env(settings: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``settings`` as ``FAILSLOW__SECTION__KEY`` variables (lists as JSON): how a launcher's
    controller takes a demo job's failslow block (the ranks read it from their framework's
    config as well)."""
    found: dict[str, str] = {}
    for key, value in settings.items():
        name = f"{prefix}__{key.upper()}" if prefix else f"{envvars.CONFIG_PREFIX}{key.upper()}"
        if isinstance(value, dict):
            found.update(settings_env(value, name))
        elif isinstance(value, list | tuple):
            found[name] = json.dumps(list(value))
        elif isinstance(value, bool):
            found[name] = "true" if value else "false"
        else:
            found[name] = str(value)
    return found


def announce_start(rank: int, resumed: int | None) -> None:
    """One line: fresh, or resumed from memory (a restart in place); ``FAILSLOW_DEMO_LOG_TAG``
    is the "code change" a hot update makes."""
    tag = os.environ.get("FAILSLOW_DEMO_LOG_TAG", "")
    start = "fresh" if resumed is None else f"resumed at step {resumed}"
    if os.environ.get("FAILSLOW_REPLAY"):  # failslow.replaying(): a group of the ladder's replay
        start = f"replaying from step {resumed}"
    # one write of the whole line: print writes the text and the newline apart, and ranks that
    # share an unbuffered log then interleave ("... step 176rank 1: ...")
    sys.stdout.write(f"{tag}rank {rank}: {start}\n")
    sys.stdout.flush()


def run_record(
    rank: int, step_end: list[float], first: int, resumed: int | None, adapter: Any
) -> dict[str, Any]:
    """What a worker reports of its run (``steps-rank<r>.json``): steps, resume, the split in
    effect and the plans its session received."""
    return {
        "rank": rank,
        "pid": os.getpid(),
        "step_end": step_end,
        "first_step": first,
        "resumed": resumed,
        "counts": list(adapter.split.counts),
        "replica": adapter.split.replica,
        "applied": applied_plans(adapter.session),
    }


def join_world(rank: int, world: int) -> None:
    """``init_process_group("gloo")`` through the launcher's TCPStore
    (``$FAILSLOW_DEMO_STORE_PORT`` on ``$FAILSLOW_DEMO_STORE_HOST``, default 127.0.0.1), else
    torchrun's environment."""
    import torch.distributed as dist

    if "FAILSLOW_DEMO_STORE_PORT" not in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        return
    store = dist.TCPStore(
        os.environ.get("FAILSLOW_DEMO_STORE_HOST", "127.0.0.1"),  # the link demo: the bridge
        int(os.environ["FAILSLOW_DEMO_STORE_PORT"]),
        world_size=world,
        is_master=False,
        timeout=timedelta(seconds=120),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def all_ranks_see(path: str) -> bool:
    """Whether every rank sees ``path`` now (one all-reduce: all stop at the same step)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(os.path.exists(path))])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def write_progress(out: Path, rank: int, step_end: list[float], first: int, step: int) -> None:
    """Rank 0's recent step times, ``progress-rank<r>.json`` (the launcher's view of the job;
    ``step_end[i]`` is when step ``first + i - 1`` ended, ``step_end[0]`` the start). Not
    written by a replay group (``failslow.replaying()``: each group has a rank 0 of its own,
    training steps the job already took; two of them once raced on one temporary file and one
    crashed), and through a temporary file of this process's own."""
    import failslow

    if failslow.replaying():
        return
    progress = out / f"progress-rank{rank}.json"
    tmp = progress.with_suffix(f".{os.getpid()}.tmp")
    recent = range(max(first, step - 31), step + 1)
    steps = [[s, step_end[s - first + 1] - step_end[s - first]] for s in recent]
    tmp.write_text(json.dumps({"steps": steps}))
    tmp.replace(progress)


def applied_plans(session: Any) -> list[list[Any]]:
    """``[plan epoch, apply step, committed]`` of every plan this rank's session received."""
    receiver = session.receiver
    return [[o[0], o[2], o[3]] for o in receiver.outcomes] if receiver else []


def finish(
    out: Path,
    rank: int,
    record: dict[str, Any],
    params: dict[str, Any],
    adapter: Any,
    *,
    every_rank: bool = False,
    suffix: str = "",
) -> None:
    """A worker's ending: its record (``steps-rank<r><suffix>.json``), the parameters (rank 0's
    as ``parameters.npz``; with ``every_rank`` each rank's as ``parameters-rank<r>.npz``), the
    adapter closed, and every rank out of the process group together."""
    import numpy as np
    import torch.distributed as dist

    (out / f"steps-rank{rank}{suffix}.json").write_text(json.dumps(record))
    if every_rank:
        np.savez(out / f"parameters-rank{rank}.npz", **params)
    if rank == 0:
        np.savez(out / "parameters.npz", **params)
    adapter.close()
    dist.barrier()
    dist.destroy_process_group()
