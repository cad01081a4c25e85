"""The jobs the S3 benchmarks swap (``topology_swap_pause.py``, ``topology_swap_link.py``).

Each builder returns ``(adapter, step, parameters)``: the failslow adapter of a job attached
with a model provider / factory (so a topology plan rebuilds it in place), a function running
one training step, and one returning the parameters to compare between runs (Megatron: this
rank's stage; FSDP: the full, gathered values). Called in a rank process after
``init_process_group``.
"""

from __future__ import annotations

from typing import Any


def megatron_job(
    hidden: int, *, vocab: int, micro_batch_size: int, samples: int, start: int = 0
) -> tuple[Any, Any, Any]:
    """``failslow demo --framework megatron``'s GPT, TP1 x PP2 x DP2, 4 micro-batches."""
    import failslow.megatron
    from failslow.demo.megatron_job import GptShape, build_gpt, train_step

    shape = GptShape(
        hidden=hidden, vocab=vocab, seq=64, micro_batch_size=micro_batch_size, samples=samples
    )
    job = build_gpt(1, 2, seed=0, shape=shape)
    fs = failslow.megatron.attach(
        job.model, job.optimizer, job.scheduler, model_provider=job.extra["model_provider"],
        config={"capture": False}, num_microbatches=4, micro_batch_size=shape.micro_batch_size,
        iteration=start,
    )  # fmt: skip
    data = fs.data_iterator(job.dataset, seed=0)

    def parameters() -> dict[str, Any]:
        return {n: p.detach().numpy() for n, p in job.model[0].module.named_parameters()}

    return fs, lambda: train_step(job, fs, data), parameters


def fsdp_job(hidden: int, *, world: int, start: int = 0) -> tuple[Any, Any, Any]:
    """``failslow demo --framework fsdp``'s HSDP job: 2 replicas x ``world / 2`` shards,
    4 micro-batches of 32 per replica."""
    import itertools

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import failslow.fsdp
    from failslow.demo.fsdp_worker import build

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model, optimizer = build(mesh, hidden)
    fs = failslow.fsdp.attach(
        model, optimizer, mesh=mesh, model_factory=lambda m: build(m, hidden),
        config={"capture": False}, accumulation_steps=4, micro_batch_size=32, iteration=start,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1234)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(4096, hidden, generator=g), torch.randn(4096, hidden, generator=g)
    )
    data = itertools.chain.from_iterable(itertools.repeat(fs.loader(dataset)))

    def parameters() -> dict[str, Any]:
        return {n: p.full_tensor().detach().numpy() for n, p in model.named_parameters()}

    return fs, lambda: fs.train_step(data, torch.nn.functional.mse_loss), parameters
