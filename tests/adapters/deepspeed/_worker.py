"""One rank of the DeepSpeed adapter world: ``_worker.py --rank R --world W --port P --out F``.

Runs every check of ``test_deepspeed_adapter.py`` in one world (spawning one costs ~30 s):
for ZeRO 0, 1 and 2 and the pipeline engine, a plain DeepSpeed run on the even split against a
failslow run that switches to uneven counts at step 2 (same data, same seed; ZeRO 2 in the
size form). Writes what it saw as JSON; the test asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from failslow import hookimpl
from failslow.demo.ds_worker import skip_shm_kernel_build

STEPS = 6  # 4 steps per epoch below: the runs cross an epoch boundary
PLAN_STEP = 2
N, MBS, G, SEED = 64, 2, 2, 0  # SEED: the share loader's default, as failslow builds it


def dataset(pipe: bool) -> Any:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g)
    if pipe:
        return [(x[i], (y[i], torch.tensor(i))) for i in range(N)]
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))


class Net(torch.nn.Module):
    """Returns the loss itself; records which samples it trained on."""

    def __init__(self, seen: list[list[int]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.seen = seen

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        self.seen.append(idx.tolist())
        return torch.nn.functional.mse_loss(self.net(x), y)


def ds_config(stage: int, dp: int, **failslow: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": G,
        "train_batch_size": MBS * G * dp,
        "gradient_clipping": 0.0,  # DeepSpeed's default 1.0 would clip differently per run
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "failslow": {"capture": False, **failslow},
    }


def flat_params(model: Any) -> list[float]:
    model = getattr(model, "module", model)
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


# -- ZeRO 0/1 ---------------------------------------------------------------------------------
def run_plain(stage: int) -> dict[str, Any]:
    """Reference: DeepSpeed's own loop on the even split (engine, backward, step G times)."""
    import deepspeed

    from failslow.adapters.common.data import share_loader

    seen: list[list[int]] = []
    model = Net(seen)
    init = flat_params(model)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=sgd(model), config=ds_config(stage, dist.get_world_size())
    )
    loader = share_loader(
        dataset(False),
        micro_batch_size=MBS,
        micro_batches=G * engine.dp_world_size,
        replica=dist.get_rank(),
        replicas=engine.dp_world_size,
        seed=SEED,
    )
    it = iter(deepspeed.utils.RepeatingLoader(loader))
    for _ in range(STEPS * G):
        engine.backward(engine(*next(it)))
        engine.step()
    return {"params": flat_params(engine), "seen": seen, "init": init}


def run_failslow(stage: int, counts: tuple[int, ...]) -> dict[str, Any]:
    import failslow.deepspeed
    from failslow.adapters.common.data import ShareSampler
    from failslow.core.planner.plans import MicroBatchPlan

    seen: list[list[int]] = []
    model = Net(seen)
    engine, _, loader, _ = failslow.deepspeed.initialize(
        model=model,
        optimizer=sgd(model),
        config=ds_config(stage, dist.get_world_size()),
        training_data=dataset(False),
    )
    assert isinstance(loader.batch_sampler, ShareSampler)
    adapter = engine.failslow
    topo = adapter.topology
    plan = MicroBatchPlan(
        counts=counts, weights=tuple(c * topo.dp / topo.micro_batches for c in counts)
    )
    bad = {}
    for counts_ in [(0, 4, 2, 2), (2, 2, 4), (3, 3, 3, 3)]:
        try:
            adapter.session.schedule(MicroBatchPlan(counts=counts_, weights=()), PLAN_STEP)
        except Exception as exc:
            bad[str(counts_)] = f"{type(exc).__name__}: {exc}"
    adapter.session.schedule(plan, PLAN_STEP)
    per_step = []
    for _ in range(STEPS):
        before = len(seen)
        engine.train_batch()
        per_step.append(len(seen) - before)
    out = {
        "params": flat_params(engine),
        "seen": seen,
        "per_step": per_step,
        "topology": {
            "tp": topo.tp,
            "dp": topo.dp,
            "pp": topo.pp,
            "coords": topo.coords,
            "hosts": topo.hosts,
            "micro_batches": topo.micro_batches,
            "micro_batch_size": topo.micro_batch_size,
        },
        "capabilities": adapter.session.capabilities.to_dict(),
        "is_engine": type(engine).__name__,
        "applied": adapter.session.current is not None,
        "bad_plans": bad,
    }
    adapter.close()
    return out


# -- the Hugging Face Trainer's way of driving DeepSpeed (through Accelerate) -----------------
class PlanResults:
    """What the session reports of each plan on this rank."""

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    @hookimpl
    def failslow_on_plan_result(self, plan: Any, step: Any, outcome: str, detail: str) -> None:
        self.seen.append([outcome, step, detail])


