"""What several end-to-end modules share: the demo jobs (DeepSpeed, Megatron, FSDP2, Accelerate)
run once without faults."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from failslow.demo.rank_launch import REFERENCE
from failslow.demo.worker_io import launch_env

REFERENCE_STEPS = 120
"""The DeepSpeed jobs compared with the reference end after fewer steps than this (by their
stop file or their step count); one reference run of the same job without faults serves them
all."""
MEGATRON_REFERENCE_STEPS = 140
"""The same for the Megatron GPT job: the fail-stop grid runs ~40 steps, the hot update 60, the
congested link's swap ~70-90, the straggler's mitigation ~90-120 (until 12 steps after its
revert, ``_s2_checks``)."""


def _reference_runs(
    tmp_path_factory: pytest.TempPathFactory, *, module: str, preload: str,
    micro_batch_size: str, minimum: int, load: Callable[[Path, int], Any],
    loader: str | None = None,
) -> Callable[[int], Any]:  # fmt: skip
    """``steps -> load(out, steps)`` over runs of the demo job ``module`` (4 ranks, the
    :data:`REFERENCE` settings: no snapshots) without faults that save the model after every step
    (``$FAILSLOW_DEMO_SAVE_EVERY_STEP``): one run, started by the first test that asks, of at
    least ``minimum`` steps; a longer job gets a longer run. Each run's last step is checked
    to be the job's final model (``load`` raises, or returns what the test compares).
    ``loader``: the worker's ``$FAILSLOW_DEMO_LOADER`` (where its ranks read their data)."""
    runs: list[tuple[int, Path]] = []

    def at(steps: int) -> Any:
        for have, out in runs:
            if steps <= have:
                return load(out, steps)
        tmp = tmp_path_factory.mktemp("reference")
        n = max(steps, minimum)
        out = tmp / "out"
        out.mkdir()
        env = launch_env(
            out, n, FAILSLOW_DEMO_CONFIG=json.dumps(REFERENCE),
            FAILSLOW_DEMO_MICRO_BATCH_SIZE=micro_batch_size, FAILSLOW_DEMO_SAVE_EVERY_STEP="1",
            **({"FAILSLOW_DEMO_LOADER": loader} if loader else {}),
        )  # fmt: skip
        command = [
            sys.executable, "-m", "failslow.cli", "run", "--no-shim", "--no-warm",
            "--ring-dir", str(tmp / "rings"), "--state-dir", str(tmp / "state"),
            "--snapshot-dir", str(tmp / "snapshots"), "--nproc-per-node", "4",
            "--preload", preload, "--", "-m", module,
        ]  # fmt: skip
        log = tmp / "reference.log"
        with log.open("w") as f:
            done = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=900, check=False)  # fmt: skip
        assert done.returncode == 0, log.read_text()[-3000:]
        runs.append((n, out))
        return load(out, steps)

    return at


def _equal(a: Any, b: Any) -> bool:
    return sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)


def _rank0_load(out: Path, steps: int) -> Any:
    """Step ``steps`` of a reference run whose rank 0 saved the parameters after every step
    (``parameters-step<N>.npz``); the run's last saved step must be its final model."""
    last = max(int(p.stem.split("step")[1]) for p in out.glob("parameters-step*.npz"))
    assert _equal(np.load(out / "parameters.npz"), np.load(out / f"parameters-step{last}.npz"))
    return np.load(out / f"parameters-step{steps}.npz")


@pytest.fixture(scope="session")
def deepspeed_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Any]:
    """The parameters of the DeepSpeed demo job (4 ranks, ZeRO-1, micro-batches of 32) run
    without faults, after a given number of steps (:func:`_reference_runs`; rank 0's saved
    each step). The job's math does not depend on how long it runs, where its ranks' hosts are
    or how they were launched (``failslow run --nproc-per-node``, torchrun, several nodes), so
    step N of a long run is the end of any N-step one."""

    return _reference_runs(
        tmp_path_factory, module="failslow.demo.ds_worker", preload="deepspeed",
        micro_batch_size="32", minimum=REFERENCE_STEPS, load=_rank0_load,
    )  # fmt: skip


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Any]:
    """The FSDP2 demo job (``failslow.demo.fsdp_worker``: HSDP over 2 replicas x 2 shards, 4
    micro-batches of 64 per replica) without faults, after a given number of steps: the full
    parameters rank 0 saved after every step, as :func:`deepspeed_reference`."""

    return _reference_runs(
        tmp_path_factory, module="failslow.demo.fsdp_worker", preload="torch",
        micro_batch_size="64", minimum=0, load=_rank0_load,
    )  # fmt: skip


