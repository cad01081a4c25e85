"""A Megatron-core job goes on in a new layout from a larger world's snapshots (odyssey III-IV;
failslow.adapters.megatron.reshard): the GPT job on TP1 x PP2 x DP2 (4 CPU ranks on gloo)
snapshots every rank at step 3 and trains on to step 6 - the reference. New worlds of fewer
ranks, built in another layout, are handed all four snapshots through
``failslow_restore_resharded`` and train steps 3-6 on the old global batch of 8 micro-batches:

- PP1 x DP3 (reconfigure: every rank holds the whole model, counts 3, 3, 2);
- PP2 x DP1 (the reroute that drops a pipeline: one replica runs all 8).

Each must end with the reference's parameters, within 1e-5 relative per tensor (measured
2e-7 and 9e-8: the gradient sums the same micro-batches in another grouping and order, fp32
rounding). Without the micro-batch weights (``m_r * D / M``) the DP3 run is off by 8e-3.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

pytest.importorskip(
    "megatron.core", reason="needs the Megatron extra: pip install failslow[megatron]"
)

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

SNAPSHOT_AT, STEPS, MICRO_BATCHES = 3, 6, 8


def _rank(rank: int, world: int, port: int, out: str, pp: int, phase: str) -> None:
    os.environ.update(FAILSLOW_HOST=f"host{rank}", FAILSLOW_DISABLE_PLUGIN_AUTOLOAD="1")
    import numpy as np
    import torch
    import torch.distributed as dist

    import failslow.megatron
    from failslow.demo.megatron_job import build_gpt, train_step

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    job = build_gpt(1, pp, seed=3)
    dp = world // pp
    fs = failslow.megatron.attach(
        job.model, job.optimizer, job.scheduler, config={"capture": False},
        num_microbatches=MICRO_BATCHES // dp if phase == "old" else 1,
        micro_batch_size=job.shape.micro_batch_size,
    )  # fmt: skip
    if phase == "old":
        data = fs.data_iterator(job.dataset, seed=3)
        for step in range(STEPS):
            if step == SNAPSHOT_AT:
                torch.save(fs.failslow_snapshot_state(step), f"{out}/state{rank}.pt")
            train_step(job, fs, data)
    else:
        states = [torch.load(f"{out}/state{r}.pt", weights_only=False) for r in range(4)]
        fs.failslow_restore_resharded(states=states, step=SNAPSHOT_AT, old_rank=rank)
        data = fs.data_iterator(job.dataset, seed=3)  # after the restore: the old batch's split
        assert fs.iteration == SNAPSHOT_AT
        for _ in range(SNAPSHOT_AT, STEPS):
            train_step(job, fs, data)
    ids = fs._layout_record()["model"][0]
    params = dict(job.model[0].state_dict())
    np.savez(
        f"{out}/{phase}-pp{pp}-rank{rank}.npz",
        **{f"{key}@{offset}": params[name].numpy() for name, (key, offset) in ids.items()},
    )
    fs.close()
    dist.destroy_process_group()


def _world(tmp: Path, world: int, pp: int, phase: str) -> dict[str, object]:
    import numpy as np
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _rank, args=(world, port, str(tmp), pp, phase), nprocs=world, start_method="spawn"
    )
    merged: dict[str, object] = {}
    for rank in range(world):
        saved = np.load(tmp / f"{phase}-pp{pp}-rank{rank}.npz")
        merged.update({k: saved[k] for k in saved.files})
    return merged


@pytest.fixture(scope="module")
def old_world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    tmp = tmp_path_factory.mktemp("megatron-reshard")
    return tmp, _world(tmp, 4, 2, "old")


@pytest.mark.parametrize(("world", "pp"), [(3, 1), (2, 2)], ids=["PP1xDP3", "PP2xDP1"])
def test_a_smaller_world_in_a_new_layout_trains_on_to_the_same_model(
    old_world: tuple[Path, dict[str, object]], world: int, pp: int
) -> None:
    import numpy as np

    tmp, reference = old_world
    resumed = _world(tmp, world, pp, "new")
    assert sorted(resumed) == sorted(reference)  # every tensor of the model, once
    worst = 0.0
    for key, ref in reference.items():
        ref, got = np.asarray(ref, dtype=np.float64), np.asarray(resumed[key], dtype=np.float64)
        error = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
        worst = max(worst, error)
        assert error <= 1e-5, f"{key}: {error:.2e} relative to the uninterrupted run"
    print(f"worst relative error {worst:.2e}")