def run_trainer_loop(share_aware: bool, early: bool = False) -> dict[str, Any]:
    """A ZeRO-1 engine driven as ``transformers.Trainer`` drives it: Accelerate's
    ``DeepSpeedEngineWrapper.backward(loss, sync_gradients=...)`` sets the accumulation
    boundary itself every ``G`` micro-batches and steps the engine then. ``share_aware``: the
    loop reads failslow's loader, else the Trainer's own ``DataLoader`` over a
    ``DistributedSampler``. The plan is scheduled in the step before its own (refused at
    prepare: the loop was seen setting the boundary) or, ``early``, before the loop's first
    backward - as a split carried in a restart's snapshot is - when nothing has shown who sets
    the boundary yet: it passes prepare, and what ran is checked after its apply step."""
    import deepspeed

    import failslow.deepspeed
    from failslow.core.planner.plans import MicroBatchPlan

    model = Net([])
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=sgd(model), config=ds_config(1, dist.get_world_size())
    )
    adapter = failslow.deepspeed.attach(engine)
    results = PlanResults()
    adapter.session.register(results)
    if share_aware:
        batches = iter(deepspeed.utils.RepeatingLoader(adapter.dataloader(dataset(False))))
    else:
        sampler = torch.utils.data.distributed.DistributedSampler(dataset(False), seed=SEED)
        own = torch.utils.data.DataLoader(dataset(False), batch_size=MBS, sampler=sampler)
        batches = iter(deepspeed.utils.RepeatingLoader(own))
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    wrapper = DeepSpeedEngineWrapper(engine)
    plan = MicroBatchPlan(counts=(1, 3, 2, 2), weights=(0.5, 1.5, 1.0, 1.0))
    refused = ""
    for micro in range((PLAN_STEP + 2) * G):
        if micro == (0 if early else PLAN_STEP * G - G // 2):
            try:
                adapter.session.schedule(plan, PLAN_STEP)
            except Exception as exc:
                refused = f"{type(exc).__name__}: {exc}"
        loss = engine(*next(batches))
        wrapper.backward(loss, sync_gradients=(micro + 1) % G == 0)
    out = {"results": results.seen, "refused": refused, "steps": engine.global_steps}
    adapter.close()
    return out


# -- pipeline engine: 2 stages x 2 DP ---------------------------------------------------------
def pipe_module(seen: list[list[int]]) -> Any:
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    def loss_fn(out: torch.Tensor, labels: Any) -> torch.Tensor:
        y, idx = labels
        seen.append(idx.tolist())
        return torch.nn.functional.mse_loss(out, y)

    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    ]
    return PipelineModule(
        layers=layers,
        topology=PipeDataParallelTopology(num_pp=2, num_dp=2),
        loss_fn=loss_fn,
        partition_method="uniform",
    )


def run_pipe(counts: tuple[int, ...] | None) -> dict[str, Any]:
    import deepspeed

    import failslow.deepspeed
    from failslow.adapters.common.data import share_loader
    from failslow.core.planner.plans import MicroBatchPlan

    seen: list[list[int]] = []
    model = pipe_module(seen)
    config = ds_config(0, 2)
    if counts is None:  # reference: DeepSpeed's own pipeline engine on the even split
        engine, *_ = deepspeed.initialize(model=model, optimizer=sgd(model), config=config)
        loader = share_loader(
            dataset(True),
            micro_batch_size=MBS,
            micro_batches=G * 2,
            replica=engine.grid.get_data_parallel_id(),
            replicas=2,
            seed=SEED,
        )
        it = iter(deepspeed.utils.RepeatingLoader(loader))
        for _ in range(STEPS):
            engine.train_batch(it)
        return {"params": flat_params(engine), "seen": seen}
    engine, *_ = failslow.deepspeed.initialize(
        model=model, optimizer=sgd(model), config=config, training_data=dataset(True)
    )
    engine.failslow.session.schedule(MicroBatchPlan(counts=counts, weights=(0.5, 1.5)), PLAN_STEP)
    micro_batches = []
    for _ in range(STEPS):
        engine.train_batch()
        micro_batches.append(engine.micro_batches)
    topo = engine.failslow.topology
    out = {
        "params": flat_params(engine),
        "seen": seen,
        "micro_batches": micro_batches,
        "stage": engine.stage_id,
        "replica": engine.grid.get_data_parallel_id(),
        "topology": {
            "dp": topo.dp,
            "pp": topo.pp,
            "coords": topo.coords,
            "micro_batches": topo.micro_batches,
        },
        "capabilities": engine.failslow.session.capabilities.to_dict(),
    }
    engine.failslow.close()
    return out


CHECKS = {
    "zero0_even": lambda: run_plain(0),
    "zero0_plan": lambda: run_failslow(0, (1, 3, 2, 2)),
    "zero1_even": lambda: run_plain(1),
    "zero1_plan": lambda: run_failslow(1, (1, 3, 2, 2)),
    "zero2_even": lambda: run_plain(2),
    "zero2_plan": lambda: run_failslow(2, (1, 3, 2, 2)),
    "trainer_share_aware": lambda: run_trainer_loop(True),
    "trainer_share_aware_early": lambda: run_trainer_loop(True, early=True),
    "trainer_own_loader": lambda: run_trainer_loop(False),
    # last: a pipeline engine leaves DeepSpeed's process-wide grid behind
    "pipe_even": lambda: run_pipe(None),
    "pipe_plan": lambda: run_pipe((1, 3)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checks", default=",".join(CHECKS))
    args = ap.parse_args()
    os.environ.update(
        RANK=str(args.rank),
        WORLD_SIZE=str(args.world),
        LOCAL_RANK=str(args.rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
        LOCAL_WORLD_SIZE=str(args.world),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    skip_shm_kernel_build()
    import deepspeed

    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    deepspeed.init_distributed(dist_backend="gloo")
    results: dict[str, Any] = {}
    for name in args.checks.split(","):
        try:
            results[name] = CHECKS[name]()
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
            raise
        finally:
            with open(args.out, "w") as fh:
                json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
