"""One real rank (gloo, world 1): a DeepSpeed ZeRO-1 engine attached by
``failslow.deepspeed.attach`` in the loop Accelerate's docs teach (``accelerator.prepare``,
``accumulate``, ``accelerator.backward``) and in the loop DeepSpeed's tutorials teach. Prints
JSON {loop: what a micro-batch plan's prepare says} on stdout."""

from __future__ import annotations

import json

import torch

from failslow.core.planner.plans import MicroBatchPlan
from failslow.demo.ds_worker import skip_shm_kernel_build

DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
             "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
             "zero_allow_untested_optimizer": True}  # fmt: skip
PLAN = MicroBatchPlan(counts=(4,), weights=(1.0,))


def _data() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))


def _prepare(adapter) -> str:
    try:
        adapter.failslow_prepare_microbatch_plan(plan=PLAN, rank=0)
    except Exception as exc:  # what the plan channel sends back as the rank's refusal
        return f"refused: {exc}"
    return "prepared"


def accelerate_loop() -> dict[str, str]:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import failslow.deepspeed

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(DS_CONFIG)))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    adapter = failslow.deepspeed.attach(model, {"capture": False})
    loader = adapter.dataloader(_data())  # failslow's: only the boundary is left to refuse for
    seen = {"before": _prepare(adapter)}
    for i, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if i == 8:
            break
    seen["after"] = _prepare(adapter)
    adapter.close()
    seen["restored"] = str("set_gradient_accumulation_boundary" not in vars(model))
    return seen


def deepspeed_loop() -> dict[str, str]:
    import deepspeed

    import failslow.deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=dict(DS_CONFIG))
    adapter = failslow.deepspeed.attach(engine, {"capture": False})
    for i, (x, y) in enumerate(adapter.dataloader(_data())):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        if i == 8:
            break
    seen = {"after": _prepare(adapter)}
    try:
        failslow.deepspeed.attach(torch.nn.Linear(1, 1), {"capture": False})
    except TypeError as exc:
        seen["not an engine"] = str(exc)
    adapter.close()
    return seen


def main() -> None:
    skip_shm_kernel_build()
    out = {"accelerate": accelerate_loop(), "deepspeed": deepspeed_loop()}
    print(json.dumps(out), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
