"""A Hugging Face Trainer job with failslow - the change is marked ``# failslow``.

    failslow run --controller 4 -- torchrun --standalone --nproc-per-node 4 \\
        examples/trainer_train.py --steps 200

``Trainer(...).train()`` as the transformers docs teach it, on a small GPT-2 built from a
config and random token sequences (no download), with failslow registered in one line before
``trainer.train()``. It runs as DDP on CPUs (gloo) and on GPUs (NCCL) alike. A slow rank is
detected, diagnosed and mitigated inside ``trainer.train()``: S2 by size - every replica still
runs ``--accumulation`` micro-batches per step, the slow one's hold fewer of the step's samples
- without changing the trained model (the loss is divided by the global batch's token count,
the Trainer's ``num_items_in_batch``).
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import failslow.transformers  # failslow


def main() -> None:
    parser = argparse.ArgumentParser(description="a GPT-2 trained by the Trainer with failslow")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per rank")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--out", default="trainer-out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=32, n_embd=128, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (8192, config.n_positions), generator=g)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(
        model=model, args=training, train_dataset=dataset,
        callbacks=[failslow.transformers.FailslowCallback()],  # failslow
    )  # fmt: skip
    trainer.train()
    if trainer.is_world_process_zero():
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']}: loss {entry['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
