"""Each rank's own shards of a sharded model and optimizer, for snapshots (byterobust 6.3).

A snapshot is per rank and issues no collective: under FSDP2 a rank holds a shard of every
parameter (a ``DTensor``; ``to_local()`` is that shard, a view of the rank's memory) and the
optimizer's state for exactly that shard. :func:`local_model_state` / :func:`local_optimizer_state`
take both by reference as plain tensors (what the snapshot format stores);
:func:`restore_model_state` / :func:`restore_optimizer_state` put them back bitwise, making
DTensors again with each parameter's own mesh and placements. Plain tensors (DDP, buffers)
pass through unchanged.

The optimizer is read with ``optimizer.state_dict()`` itself - never with the
``torch.distributed.checkpoint.state_dict`` helpers, which initialise a missing optimizer state
by running a step with zero gradients (before the first real step that would change Adam's step
count) and gather across ranks.
"""

from __future__ import annotations

from typing import Any

import torch


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _local(value: Any) -> Any:
    return value.to_local() if _is_dtensor(value) else value


def local_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of every parameter and buffer, by reference."""
    return {name: _local(value) for name, value in model.state_dict().items()}


def restore_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy :func:`local_model_state`'s tensors back into the model's own storage."""
    mine = local_model_state(model)
    if sorted(mine) != sorted(state):
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise KeyError(f"the snapshot's model state differs: missing {missing}, extra {extra}")
    with torch.no_grad():
        for name, target in mine.items():
            target.copy_(state[name])


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` with every DTensor as this rank's local tensor."""
    full = optimizer.state_dict()
    state = {
        index: {key: _local(value) for key, value in per_param.items()}
        for index, per_param in full["state"].items()
    }
    return {"state": state, "param_groups": full["param_groups"]}


def restore_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`local_optimizer_state`'s dict: each tensor shaped like its parameter's local
    shard becomes a DTensor like the parameter (copies: the optimizer owns what it loads)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    loaded: dict[Any, dict[str, Any]] = {}
    for index, per_param in state["state"].items():
        param = params[int(index)]
        entry = {}
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                value = value.clone()
                if _is_dtensor(param) and key != "step" and value.shape == param.to_local().shape:
                    value = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
            entry[key] = value
        loaded[index] = entry
    optimizer.load_state_dict({"state": loaded, "param_groups": state["param_groups"]})