@pytest.fixture(scope="session")
def accelerate_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Any]:
    """The Accelerate demo job (``failslow.demo.accelerate_worker``: Accelerate's own loop over
    the shuffled DataLoader it prepared, FSDP2 over 4 ranks through its plugin, 4 micro-batches
    of 64 per rank) without faults, after a given number of steps: the full parameters rank 0
    saved after every step, as :func:`deepspeed_reference`."""

    return _reference_runs(
        tmp_path_factory, module="failslow.demo.accelerate_worker", preload="accelerate",
        micro_batch_size="64", minimum=0, load=_rank0_load,
    )  # fmt: skip


@dataclass
class MegatronReference:
    """The Megatron GPT demo job without faults after some steps: each rank's model by
    Megatron's layout-free names (the worker's ``model-rank<r>.npz``) and its role."""

    parts: dict[int, Any]
    coords: dict[int, list[int]]
    """Each rank's (tp, pp, dp) coordinates in the job's own grid (every run starts in it)."""

    def model(self) -> dict[str, np.ndarray]:
        """Every rank's tensors in one dict (each held by one rank under its own name)."""
        return {k: part[k] for part in self.parts.values() for k in part.files}


@pytest.fixture(scope="session")
def megatron_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Any]:
    """The Megatron GPT demo job (TP1 x PP2 x DP2, 4 micro-batches of 8 per replica, hidden
    size 128: ``failslow demo --framework megatron``'s job, and the fail-stop tests') run
    without faults: a :class:`MegatronReference` after a given number of steps, as
    :func:`deepspeed_reference`. The failslow block and the launcher do not change its math:
    the mitigation demo's ranks, started by the demo, run the same job."""
    return _reference_runs(
        tmp_path_factory, module="failslow.demo.megatron_worker", preload="megatron.core",
        micro_batch_size="8", minimum=MEGATRON_REFERENCE_STEPS, load=_megatron_load,
    )  # fmt: skip


def _megatron_load(out: Path, steps: int) -> MegatronReference:
    """Step ``steps`` of a Megatron reference run (each rank's model and role); the run's last
    saved step must be its final model."""
    last = max(int(p.stem.split("-")[1][4:]) for p in out.glob("model-step*-rank0.npz"))
    for rank in range(4):
        final, saved = out / f"model-rank{rank}.npz", out / f"model-step{last}-rank{rank}.npz"
        assert _equal(np.load(final), np.load(saved)), rank
    return MegatronReference(
        parts={rank: np.load(out / f"model-step{steps}-rank{rank}.npz") for rank in range(4)},
        coords={
            rank: json.loads((out / f"steps-rank{rank}.json").read_text())["coords"]
            for rank in range(4)
        },
    )


@pytest.fixture(scope="session")
def megatron_own_loader_reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[int], Any]:
    """:func:`megatron_reference`'s job reading its data through the loop's own Megatron-LM
    iterator (``--loader own``) instead of ``fs.data_iterator``: the same samples per step, but
    not the same rounding - Megatron-LM's sampler interleaves the replicas' micro-batches
    (global micro-batch ``j``'s slice ``r``), ``fs.data_iterator`` gives each replica a
    contiguous block, so each replica sums other samples' gradients before the all-reduce; the
    two jobs differ by 1.02e-6 of a tensor's largest value after 91 fault-free steps (rank 2's
    ``linear_fc1.weight``), so a job on one is compared with a reference on the same one. One
    run, as long as the first test asks."""
    return _reference_runs(
        tmp_path_factory, module="failslow.demo.megatron_worker", preload="megatron.core",
        micro_batch_size="8", minimum=0, load=_megatron_load, loader="own",
    )  # fmt: skip
