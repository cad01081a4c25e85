"""The FSDP adapter's refusals, config errors and shard state, without a world (the
conformance suite runs it on real DDP, FSDP2 and HSDP jobs)."""

from __future__ import annotations

import pytest
import torch

import failslow.fsdp
from failslow.adapters.common.microbatch import ReplicaSplit
from failslow.adapters.fsdp.plugin import FSDPAdapter, flavor_of
from failslow.adapters.fsdp.shards import (
    local_model_state,
    local_optimizer_state,
    restore_model_state,
    restore_optimizer_state,
)
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan
from failslow.errors import ConfigError


def test_a_misspelt_setting_is_one_line_naming_it_before_anything_is_built():
    with pytest.raises(ConfigError, match="detecton") as info:
        failslow.fsdp.attach(None, None, config={"detecton": {}})
    assert "\n" not in str(info.value)


def test_a_model_that_is_not_distributed_is_refused_with_what_to_do():
    with pytest.raises(ConfigError, match="attach after fully_shard") as info:
        flavor_of(torch.nn.Linear(2, 2), None)
    assert "Linear" in str(info.value)


@pytest.mark.parametrize("name", ["accumulation_steps", "micro_batch_size"])
def test_batch_shape_must_be_positive_integers(name):
    with pytest.raises(ConfigError, match=name):
        FSDPAdapter(torch.nn.Linear(2, 2), None, **{name: 0})


def _adapter(flavor: str, unshard_once: bool = False) -> FSDPAdapter:
    adapter = FSDPAdapter.__new__(FSDPAdapter)
    adapter.flavor = flavor
    adapter.unshard_once = unshard_once
    adapter.model_factory = None
    adapter.session = None
    adapter.split = ReplicaSplit(replica=0, replicas=4, micro_batches=8, framework="FSDP")
    if flavor == "fsdp" and not unshard_once:
        adapter.split.by_size = 2  # as attach sets it: the size form (issue 46)
    return adapter


def _with_loader(adapter: FSDPAdapter) -> FSDPAdapter:
    """Its share-aware loader built (what a plan needs on a rank that reads data)."""
    adapter.split.loader(torch.utils.data.TensorDataset(torch.zeros(64, 1)), micro_batch_size=2)
    return adapter


def _plan(*counts: int) -> MicroBatchPlan:
    return MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))


def test_pure_fsdp_takes_plans_by_size_and_unshard_once_by_count():
    plain = _adapter("fsdp")
    assert plain.split.by_size == 2 and plain.split.count == 2  # G micro-batches whatever the plan
    for adapter in (_adapter("fsdp", unshard_once=True), _adapter("hsdp"), _adapter("ddp"), plain):
        assert adapter.failslow_capabilities().microbatch_plans == ""
        assert _with_loader(adapter).failslow_prepare_microbatch_plan(_plan(1, 3, 2, 2), rank=0)
    assert _adapter("fsdp", unshard_once=True).split.by_size is None


def test_a_plan_is_refused_while_the_rank_reads_data_failslow_cannot_re_cut():
    adapter = _adapter("ddp")
    with pytest.raises(ConfigError, match="a loader failslow does not re-cut per plan"):
        adapter.failslow_prepare_microbatch_plan(_plan(1, 3, 2, 2), rank=0)
    assert adapter.split.counts == (2, 2, 2, 2)


def test_counts_that_leave_a_replica_idle_or_miss_the_batch_are_refused():
    adapter = _with_loader(_adapter("ddp"))
    with pytest.raises(ConfigError, match="at least 1 micro-batch"):
        adapter.failslow_prepare_microbatch_plan(_plan(0, 4, 2, 2), rank=0)
    with pytest.raises(ConfigError, match="must sum to the 8"):
        adapter.failslow_prepare_microbatch_plan(_plan(1, 1, 1, 1), rank=0)


def test_topology_swaps_are_declared_with_their_reason():
    assert "one gradient group (DDP)" in _adapter("ddp").failslow_capabilities().topology_plans
    assert "1-D mesh" in _adapter("fsdp", True).failslow_capabilities().topology_plans
    hsdp = _adapter("hsdp")
    assert "model_factory" in hsdp.failslow_capabilities().topology_plans
    hsdp.model_factory = lambda mesh: None
    assert hsdp.failslow_capabilities().topology_plans == ""


def test_the_loss_scale_is_the_even_split_accumulation_under_any_plan():
    adapter = _adapter("ddp")
    adapter.split.apply(_plan(1, 3, 2, 2), step=0)
    assert adapter.loss_scale == 0.5  # 1 / G, G = 8 / 4


def test_the_size_forms_loss_scale_weighs_each_micro_batch_by_its_samples():
    """Pure FSDP by size: replica 1 of plan [1, 3, 2, 2] runs G = 2 micro-batches of 3
    samples (B = 2), each micro-loss times 1 / G times 3 / 2."""
    adapter = _adapter("fsdp")
    adapter.split.replica = 1
    adapter.split.apply(_plan(1, 3, 2, 2), step=0)
    adapter.iteration, adapter._begun = 0, None
    scales = []
    data = iter(range(10))
    for _ in adapter.step_batches(data):
        scales.append(adapter.loss_scale)
    assert scales == [0.75, 0.75]
    adapter.split.apply(_plan(2, 2, 2, 2), step=1)
    adapter.iteration = 1
    assert [adapter.loss_scale for _ in adapter.step_batches(data)] == [0.5, 0.5]


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_plain_tensors_round_trip_bitwise_and_the_optimizer_owns_its_copy():
    model, optimizer = _trained()
    saved_model = {k: v.clone() for k, v in local_model_state(model).items()}
    saved_opt = local_optimizer_state(optimizer)
    saved_opt = {
        "state": {i: {k: v.clone() for k, v in s.items()} for i, s in saved_opt["state"].items()},
        "param_groups": saved_opt["param_groups"],
    }
    other, other_opt = _trained()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    restore_model_state(other, saved_model)
    restore_optimizer_state(other_opt, saved_opt)
    for k, v in local_model_state(other).items():
        assert torch.equal(v, saved_model[k]), k
    for i, s in other_opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, saved_opt["state"][i][k])
            assert v.data_ptr() != saved_opt["state"][i][k].data_ptr()


def test_a_snapshot_of_another_model_is_refused_naming_the_keys():
    model, _ = _trained()
    state = local_model_state(model)
    state.pop("0.bias")
    state["extra"] = torch.zeros(1)
    with pytest.raises(KeyError, match=r"missing \['0.bias'\], extra \['extra'\]"):
        restore_model_state(model, state)
