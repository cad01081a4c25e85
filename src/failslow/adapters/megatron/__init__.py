"""failslow for Megatron-core: ``failslow.megatron.attach(model, optimizer, scheduler)``.

One line in a Megatron-LM-style training loop, on every rank after the model, optimizer and
scheduler exist::

    fs = failslow.megatron.attach(model, optimizer, scheduler)
    ...
    losses = fs.forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                                 num_microbatches=get_num_microbatches(), seq_length=SEQ,
                                 micro_batch_size=MBS, forward_only=False)

``fs.forward_backward`` is the drop-in for ``get_forward_backward_func()(...)``: it passes the
session's step boundary (plans apply there) and runs this DP replica's micro-batch count with
its gradient weight (:mod:`.plugin`). ``fs.data_iterator(dataset)`` reads this replica's exact
share of every global batch. Settings come from ``config=``, the environment
(``FAILSLOW__SECTION__KEY``) or ``failslow run``; a bad key is one line naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from failslow.adapters.common.session import start_session
from failslow.adapters.megatron.plugin import MegatronAdapter
from failslow.config import FailslowConfig, as_config

__all__ = ["MegatronAdapter", "attach"]


def attach(
    model: Any,
    optimizer: Any,
    scheduler: Any = None,
    *,
    model_provider: Callable[..., Any] | None = None,
    config: FailslowConfig | Mapping[str, Any] | None = None,
    num_microbatches: int | None = None,
    micro_batch_size: int | None = None,
    iteration: int = 0,
) -> MegatronAdapter:
    """Start a failslow session for a Megatron-core job (every rank calls it, after
    ``initialize_model_parallel`` and the model/optimizer/scheduler are built).

    ``model``: the model chunks (DDP-wrapped, as ``forward_backward`` gets them);
    ``num_microbatches``/``micro_batch_size``: per DP replica, default from Megatron's
    num-microbatches calculator; ``iteration``: the first training iteration (a resumed job's)."""
    cfg = as_config(config, "failslow.megatron.attach(config=...)")  # a bad key fails here
    adapter = MegatronAdapter(
        model,
        optimizer,
        scheduler,
        model_provider=model_provider,
        num_microbatches=num_microbatches,
        micro_batch_size=micro_batch_size,
        iteration=iteration,
    )
    start_session(adapter, cfg, source="failslow.megatron.attach(config=...)", name="megatron")
    adapter.guard_optimizer_step()
    return adapter
