"""RNG and counter state for bitwise snapshots (byterobust 6.3; DESIGN.md invariant 4).

A restored rank must continue exactly as it would have: besides the model, the optimizer and
the scheduler, that takes every random generator the step draws from (dropout, data order) and
the framework's own step counters. :func:`rng_state` / :func:`restore_rng_state` cover Python's
``random``, NumPy's global generator, torch's CPU generator and, where CUDA is initialized, every
device's generator; :func:`counters` / :func:`restore_counters` copy named integer attributes of
a framework object (an engine's ``global_steps``, say); :func:`training_state` /
:func:`restore_training_state` the model, optimizer and scheduler.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every generator's state, as tensors and plain values (snapshot-ready)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def counters(obj: Any, names: Sequence[str]) -> dict[str, int]:
    """``obj``'s integer attributes ``names`` by name."""
    return {name: int(getattr(obj, name)) for name in names}


def restore_counters(obj: Any, values: dict[str, int]) -> None:
    """Set the attributes :func:`counters` read."""
    for name, value in values.items():
        setattr(obj, name, int(value))


def training_state(module: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Model, optimizer and scheduler state by reference (None for what a job does not have)."""
    return {
        "module": module.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
    }


def restore_training_state(
    state: dict[str, Any],
    module: Any,
    scheduler: Any,
    load_optimizer: Callable[[Any], None],
) -> None:
    """Put back what :func:`training_state` returned; ``load_optimizer(state)`` loads the
    optimizer's part the framework's way (a sharded optimizer loads its own shard)."""
    module.load_state_dict(state["module"])
    if state["optimizer"] is not None:
        load_optimizer(state["optimizer"])
    if state["lr_scheduler"] is not None:
        scheduler.load_state_dict(state["lr_scheduler"])


def wait_for_snapshot_before(owner: Any, name: str, adapter: Any) -> None:
    """Make ``owner.<name>`` (the framework's optimizer step) wait for the pending snapshot's
    copy first (byterobust 6.3: training state is copied off the training thread, and the
    optimizer must not change it meanwhile). ``adapter.session`` is read at each call."""
    step = getattr(owner, name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if adapter.session is not None:
            adapter.session.before_optimizer_step()
        return step(*args, **kwargs)

    setattr(owner, name, guarded)
