"""A topology swap that fails on one rank rolls every rank back (DESIGN.md: a failed
mitigation never corrupts training state): 4 CPU ranks on gloo, the GPT job on TP1 x PP2 x DP2,
``model_provider`` raising on rank 2 during the swap (after its own collectives: a provider that
fails before Megatron's optimizer all-gathers over every rank leaves the others waiting in it
until the process group's timeout - see the adapter's docstring). Every rank must report the
plan rolled back, keep its role, and train on to parameters bitwise equal to the run without a
plan."""

from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip(
    "megatron.core", reason="needs the Megatron extra: pip install failslow[megatron]"
)

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(400),
]

STEPS, SWAP_AT = 4, 2


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(FAILSLOW_HOST=f"host{rank}", FAILSLOW_DISABLE_PLUGIN_AUTOLOAD="1")
    import numpy as np
    import torch
    import torch.distributed as dist

    import failslow.megatron
    from failslow import hookimpl
    from failslow.core.planner.plans import TopologyPlan
    from failslow.demo.megatron_job import build_gpt, train_step

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    outcomes: list[str] = []

    class Outcomes:
        @hookimpl
        def failslow_on_plan_result(self, plan, step, outcome, detail):
            outcomes.append(getattr(outcome, "value", outcome))

    params = {}
    groups = []  # live process groups after each build: a rebuilt grid destroys the old one's
    for run in ("reference", "failed swap"):
        job = build_gpt(1, 2, seed=3)
        groups.append(len(dist.distributed_c10d._world.pg_map))
        provider = job.extra["model_provider"]

        calls = []

        def failing_provider(provider=provider, calls=calls):
            built = provider()  # its collectives (the optimizer all-gathers over every rank)
            calls.append(1)
            if rank == 2 and len(calls) == 1:  # the swap's build fails, the rollback's works
                raise RuntimeError("model_provider failed on purpose")
            return built

        fs = failslow.megatron.attach(
            job.model, job.optimizer, job.scheduler,
            model_provider=failing_provider if run == "failed swap" else provider,
            config={"capture": False}, num_microbatches=4,
            micro_batch_size=job.shape.micro_batch_size,
        )  # fmt: skip
        fs.session.pm.register(Outcomes())
        data = fs.data_iterator(job.dataset, seed=3)
        coords = fs.topology.coords
        if run == "failed swap":
            hosts = fs.topology.hosts
            fs.session.schedule(TopologyPlan(hosts=hosts[1:] + hosts[:1]), SWAP_AT)
        for _ in range(STEPS):
            train_step(job, fs, data)
        assert fs.topology.coords == coords, "the failed swap changed the placement"
        params[run] = {
            n: p.detach().numpy().copy() for n, p in job.model[0].module.named_parameters()
        }
        fs.close()
    groups.append(len(dist.distributed_c10d._world.pg_map))  # after the swap and its rollback
    np.savez(f"{out}/rank{rank}.npz", **{f"{r}/{n}": v for r, p in params.items()
                                         for n, v in p.items()})  # fmt: skip
    with open(f"{out}/rank{rank}.outcomes", "w") as f:
        f.write("\n".join(outcomes))
    with open(f"{out}/rank{rank}.groups", "w") as f:
        f.write(" ".join(map(str, groups)))
    dist.destroy_process_group()


def test_a_swap_that_fails_on_one_rank_rolls_every_rank_back(tmp_path):
    import numpy as np
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(4, port, str(tmp_path)), nprocs=4, start_method="spawn")
    for rank in range(4):
        outcomes = (tmp_path / f"rank{rank}.outcomes").read_text().splitlines()
        assert outcomes == ["rolled back"], f"rank {rank}: {outcomes}"
        # Megatron's destroy_model_parallel only forgets its groups; a rebuilt grid (a second
        # job in the process, a swap, its rollback) destroys them (grid.destroy_grid), or each
        # gloo group keeps its threads and sockets (the conformance world: 1,250 threads/rank)
        groups = (tmp_path / f"rank{rank}.groups").read_text().split()
        assert len(set(groups)) == 1, f"rank {rank}: live groups after each build {groups}"
        saved = np.load(tmp_path / f"rank{rank}.npz")
        names = [k.split("/", 1)[1] for k in saved.files if k.startswith("reference/")]
        assert names
        for name in names:
            assert np.array_equal(saved[f"failed swap/{name}"], saved[f"reference/{name}"]), (
                f"rank {rank}, {name}: differs after the rolled-back swap"
            )
