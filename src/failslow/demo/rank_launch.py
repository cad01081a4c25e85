"""The demo jobs under the node's rank launcher, as users run them (issue 16).

What the demos of the fail-stop half share - ``--fault kill`` (:mod:`failslow.demo.failstop`)
and the S4 restart of a slow rank (:mod:`failslow.demo.s4`): the command that starts the
4-rank job - DeepSpeed ZeRO-1 (:mod:`failslow.demo.ds_worker`) or Megatron-core's GPT on TP1 x
PP2 x DP2 (:mod:`failslow.demo.megatron_worker`), an in-memory snapshot and its backup on a
peer every step - under ``failslow run --controller N --nproc-per-node N --standbys S
--slots-as-hosts``, its environment, rank 0's progress, the live process of a rank, the
reference run without the fault and the comparison of the final parameters.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from failslow.demo.worker_io import launch_env
from failslow.errors import FailslowError

READY = "warm spares ready"
"""What the launcher says once every rank has a warm spare (a restart then skips imports)."""
SETTINGS = {"checkpoint": {"every_steps": 1}, "planner": {"strategies": ["S2"]}}
"""The job's failslow block: a snapshot (and its backup) every step."""
COMPARED = {**SETTINGS, "planner": {"strategies": []}}
"""The settings of a run whose model is compared with another's, bitwise: every-step snapshots,
no mitigation strategy. The control plane still detects and validates, but on shared cores it
can read noise as a straggler (a GEMM 1.5-2.3x its peers' under load), and a micro-batch plan in
one run and not the other changes the order of the gradient sums."""
REFERENCE: dict[str, Any] = {"planner": {"strategies": []}}
"""The settings of the run a :data:`COMPARED` run is checked against: the same job without
snapshots. Snapshots change nothing (invariant 4: the conformance suite checks it for every
adapter), and each comparison checks it again; an every-step snapshot and its backup cost the
DeepSpeed demo job's ranks ~40 ms of CPU per step on shared cores (0.145 s vs 0.225 s per step,
4 ranks on 2 cores, 2026-11-30), which a reference does not need to pay."""
RESUMED = re.compile(r"rank 0: resumed at step (\d+)")
"""Rank 0's line once a launch restored every rank from memory."""
WORKERS = {
    # framework: (the rank's module, what the warm processes preload, micro-batch size, title)
    "deepspeed": ("failslow.demo.ds_worker", "deepspeed", "32", "DeepSpeed ZeRO-1"),
    "megatron": ("failslow.demo.megatron_worker", "megatron.core", "8", "Megatron GPT PP2xDP2"),
}


def command(
    tmp: Path,
    name: str,
    *,
    world_size: int,
    standbys: int,
    restarts: int,
    threshold: float | None = None,
    min_ranks: int | None = None,
    framework: str = "deepspeed",
    hang_after_s: float | None = None,
    decline_every_s: float | None = None,
    controlled: bool = True,
) -> list[str]:
    """``failslow run`` of the demo job: rings, state and snapshots under ``tmp/<name>-*``,
    one spare per rank two seconds after each launch, one slot per host. ``controlled=False``:
    no controller and no warm processes (a reference run: nothing to detect or restart)."""
    module, preload, _, _ = WORKERS[framework]
    extra = ["--threshold", str(threshold)] if threshold is not None else []
    if controlled:
        extra += ["--controller", str(world_size), "--spare-delay", "2"]
    else:
        extra += ["--no-warm"]
    if hang_after_s is not None:
        extra += ["--hang-after", str(hang_after_s)]
    if decline_every_s is not None:
        extra += ["--decline-every", str(decline_every_s)]
    if min_ranks is not None:
        extra += ["--min-ranks", str(min_ranks)]
    return [
        sys.executable, "-m", "failslow.cli", "run", *extra,
        "--ring-dir", str(tmp / f"{name}-rings"), "--state-dir", str(tmp / f"{name}-state"),
        "--snapshot-dir", str(tmp / f"{name}-snapshots"), "--no-shim",
        "--nproc-per-node", str(world_size), "--standbys", str(standbys),
        "--preload", preload, "--slots-as-hosts",
        "--max-restarts", str(restarts),
        "--", "-m", module,
    ]  # fmt: skip


def job_env(
    job_out: Path,
    steps: int,
    framework: str = "deepspeed",
    settings: dict[str, Any] | None = None,
    **extra: str,
) -> dict[str, str]:
    """The demo job's environment, writing its progress and parameters to ``job_out``
    (``settings``: its failslow config, default :data:`SETTINGS`)."""
    job_out.mkdir(parents=True, exist_ok=True)
    return launch_env(
        job_out, steps, FAILSLOW_DEMO_CONFIG=json.dumps(SETTINGS if settings is None else settings),
        FAILSLOW_DEMO_MICRO_BATCH_SIZE=WORKERS[framework][2], **extra,
    )  # fmt: skip


