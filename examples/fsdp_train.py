"""A PyTorch FSDP2 (or HSDP) training loop with failslow - the change is marked ``# failslow``.

    failslow run --controller 4 -- torchrun --standalone --nproc-per-node 4 \\
        examples/fsdp_train.py --hsdp --steps 100

``fully_shard`` on every block and on the root, over a 1-D mesh of every rank (FSDP) or, with
``--hsdp``, a (replicate 2, shard N/2) mesh: each replicate group is one data-parallel replica,
whose shard ranks each compute on their own part of its micro-batches. ``failslow.fsdp.attach``
after ``fully_shard``; ``fs.train_step`` is one global step (this replica's micro-batches under
the plan in effect, the optimizer and scheduler step). Pure FSDP allows micro-batch plans only
with ``unshard_once=True`` (parameters gathered once per step); HSDP always does (the
cross-replica all-reduce runs once per step). ``--eval-every N`` evaluates on a held-out set
after every N steps, as training loops do: failslow's detector leaves such steps out by the
calls they make (the eval's loss all-reduce), so they raise no alarm. Runs on CPUs with gloo, or
on GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import failslow.fsdp  # failslow


def main() -> None:
    parser = argparse.ArgumentParser(description="an MLP trained with FSDP2 and failslow")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--hsdp", action="store_true", help="2 replicas x N/2 shards")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per replica")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per micro-batch")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.set_num_threads(1)
    device, world = ("cuda" if cuda else "cpu"), dist.get_world_size()
    if args.hsdp:
        mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device, (world,))
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(2)
    ]
    model = torch.nn.Sequential(*blocks).to(device)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    fs = failslow.fsdp.attach(  # failslow
        model, optimizer, mesh=mesh, scheduler=scheduler,
        accumulation_steps=args.accumulation, micro_batch_size=args.batch_size,
        unshard_once=not args.hsdp,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(8192, 64, generator=g), torch.randn(8192, 64, generator=g)
    )
    batches = itertools.chain.from_iterable(itertools.repeat(fs.loader(dataset)))  # failslow
    data = ((x.to(device), y.to(device)) for x, y in batches)
    held_out = torch.utils.data.TensorDataset(
        torch.randn(8192, 64, generator=g), torch.randn(8192, 64, generator=g)
    )
    for step in range(fs.iteration, args.steps):  # a restart in place resumes at its step
        loss = fs.train_step(data, torch.nn.functional.mse_loss)  # failslow: one global step
        if step % 10 == 0 and dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            eval_loss = evaluate(model, held_out, args.batch_size, device)
            if dist.get_rank() == 0:
                print(f"eval after step {step}: loss {eval_loss:.4f}", flush=True)
    fs.close()
    dist.destroy_process_group()


def evaluate(
    model: torch.nn.Module, dataset: torch.utils.data.Dataset, batch_size: int, device: str
) -> float:
    """The mean loss over the held-out set, each rank on its own share of it."""
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    model.eval()
    total = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            total += torch.stack([loss * len(x), torch.tensor(float(len(x)), device=device)])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


if __name__ == "__main__":
    main()
