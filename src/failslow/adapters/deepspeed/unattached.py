"""A ``"failslow"`` block in a DeepSpeed config that nothing reads gets one line saying so.

DeepSpeed ignores the block's key, so a job that builds its engine with the plain
``deepspeed.initialize`` (or through ``transformers.Trainer`` / Accelerate, which call it) and
never attaches failslow trains without it, silently - though the README enables a job by that
block. Under ``failslow run`` the rank's ``sitecustomize`` calls :func:`watch` once DeepSpeed is
imported: every engine ``deepspeed.initialize`` builds from a config with the block is checked at
its first forward (by then ``failslow.deepspeed.initialize`` and an ``attach(engine)`` made in a
Trainer's ``on_train_begin`` have both attached), and rank 0 logs what to add when nothing did.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

ADVICE = (
    'the DeepSpeed config has a "failslow" block, but failslow is not attached to this engine, '
    "so the block does nothing: build the engine with failslow.deepspeed.initialize(...) (the "
    "same arguments as deepspeed.initialize) or call failslow.deepspeed.attach(engine) before "
    "training"
)


def _has_block(engine: Any) -> bool:
    params = getattr(getattr(engine, "_config", None), "_param_dict", None)
    return isinstance(params, dict) and "failslow" in params


def _first_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def check_at_first_forward(engine: Any) -> None:
    """Warn (rank 0, once) at the engine's first forward if its config has a ``"failslow"``
    block and failslow has not attached to it by then."""
    module = getattr(engine, "module", None)
    if module is None or not _has_block(engine):
        return

    def first_forward(*_: Any) -> None:
        handle.remove()
        if getattr(engine, "failslow", None) is None and _first_rank():
            log.warning("failslow: %s", ADVICE)

    handle = module.register_forward_pre_hook(first_forward)


def watch(deepspeed: Any) -> None:
    """Wrap ``deepspeed.initialize`` (once) so each engine it builds is checked."""
    initialize = deepspeed.initialize
    if getattr(initialize, "__failslow_watched__", False):
        return

    @functools.wraps(initialize)
    def watched(*args: Any, **kwargs: Any) -> Any:
        out = initialize(*args, **kwargs)
        try:
            check_at_first_forward(out[0])
        except Exception as exc:  # never break the user's engine build
            log.debug("failslow: the unattached-block check was not set up: %r", exc)
        return out

    watched.__failslow_watched__ = True  # type: ignore[attr-defined]
    deepspeed.initialize = watched
