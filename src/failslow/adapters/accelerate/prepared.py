"""Re-cut a loader Accelerate prepared (greyhound 5.2's S2 over the user's or the trainer's own
loader, issue 45): its ``BatchSamplerShard`` wrapped in a
:class:`~failslow.adapters.common.recut.RecutSampler` tracked by the adapter's split - the
count form for a loop that iterates what it is handed (``accelerator.accumulate``), the size
form for one that runs its own ``G`` micro-batches per step (the Hugging Face Trainer)."""

from __future__ import annotations

from typing import Any

from failslow.adapters.common.recut import RecutSampler


def shard_of(loader: Any, whose: str) -> tuple[Any, Any, str]:
    """The torch DataLoader inside Accelerate's prepared ``loader`` and its
    ``BatchSamplerShard``, or why it cannot be re-cut (``whose``: "the Trainer's training
    loader", ...)."""
    from accelerate.data_loader import BatchSamplerShard

    base = getattr(loader, "base_dataloader", None)
    shard = getattr(base, "batch_sampler", None)
    if not isinstance(shard, BatchSamplerShard):
        return None, None, (
            f"{whose} has no Accelerate batch sampler shard to re-cut (found "
            f"{type(shard).__name__}: an iterable dataset, or a dispatching loader)"
        )  # fmt: skip
    if shard.split_batches:
        why = f"{whose} splits each batch across processes (split_batches=True)"
        return None, None, why + ", which failslow does not re-cut"
    return base, shard, ""


def recut(
    split: Any, loader: Any, whose: str, *, start_step: int, by_count: bool, skip_steps: int = 0
) -> str:
    """Wrap ``loader``'s batch sampler in a :class:`RecutSampler` tracked by ``split`` (units
    of ``split.by_size`` samples in the size form, of the loader's batch in the count form);
    the reason where it cannot be. ``skip_steps``: a rank resumed from a snapshot, whose fresh
    ``loader`` must first be walked over the steps already trained (the sampler's "a resumed
    rank"; Accelerate's ``DataLoaderShard`` counts its epochs in ``iteration``)."""
    base, shard, why = shard_of(loader, whose)
    if why:
        return why
    if (shard.num_processes, shard.process_index) != (split.replicas, split.replica):
        return (
            f"{whose} shards each batch over {shard.num_processes} processes and this job has "
            f"{split.replicas} data-parallel replicas (a replica sharded over several processes "
            "reads several processes' batches), which failslow does not re-cut"
        )
    epoch = None
    if hasattr(loader, "set_epoch") and hasattr(loader, "iteration"):  # Accelerate's epochs
        epoch = (lambda: int(loader.iteration), loader.set_epoch)
    unit = shard.batch_size if by_count else split.by_size
    if not unit:
        return f"{whose} has a batch sampler of no fixed batch size, which failslow does not re-cut"
    sampler = RecutSampler(
        shard,
        replica=split.replica,
        replicas=split.replicas,
        accumulation=split.configured // split.replicas,
        unit=int(unit),
        start_step=start_step,
        by_count=by_count,
        skip_steps=skip_steps,
        epoch=epoch,
    )
    object.__setattr__(base, "batch_sampler", sampler)  # DataLoader forbids it after init
    split.track(sampler)
    return ""