def progress(job_out: Path) -> list[tuple[int, float]]:
    """Rank 0's recent ``(step, seconds)`` (the last 32 steps of the launch running now)."""
    try:
        steps = json.loads((job_out / "progress-rank0.json").read_text())["steps"]
    except (OSError, ValueError, KeyError):
        return []
    return [(int(s), float(t)) for s, t in steps]


def pid_of(rings: Path, rank: int, dead: set[int]) -> int | None:
    """The live process of ``rank`` (its newest ring is named after its pid), not one of
    ``dead``."""
    from failslow.node.stacks import rank_pids

    return rank_pids(rings, exclude=dead).get(rank)


def failstops(state_dir: Path) -> list[dict[str, Any]]:
    """The launcher's ``failstops.jsonl``: every rank that died or was evicted."""
    try:
        return [
            json.loads(line) for line in (state_dir / "failstops.jsonl").read_text().splitlines()
        ]
    except OSError:
        return []


def end(proc: subprocess.Popen[Any]) -> None:
    """End the launcher if it still runs (SIGTERM: it ends its ranks; SIGKILL after 30 s)."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()


def run_reference(
    tmp: Path, out: Path, steps: int, *, world_size: int, timeout_s: float,
    framework: str = "deepspeed",
) -> Path:  # fmt: skip
    """The same job without the fault, ``steps`` steps, into ``out/reference``, with the
    :data:`REFERENCE` settings (a micro-batch plan would change the model it stands for), on
    as many slots; without the controller, standbys, warm processes and snapshots, which only
    compete with its ranks for the cores (the math does not depend on them)."""
    ref_out = out / "reference"
    env = job_env(ref_out, steps, framework, REFERENCE)
    argv = command(
        tmp, "reference", world_size=world_size, standbys=0, restarts=0,
        framework=framework, controlled=False,
    )  # fmt: skip
    with open(out / "reference.log", "w") as log:
        done = subprocess.run(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
        )
    if done.returncode != 0:
        raise FailslowError(f"demo: the reference job failed; see {out / 'reference.log'}")
    return ref_out


def compare_parameters(
    got_dir: Path, want_dir: Path, tolerance: str, rtol: float | None = None
) -> dict[str, Any]:
    """The final model of two runs, compared bitwise - or with ``rtol``, within that relative
    tolerance per element (``rtol / 10`` absolute near zero) and per tensor norm. The model is
    rank 0's ``parameters.npz`` (data parallel: every rank holds it all), or the union of every
    rank's ``model-rank<r>.npz`` where the workers write one (Megatron: each rank holds a part,
    by names no layout changes, so runs in different grids compare)."""
    got, want = final_model(got_dir), final_model(want_dir)
    same_names = sorted(got) == sorted(want)
    names = [n for n in want if n in got]
    diffs = [float(np.max(np.abs(got[n] - want[n]))) for n in names]
    norms = [
        float(np.linalg.norm(got[n] - want[n]) / max(float(np.linalg.norm(want[n])), 1e-30))
        for n in names
    ]
    if rtol is None:
        equal = all(np.array_equal(got[n], want[n]) for n in names)
    else:
        equal = all(np.allclose(got[n], want[n], rtol=rtol, atol=rtol / 10) for n in names)
        equal = equal and max(norms, default=0.0) <= rtol
    return {
        "compared": True,
        "equal": same_names and equal,
        "max_abs_diff": max(diffs, default=float("inf")),
        "max_rel_norm_diff": max(norms, default=float("inf")),
        "tolerance": tolerance,
    }


def final_model(out: Path) -> dict[str, np.ndarray]:
    """A run's final model: every rank's ``model-rank<r>.npz`` merged, else ``parameters.npz``."""
    parts = sorted(out.glob("model-rank*.npz"))
    merged: dict[str, np.ndarray] = {}
    for path in parts or [out / "parameters.npz"]:
        saved = np.load(path)
        merged.update({k: saved[k] for k in saved.files})
    return merged


def restore_sources(log: str) -> list[dict[str, str]]:
    """Per launch that restored from memory: where each rank's state came from (``holder's
    backup`` when its slot was evicted with its memory, else ``own snapshot``; a smaller world
    that gathered a larger one's states: ``holder's backup, resharded onto N ranks`` for the
    old ranks named in its line, keyed by their old rank)."""
    launches: list[dict[str, str]] = []
    seen: set[str] = set()
    pattern = (
        r"failslow: rank (\d+) resumed (?:from (?:its )?(holder's backup|own snapshot)"
        r"|step \d+ of the \d+-rank world on (\d+) ranks \(old rank\(s\) ([^)]*) from)"
    )
    for rank, source, ranks, backups in re.findall(pattern, log):
        if rank in seen or not launches:  # a rank seen again: the next launch
            launches.append({})
            seen = set()
        seen.add(rank)
        if source:
            launches[-1][rank] = source
        else:
            for old in re.findall(r"\d+", backups):
                launches[-1][old] = f"holder's backup, resharded onto {ranks} ranks"
    return launches
