"""S3 through the controller's channel into a running Megatron-core job (greyhound 5.2).

Four CPU ranks (gloo), each its own host (``FAILSLOW_HOST``), run the GPT job of
:mod:`failslow.demo.megatron_job` on TP1 x PP2 x DP2 with the Megatron-LM loop and
``failslow.megatron.attach(..., model_provider=...)``, twice in one world: a reference job
without failslow's store, then the same job connected to a real TCPStore. While the second job
trains, this test does what the controller's mitigator does with a topology plan: it reads the
job record rank 0 published, and ``dispatch``es a plan that rotates every role to the next
rank's host. Every rank must accept it, apply it at the agreed step boundary in place, and go
on in the loop it runs; afterwards each rank's parameters equal, bitwise, those of the
reference rank that held the same role, and the job record in the store holds the new layout
(what a restarted controller plans from). Run as a script, this file is one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "megatron.core", reason="needs the Megatron extra: pip install failslow[megatron]"
)

HERE = Path(__file__).resolve()
WORLD = 4
STEPS = 40
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(400)]


def _worker(rank: int, port: int, url: str, out: Path) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import failslow.megatron
    from failslow.demo.megatron_job import build_gpt, train_step
    from failslow.demo.worker_io import applied_plans

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    for run, config in (("reference", {}), ("swap", {"store": url})):
        job = build_gpt(1, 2, seed=5)
        fs = failslow.megatron.attach(
            job.model, job.optimizer, job.scheduler, model_provider=job.extra["model_provider"],
            config={**config, "capture": False}, num_microbatches=4,
            micro_batch_size=job.shape.micro_batch_size,
        )  # fmt: skip
        data = fs.data_iterator(job.dataset, seed=5)
        for _ in range(STEPS):
            train_step(job, fs, data)
            time.sleep(0.05)  # room for the plan's round trip on loaded cores
        params = {n: p.detach().numpy() for n, p in job.model[0].module.named_parameters()}
        np.savez(out / f"{run}.rank{rank}.npz", **params)
        record = {"coords": list(fs.topology.coords[rank]), "applied": applied_plans(fs.session)}
        (out / f"{run}.rank{rank}.json").write_text(json.dumps(record))
        fs.close()
        dist.barrier()
    dist.destroy_process_group()


def test_a_dispatched_topology_plan_swaps_a_running_megatron_job(tmp_path: Path) -> None:
    import socket

    import numpy as np

    from _rank_procs import await_ranks
    from failslow.core.control import keys
    from failslow.core.control.plan_channel import dispatch
    from failslow.core.control.store import open_store
    from failslow.core.planner.plans import TopologyPlan
    from failslow.core.topology import Topology

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = open_store("tcp://127.0.0.1:0?master=1")
    procs, logs = [], []
    try:
        for rank in range(WORLD):
            env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
            env.update(FAILSLOW_HOST=f"host{rank}", FAILSLOW_DISABLE_PLUGIN_AUTOLOAD="1",
                       OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # fmt: skip
            logs.append(open(tmp_path / f"rank{rank}.log", "w"))  # closed by await_ranks
            cmd = [sys.executable, str(HERE), str(rank), str(port), master.url, str(tmp_path)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        # the controller's side: the job record, a few steps, then the plan
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            steps = master.get_json(keys.STEPS)
            if master.get_json(keys.JOB) and steps and steps["steps"][-1][0] >= 2:
                break
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        before = Topology.from_dict(master.get_json(keys.JOB)["topology"])
        hosts = before.hosts
        plan = TopologyPlan(hosts=hosts[1:] + hosts[:1], reason="e2e: rotate roles")
        outcome = dispatch(master, plan, world_size=WORLD, horizon_steps=3, timeout_s=60)
        assert outcome.committed, outcome.reason
        assert outcome.apply_step is not None and outcome.apply_step < STEPS
        await_ranks(procs, logs, tmp_path, timeout=300, label="megatron swap e2e")
        after = Topology.from_dict(master.get_json(keys.JOB)["topology"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        master.close()
    assert after == before.moved(before.placement(plan.hosts)), "job record not republished"
    reference = {
        tuple(json.loads((tmp_path / f"reference.rank{r}.json").read_text())["coords"]): r
        for r in range(WORLD)
    }
    for rank in range(WORLD):
        record = json.loads((tmp_path / f"swap.rank{rank}.json").read_text())
        assert record["applied"] == [[outcome.epoch, outcome.apply_step, ""]], record
        assert record["coords"] == list(after.coords[rank])
        assert record["coords"] != list(before.coords[rank]), f"rank {rank} kept its role"
        got = np.load(tmp_path / f"swap.rank{rank}.npz")
        want = np.load(tmp_path / f"reference.rank{reference[tuple(record['coords'])]}.npz")
        assert sorted(got.files) == sorted(want.files)
        for name in want.files:
            assert np.array_equal(got[name], want[name]), f"rank {rank}, {name} differs"


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
