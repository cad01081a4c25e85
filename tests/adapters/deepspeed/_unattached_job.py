"""One rank under ``failslow run``'s ``sitecustomize``: which DeepSpeed engines get the line that
their config's ``"failslow"`` block does nothing. Prints JSON {case: [warnings]} on stdout."""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

from failslow.demo.ds_worker import skip_shm_kernel_build


class Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def config(block: bool) -> dict:
    out = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
           "zero_allow_untested_optimizer": True}  # fmt: skip
    if block:
        out["failslow"] = {"capture": False}
    return out


def main() -> None:
    import deepspeed

    import failslow.deepspeed

    skip_shm_kernel_build()
    dist.init_process_group("gloo", rank=0, world_size=1)
    caught = Caught()
    logging.getLogger("failslow").addHandler(caught)
    watched = getattr(deepspeed.initialize, "__failslow_watched__", False)
    seen: dict[str, object] = {"watched": watched}

    def run(case: str, block: bool, how: str) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        caught.messages.clear()
        if how == "failslow":
            engine, *_ = failslow.deepspeed.initialize(
                model=model, optimizer=opt, config=config(block)
            )
        else:
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config(block))
            if how == "attach":
                failslow.deepspeed.attach(engine)
        for _ in range(2):  # two steps: the line comes once
            engine.backward(engine(torch.randn(2, 4)).sum())
            engine.step()
        if getattr(engine, "failslow", None) is not None:
            engine.failslow.close()
        seen[case] = [m for m in caught.messages if '"failslow" block' in m]

    run("plain, with a block", True, "plain")
    run("plain, no block", False, "plain")
    run("plain, then attach", True, "attach")
    run("failslow.deepspeed.initialize", True, "failslow")
    print(json.dumps(seen), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
