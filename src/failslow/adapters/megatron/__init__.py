"""failslow for Megatron-core: ``failslow.megatron.attach(model, optimizer, scheduler)``.

One line in a Megatron-LM-style training loop, on every rank after the model, optimizer and
scheduler exist::

    fs = failslow.megatron.attach(model, optimizer, scheduler)
    ...
    losses = fs.forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                                 num_microbatches=get_num_microbatches(), seq_length=SEQ,
                                 micro_batch_size=MBS, forward_only=False)

A job that should go on in another layout after ranks are lost (``failslow run --min-ranks``,
odyssey's reroute or reconfigure) builds its grid from ``failslow.megatron.parallel_sizes(tp,
pp)`` instead of its fixed sizes.

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

__all__ = ["MegatronAdapter", "attach", "parallel_sizes"]


def parallel_sizes(
    tensor_model_parallel_size: int, pipeline_model_parallel_size: int
) -> tuple[int, int]:
    """``(TP, PP)`` for ``initialize_model_parallel`` and the model's config: the job's own, or
    the layout ``failslow run --min-ranks`` chose when the job went on without lost ranks
    (``$FAILSLOW_LAYOUT``; DP is the rest of the world). ConfigError if that layout is not for
    this job (another TP degree) or does not parse."""
    import json
    import os

    from failslow import envvars
    from failslow.errors import ConfigError

    text = os.environ.get(envvars.LAYOUT)
    if not text:
        return tensor_model_parallel_size, pipeline_model_parallel_size
    try:
        layout = json.loads(text)
        tp, pp = int(layout["tp"]), int(layout["pp"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"${envvars.LAYOUT}: not a layout ({{'tp': ..., 'pp': ...}}): {text}"
        ) from None
    if tp != tensor_model_parallel_size:
        raise ConfigError(
            f"${envvars.LAYOUT} has TP {tp}, the job TP {tensor_model_parallel_size}: "
            "a new layout keeps TP"
        )
    return tp, pp


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
