"""A Megatron-core job's state in a new DP x PP layout (odyssey III-IV, reconfiguration; the
reroute that drops a whole pipeline is the special case of a smaller DP).

Megatron-core names every tensor of a model chunk by a layout-free identity in its
``sharded_state_dict``: the global key (layers stacked on a leading axis) and the global offset
(the layer's index, the tensor-parallel shard's position). A snapshot records, for each local
key of each chunk and for each parameter in each optimizer's order, that identity
(:func:`layout_record`, computed once per layout); the new layout's ranks gather the tensors
of all old ranks by identity and take what their own chunks and optimizers name
(:func:`load_resharded`, the kit's :mod:`failslow.adapters.common.reshard`).

Kept as it was: the tensor-parallel degree (shards are matched, not re-cut). Implemented for
Megatron's plain fp32 optimizer (``FP32Optimizer``, chained or not); the distributed optimizer's
shards and the fp16/bf16 optimizer's fp32 master copies are refused with one line
(:func:`refusal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from failslow.adapters.common.reshard import by_identity, pick
from failslow.errors import FailslowError

Identity = tuple[str, tuple[int, ...]]


def refusal(optimizers: Sequence[Any]) -> str:
    """Why these optimizers' state cannot be resharded ("" if it can)."""
    for opt in optimizers:
        kind = type(opt).__name__
        if hasattr(opt, "get_parameter_state_dp_reshardable"):
            return (
                "going on in a new layout is implemented for Megatron's fp32 optimizer; the "
                "distributed optimizer's shards are not re-cut (use_distributed_optimizer=False)"
            )
        if kind != "FP32Optimizer":
            return (
                f"going on in a new layout is implemented for Megatron's FP32Optimizer, "
                f"not {kind} (its fp32 master copies are not re-cut)"
            )
    return ""


def model_identities(chunks: Sequence[Any]) -> list[dict[str, Identity]]:
    """Per model chunk, each local state key's identity: the sharded tensor's global key and
    offset (``_extra_state`` objects have none)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    model: list[dict[str, Identity]] = []
    for chunk in chunks:
        local = set(chunk.state_dict())
        ids: dict[str, Identity] = {}
        for key, sharded in chunk.sharded_state_dict().items():
            if not isinstance(sharded, ShardedTensor):
                continue  # _extra_state objects: nothing the layout owns
            name = key if key in local else key.removeprefix("module.")
            if name not in local:
                raise FailslowError(f"Megatron sharded key {key!r} is not in the chunk's state")
            ids[name] = (sharded.key, tuple(int(o) for o in sharded.global_offset))
        model.append(ids)
    return model


def layout_record(chunks: Sequence[Any], optimizers: Sequence[Any]) -> dict[str, Any]:
    """The identity of every local key of ``chunks`` and of every parameter index of
    ``optimizers`` (their ``state_dict`` order), plus the tensor-parallel rank and size."""
    from megatron.core import parallel_state as ps

    model = model_identities(chunks)
    by_param: dict[int, Identity] = {}
    for chunk, ids in zip(chunks, model, strict=True):
        for name, param in chunk.named_parameters():
            local_name = name if name in ids else name.removeprefix("module.")
            if local_name in ids:
                by_param[id(param)] = ids[local_name]
    optimizer: list[dict[int, Identity]] = []
    for opt in optimizers:
        order = [p for group in opt.optimizer.param_groups for p in group["params"]]
        missing = [i for i, p in enumerate(order) if id(p) not in by_param]
        if missing:
            raise FailslowError(
                f"optimizer parameter {missing[0]} is not a parameter of the model chunks"
            )
        optimizer.append({i: by_param[id(p)] for i, p in enumerate(order)})
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "model": model,
        "optimizer": optimizer,
    }


def load_resharded(
    chunks: Sequence[Any],
    optimizers: Sequence[Any],
    mine: dict[str, Any],
    states: Sequence[dict[str, Any]],
) -> None:
    """Load every old rank's model and optimizer tensors that this rank's layout ``mine``
    (:func:`layout_record`) names. FailslowError if the tensor-parallel degree changed or an
    identity is held by no old rank."""
    old_tp = {int(s["layout"]["tp"]) for s in states}
    if old_tp != {mine["tp"]}:
        raise FailslowError(
            f"the old layout's tensor-parallel size {sorted(old_tp)} is not this one's "
            f"({mine['tp']}); going on in a new layout keeps TP"
        )
    weights = by_identity(
        (ids, chunk_state)
        for s in states
        for ids, chunk_state in zip(s["layout"]["model"], s["model"], strict=True)
    )
    for c, (chunk, ids) in enumerate(zip(chunks, mine["model"], strict=True)):
        state = chunk.state_dict()
        state.update(pick(weights, ids, f"model chunk {c}"))
        chunk.load_state_dict(state)
    moments = by_identity(
        (ids, opt_state["state"]["state"])
        for s in states
        for ids, opt_state in zip(s["layout"]["optimizer"], s["optimizer"], strict=True)
    )
    groups = {
        _group_key(group): group
        for s in states
        for opt_state in s["optimizer"]
        for group in opt_state["state"]["param_groups"]
    }
    for o, (opt, ids) in enumerate(zip(optimizers, mine["optimizer"], strict=True)):
        state = opt.state_dict()
        picked = pick(moments, ids, f"optimizer {o}", optional=True)
        state["state"] = {i: _cloned(v) for i, v in picked.items()}
        for group in state["param_groups"]:  # lr, weight decay as the scheduler left them
            old = groups.get(_group_key(group))
            if old is not None:
                group.update({k: v for k, v in old.items() if k != "params"})
        opt.load_state_dict(state)


def tp_source(states: Sequence[dict[str, Any]], tp_rank: int) -> dict[str, Any]:
    """An old rank's state of this tensor-parallel rank (its TP random-generator states)."""
    for s in states:
        if int(s["layout"]["tp_rank"]) == tp_rank:
            return s
    raise FailslowError(f"no old rank ran tensor-parallel rank {tp_rank}")


def _group_key(group: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a Megatron parameter group (its multipliers), not which parameters it has."""
    return tuple(
        group.get(k) for k in ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
    )


def _cloned(value: Any) -> Any:
    """A per-parameter optimizer state of its own (an old rank's tensors can serve several new
    ranks in one process's memory)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    return value
