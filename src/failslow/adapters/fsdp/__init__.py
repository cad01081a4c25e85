"""failslow for FSDP2, HSDP and DDP: ``failslow.fsdp.attach(model, optimizer, mesh=mesh)``.

One line on every rank, after ``fully_shard(model, mesh=mesh)`` (or ``DistributedDataParallel``)
and the optimizer exist::

    fs = failslow.fsdp.attach(model, optimizer, mesh=mesh, accumulation_steps=G,
                              micro_batch_size=B)
    data = iter(itertools.cycle(fs.loader(dataset)))   # or any repeating iterator of it
    for step in range(steps):
        fs.train_step(data, loss_fn)

``fs.train_step`` passes the session's step boundary (plans apply there), runs this replica's
micro-batch count and steps the optimizer; ``fs.step_batches(data)`` with ``fs.loss_scale`` is
the same for a loop of one's own (:mod:`.plugin`). ``fs.loader(dataset)`` reads this rank's
exact share of every global batch. Settings come from ``config=``, the environment
(``FAILSLOW__SECTION__KEY``) or ``failslow run``; a bad key is one line naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from failslow.adapters.common.session import start_session
from failslow.adapters.fsdp.plugin import FSDPAdapter
from failslow.config import FailslowConfig, as_config

__all__ = ["FSDPAdapter", "attach"]


def attach(
    model: Any,
    optimizer: Any,
    *,
    mesh: Any = None,
    model_factory: Callable[..., Any] | None = None,
    config: FailslowConfig | Mapping[str, Any] | None = None,
    scheduler: Any = None,
    accumulation_steps: int = 1,
    micro_batch_size: int = 1,
    unshard_once: bool = False,
    iteration: int = 0,
) -> FSDPAdapter:
    """Start a failslow session for an FSDP2/HSDP/DDP job (every rank calls it).

    ``mesh``: the DeviceMesh of ``fully_shard`` (1-D FSDP, 2-D (replicate, shard) HSDP; not
    needed for DDP); ``accumulation_steps``: micro-batches per replica and step under the even
    split; ``micro_batch_size``: samples per micro-batch on one rank (for :meth:`loader`);
    ``unshard_once``: pure FSDP only, allow micro-batch plans by unsharding once per step;
    ``iteration``: the first step (a resumed job's)."""
    source = "failslow.fsdp.attach(config=...)"
    cfg = as_config(config, source)  # a bad key fails here, before any collective
    adapter = FSDPAdapter(
        model,
        optimizer,
        mesh=mesh,
        scheduler=scheduler,
        model_factory=model_factory,
        accumulation_steps=accumulation_steps,
        micro_batch_size=micro_batch_size,
        unshard_once=unshard_once,
        iteration=iteration,
    )
    start_session(adapter, cfg, source=source, name="fsdp")
    adapter.guard_optimizer_step()
    return adapter
