"""A Megatron-LM-style training loop with failslow - the change is marked ``# failslow``.

    failslow run --controller 4 -- torchrun --standalone --nproc-per-node 4 \\
        examples/megatron_train.py --steps 100

A GPT (4 layers, hidden 128) on TP1 x PP2 x DP2 with Megatron's DDP, Adam, learning-rate
scheduler and 1F1B schedule, built as a Megatron-LM loop builds them
(:func:`failslow.demo.megatron_job.build_gpt`). This example runs on CPUs with gloo: the builder
moves Megatron-core's hard-coded CUDA allocations to the CPU (:mod:`failslow.demo.megatron_cpu`,
demo-only); in a real job the two failslow lines are all that changes - the loop keeps its own
data iterator, which failslow re-cuts per plan (``fs.data_iterator(dataset)`` is the option that
also resumes its position after a restart from memory). ``model_provider``
(optional) builds model, optimizer and scheduler on Megatron's current process groups, so a
topology swap (S3) can rebuild them in place; ``model``, ``optimizer`` and ``scheduler`` below
stay valid across a swap.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist

import failslow.megatron  # failslow


def main() -> None:
    parser = argparse.ArgumentParser(description="Megatron-core GPT with failslow (CPU/gloo)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4, help="per DP replica")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    from failslow.demo.megatron_job import GptShape, build_gpt, pretraining_iterator

    shape = GptShape(layers=4, hidden=128, heads=4, seq=64, vocab=512, micro_batch_size=8,
                     samples=8192)  # fmt: skip
    job = build_gpt(args.tp, args.pp, seed=0, shape=shape)  # model, DDP, optimizer, scheduler
    model, optimizer, scheduler = job.model, job.optimizer, job.scheduler
    fs = failslow.megatron.attach(  # failslow
        model, optimizer, scheduler,
        model_provider=job.extra["model_provider"],  # S3 in place: rebuilds on the new groups
        num_microbatches=args.micro_batches, micro_batch_size=shape.micro_batch_size,
    )  # fmt: skip
    # the loop's own data iterator, as Megatron-LM builds it (its pretraining sampler over a
    # shuffled dataset, from the samples already consumed): failslow re-cuts it per plan
    data = pretraining_iterator(
        job.dataset, steps=args.steps, iteration=fs.iteration,
        micro_batches=args.micro_batches, micro_batch_size=shape.micro_batch_size,
    )  # fmt: skip
    global_batch = args.micro_batches * shape.micro_batch_size * fs.split.replicas
    for step in range(fs.iteration, args.steps):  # a restart in place resumes at its iteration
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = fs.forward_backward(  # failslow: was get_forward_backward_func()(...)
            forward_step_func=job.forward_step,
            data_iterator=data,
            model=model,
            num_microbatches=args.micro_batches,
            seq_length=shape.seq,
            micro_batch_size=shape.micro_batch_size,
            forward_only=False,
        )
        updated, _grad_norm, _ = optimizer.step()
        if updated:
            scheduler.step(increment=global_batch)
        if losses and step % 10 == 0:  # the last pipeline stage has the losses
            loss = sum(float(x["lm loss"]) for x in losses) / len(losses)
            print(f"rank {dist.get_rank()} step {step}: loss {loss:.4f}", flush=True)
    fs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
