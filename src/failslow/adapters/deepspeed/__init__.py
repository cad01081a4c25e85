"""failslow for DeepSpeed: ``failslow.deepspeed.initialize(...)`` or ``attach(engine)``.

``initialize`` is a drop-in for ``deepspeed.initialize``: it reads the top-level ``"failslow"``
block of the DeepSpeed config (DeepSpeed itself ignores that key; ``failslow=`` overrides it),
rejects a bad block before the engine is built, builds the engine with the real
``deepspeed.initialize``, attaches, and returns the same 4-tuple - with ``training_data``, the
dataloader is the share-aware one from :mod:`failslow.adapters.common.data`.

The engine stays the real DeepSpeed engine (``isinstance``, ``engine.module``, checkpoints and
every other attribute work unchanged). Attaching adds two attributes to it: ``engine.failslow``
(the :class:`DeepSpeedAdapter`) and ``engine.train_batch`` - for non-pipeline engines the
adapter's per-replica loop, for the pipeline engine ``PipelineEngine.train_batch`` preceded by
the session's step boundary - and a forward pre-hook: plans take effect in the ordinary
forward/backward/step loop over the returned loader as well as in ``engine.train_batch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from failslow.adapters.common.session import start_session
from failslow.adapters.deepspeed.plugin import DeepSpeedAdapter
from failslow.config import FailslowConfig, as_config, block_of

__all__ = ["DeepSpeedAdapter", "attach", "initialize"]


def attach(
    engine: Any, config: FailslowConfig | Mapping[str, Any] | None = None
) -> DeepSpeedAdapter:
    """Start a failslow session for an existing engine (every rank calls it, after
    ``deepspeed.initialize``); ``config`` defaults to the engine config's ``"failslow"`` block."""
    source = "failslow.deepspeed.attach(config=...)"
    if not callable(getattr(engine, "zero_optimization_stage", None)):
        raise TypeError(
            "failslow.deepspeed.attach expects the DeepSpeed engine deepspeed.initialize returns "
            f"(with Accelerate, the model prepared under a DeepSpeed plugin); got "
            f"{type(engine).__name__}"
        )
    if config is None:
        params = getattr(getattr(engine, "_config", None), "_param_dict", None) or {}
        config, source = block_of(params, where="the DeepSpeed config")
    cfg = as_config(config, source)  # a bad block fails here, before any collective
    adapter = DeepSpeedAdapter(engine)
    start_session(adapter, cfg, source=source, name="deepspeed")
    adapter.follow_loop()
    adapter.guard_optimizer_step()
    engine.failslow = adapter
    engine.train_batch = adapter.train_batch
    return adapter


def initialize(
    args: Any = None, *, failslow: FailslowConfig | Mapping[str, Any] | None = None, **kwargs: Any
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize(**kwargs)`` with failslow attached; same return value."""
    source = "failslow.deepspeed.initialize(failslow=...)"
    if failslow is None:
        ds_config = kwargs.get("config", kwargs.get("config_params"))
        if ds_config is None:
            ds_config = getattr(args, "deepspeed_config", None)
        failslow, source = block_of(ds_config, where="the DeepSpeed config")
    cfg = as_config(failslow, source)  # a bad block fails here, before the engine exists
    import deepspeed

    training_data = kwargs.pop("training_data", None)
    collate_fn = kwargs.pop("collate_fn", None)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, **kwargs)
    adapter = attach(engine, cfg)
    loader = None
    if training_data is not None:
        loader = adapter.dataloader(training_data, collate_fn=collate_fn)
    return engine, optimizer, loader, lr_scheduler
