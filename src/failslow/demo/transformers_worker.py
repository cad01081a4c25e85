"""One rank of the Hugging Face Trainer mitigation demo: ``trainer.train()``, one line of
failslow.

Started by ``accelerate launch`` (from :mod:`failslow.demo.mitigation`, or by hand)::

    accelerate launch --multi_gpu --num_processes 4 -m failslow.demo.transformers_worker

This is a Trainer user's script with failslow: a small GPT-2 built from a config (no dropout:
dropout draws per sample, so a re-cut changes its masks), random token sequences as its data,
``TrainingArguments`` with gradient accumulation, ``failslow.transformers.attach(trainer)``
and ``trainer.train()`` - the Trainer's own loop, loader, loss and schedule (DDP over gloo). A
callback only records the demo's progress (each step's end, rank 0's progress file for the
launcher) and ends training when every rank sees the stop file. The control store comes from
``$FAILSLOW_STORE``, the rings from ``$FAILSLOW_RING_DIR``; the slowdown is injected from
outside, so each rank writes its PID (``pid-rank<r>``). At the end every rank writes its step
record and rank 0 the parameters.

The optimizer is plain SGD, as in the Accelerate demo: the demo's end-to-end test compares the
mitigated model with the fault-free one within 1e-6, and Adam turns the fp32 rounding of
regrouped gradient sums into larger parameter differences (with the Trainer's default AdamW
this job ended 1.3e-6 relative apart after 143 steps, 51 of them under a plan). The data are
random tokens, nothing to learn: on learnable sequences (arithmetic progressions) the model's own
training dynamics amplified the same rounding to 2.5e-5 over 78 steps under a plan. With SGD on
random tokens the largest difference is on GPT-2's zero-initialized biases (LayerNorm and MLP),
3.3e-7 and 4.5e-7 relative in two runs (the second beside a busy loop) - ~2x below the bound.

With ``FAILSLOW_DEMO_ZERO`` (1 or 2) the Trainer runs its DeepSpeed path at that ZeRO stage
(DeepSpeed on the CPU, gloo) and failslow is enabled as a DeepSpeed user would: the settings are
the DeepSpeed config's ``"failslow"`` block, the one line
``callbacks=[failslow.transformers.FailslowCallback()]``.

Environment: FAILSLOW_DEMO_STEPS, FAILSLOW_DEMO_OUT, FAILSLOW_DEMO_MICRO_BATCHES (per rank:
the gradient accumulation), FAILSLOW_DEMO_MICRO_BATCH_SIZE (per-device batch),
FAILSLOW_DEMO_WIDTH (GPT-2's embedding width), FAILSLOW_DEMO_CONFIG, FAILSLOW_DEMO_STOP_FILE,
FAILSLOW_DEMO_ZERO.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

SEQUENCE, VOCAB, SAMPLES = 32, 512, 8192


def main() -> None:
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    import failslow.transformers
    from failslow.demo.worker_io import (
        all_ranks_see,
        announce_start,
        finish,
        run_record,
        worker_env,
        write_progress,
    )

    env = worker_env()
    rank, steps, out = env.rank, env.steps, env.out
    width = int(os.environ.get("FAILSLOW_DEMO_WIDTH", "128"))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=width, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQUENCE), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    settings = json.loads(os.environ.get("FAILSLOW_DEMO_CONFIG", "{}"))
    zero = os.environ.get("FAILSLOW_DEMO_ZERO")
    deepspeed = None
    if zero:  # the Trainer's DeepSpeed path; failslow's settings in the config's block
        from failslow.demo.ds_worker import skip_shm_kernel_build

        skip_shm_kernel_build()
        deepspeed = {
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "zero_optimization": {"stage": int(zero)},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "failslow": settings,
        }  # fmt: skip
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=int(os.environ.get("FAILSLOW_DEMO_MICRO_BATCH_SIZE", "8")),
        gradient_accumulation_steps=env.per_replica,
        max_steps=steps,
        optim="sgd",  # see the module docstring
        learning_rate=0.05,
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        deepspeed=deepspeed,
    )
    if deepspeed is not None:  # the one line; settings from the DeepSpeed config's block
        callback = failslow.transformers.FailslowCallback()
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        fs: Any = callback.registration
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
        fs = failslow.transformers.attach(trainer, config=settings)
    stop_file = os.environ.get("FAILSLOW_DEMO_STOP_FILE")
    step_end: list[float] = []

    class Progress(TrainerCallback):  # the demo's bookkeeping, not failslow's
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            announce_start(rank, None)
            step_end.append(time.time())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_end.append(time.time())
            if rank == 0:  # the launcher's view of the job's progress (it injects by step)
                write_progress(out, rank, step_end, 0, state.global_step - 1)
            if stop_file and all_ranks_see(stop_file):
                control.should_training_stop = True  # every rank ends at the same step

    trainer.add_callback(Progress())
    trainer.train()
    adapter = fs.adapter
    assert adapter is not None
    params = {n: p.detach().cpu().numpy() for n, p in model.named_parameters()}
    finish(out, rank, run_record(rank, step_end, 0, None, adapter), params, adapter)


if __name__ == "__main__":
    main()
