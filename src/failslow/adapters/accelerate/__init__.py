"""failslow for Hugging Face Accelerate: one line after the ``Accelerator`` is built.

Accelerate has no plugin registry (its ``kwargs_handlers`` accept a fixed set of classes), so
registration is a call::

    accelerator = Accelerator(gradient_accumulation_steps=G)
    fs = failslow.accelerate.attach(accelerator)          # before or after prepare
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:                                    # re-cut per plan (or fs.loader(dataset))
        with accelerator.accumulate(model):
            ...

Before ``prepare`` the session starts when ``accelerator.prepare`` has built the model and the
optimizer; after it, at once. The training loop stays Accelerate's (:mod:`.plugin`): DDP and
FSDP2 (``fsdp_version: 2``). Settings come from ``config=``, the environment
(``FAILSLOW__SECTION__KEY``) or ``failslow run``; a bad key is one line naming it, raised by
``attach`` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from failslow.adapters.accelerate.plugin import AccelerateAdapter
from failslow.adapters.common.session import start_session
from failslow.config import FailslowConfig, as_config
from failslow.errors import ConfigError

__all__ = ["AccelerateAdapter", "Registration", "attach"]


class Registration:
    """What ``attach`` returns: the adapter once ``prepare`` has run (attribute access is
    forwarded to it: ``fs.loader``, ``fs.session``, ``fs.iteration`` ...)."""

    def __init__(
        self,
        accelerator: Any,
        cfg: FailslowConfig,
        options: dict[str, Any],
        *,
        adapter_class: Callable[..., Any] = AccelerateAdapter,
        source: str = "",
        name: str = "accelerate",
    ) -> None:
        self.accelerator = accelerator
        self.adapter: Any = None
        """The adapter once ``prepare`` ran (``adapter_class``'s: AccelerateAdapter's unless a
        wrapper passes its own)."""
        self._cfg = cfg
        self._options = options
        self._prepare = accelerator.prepare
        self._adapter_class = adapter_class
        self._source = source or SOURCE
        self._name = name

    def _start(self, model: Any = None) -> Any:
        adapter = self._adapter_class(self.accelerator, model=model, **self._options)
        start_session(adapter, self._cfg, source=self._source, name=self._name)
        adapter.guard_optimizer_step()
        adapter.follow_loop()
        self.adapter = adapter
        self.accelerator.failslow = adapter
        return adapter

    def _prepare_then_start(self, *args: Any, **kwargs: Any) -> Any:
        result = self._prepare(*args, **kwargs)
        if self.adapter is None and self.accelerator._models and self.accelerator._optimizers:
            self.accelerator.__dict__.pop("prepare", None)  # prepare is Accelerate's again
            items = result if isinstance(result, tuple) else (result,)
            self._start(next((m for m in items if _wrapped(m)), None))
        return result

    def __getattr__(self, name: str) -> Any:
        adapter = self.__dict__.get("adapter")
        if adapter is None:
            raise ConfigError(
                f"failslow.accelerate: {name!r} is available once accelerator.prepare(model, "
                "optimizer, ...) has run"
            )
        return getattr(adapter, name)


SOURCE = "failslow.accelerate.attach(config=...)"


def _wrapped(obj: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(obj, DistributedDataParallel | FSDPModule)


def attach(
    accelerator: Any,
    config: FailslowConfig | Mapping[str, Any] | None = None,
    *,
    model: Any = None,
    micro_batch_size: int | None = None,
    unshard_once: bool = False,
    model_factory: Callable[..., Any] | None = None,
) -> Registration:
    """Register failslow on ``accelerator`` (every rank calls it).

    ``model``: only when attaching after ``prepare`` with DDP, the model ``prepare`` returned
    (Accelerate keeps the unwrapped one);
    ``micro_batch_size``: samples per micro-batch and rank for :meth:`AccelerateAdapter.loader`
    (default: the first prepared dataloader's batch size, else 1); ``unshard_once``: pure FSDP2
    only, allow micro-batch plans by unsharding once per step (see
    :mod:`failslow.adapters.fsdp.plugin`)."""
    cfg = as_config(config, SOURCE)  # a bad key fails here, before any collective
    registration = Registration(
        accelerator,
        cfg,
        {
            "micro_batch_size": micro_batch_size,
            "unshard_once": unshard_once,
            "model_factory": model_factory,
        },
    )
    if accelerator._models and accelerator._optimizers:
        registration._start(model)
    else:
        accelerator.prepare = registration._prepare_then_start
    return registration
