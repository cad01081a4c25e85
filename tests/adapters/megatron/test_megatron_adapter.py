"""The Megatron adapter's refusals and config errors, without a world (the conformance suite
and the end-to-end test run it on real Megatron-core jobs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.utils.data import DataLoader, DistributedSampler

pytest.importorskip(
    "megatron.core", reason="needs the Megatron extra: pip install failslow[megatron]"
)

import failslow.megatron
from failslow.adapters.common.microbatch import ReplicaSplit
from failslow.adapters.megatron.plugin import MegatronAdapter
from failslow.capabilities import Unsupported
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan
from failslow.errors import ConfigError


def test_a_misspelt_setting_is_one_line_naming_it_before_anything_is_built():
    with pytest.raises(ConfigError, match="detecton") as info:
        failslow.megatron.attach(None, None, config={"detecton": {}})
    assert "\n" not in str(info.value)


def _adapter(*, ep: int = 1, chunks: int = 1, pp: int = 2, **config: object) -> MegatronAdapter:
    """The adapter's plan rules over a given layout (built without parallel_state)."""
    adapter = MegatronAdapter.__new__(MegatronAdapter)
    adapter.model = [object()] * chunks
    adapter.model_provider = None
    adapter._swap_refusal = ""
    adapter.ep = ep
    defaults = {
        "enable_cuda_graph": False,
        "cuda_graph_impl": "none",
        "microbatch_group_size_per_vp_stage": None,
    }
    adapter.config = SimpleNamespace(**{**defaults, **config})
    adapter.topology = SimpleNamespace(pp=pp)
    adapter.split = ReplicaSplit(replica=0, replicas=2, micro_batches=8, framework="Megatron-core")
    adapter.session = None
    adapter.iteration = 0
    adapter._observe_split()
    return adapter


def _plan(*counts: int) -> MicroBatchPlan:
    return MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))


@pytest.mark.parametrize(
    ("adapter", "reason"),
    [
        (_adapter(ep=2), "expert parallelism"),
        (_adapter(enable_cuda_graph=True), "CUDA graphs"),
        (_adapter(cuda_graph_impl="local"), "CUDA graphs"),
    ],
)
def test_plans_are_refused_with_the_reason_a_user_reads(adapter, reason):
    assert reason in adapter.failslow_capabilities().microbatch_plans
    with pytest.raises(Unsupported, match=reason):
        adapter.failslow_prepare_microbatch_plan(_plan(2, 6), rank=0)


def test_a_replica_with_no_micro_batch_is_refused():
    with pytest.raises(ConfigError, match="at least 1 micro-batch"):
        _adapter().failslow_prepare_microbatch_plan(_plan(0, 8), rank=0)


def test_the_interleaved_schedule_takes_only_counts_its_group_rule_allows():
    adapter = _adapter(chunks=2, pp=2)  # virtual pipeline: group size defaults to PP = 2
    assert adapter.failslow_prepare_microbatch_plan(_plan(2, 6), rank=0)
    with pytest.raises(ConfigError, match="interleaved schedule cannot run 1"):
        adapter.failslow_prepare_microbatch_plan(_plan(1, 7), rank=0)
    adapter = _adapter(chunks=2, pp=2, microbatch_group_size_per_vp_stage=4)
    with pytest.raises(ConfigError, match="interleaved schedule cannot run 2"):
        adapter.failslow_prepare_microbatch_plan(_plan(2, 6), rank=0)


def test_a_plan_is_refused_once_the_loop_feeds_a_data_iterator_that_cannot_be_re_cut():
    """A loop's own iterator that is no DataLoader's (a generator): each replica would draw
    more or fewer batches of its own stream under a plan - other data than the even split's.
    Declared and refused with the reason and what to pass; the adapter's own iterator, or none
    (a middle pipeline stage), is fine."""
    adapter = _adapter()
    adapter._step_data = adapter._data_source(iter([]))
    assert adapter._step_data == "foreign"
    reason = adapter.failslow_capabilities().microbatch_plans
    assert "not a DataLoader's iterator" in reason and "fs.data_iterator(dataset)" in reason
    with pytest.raises(Unsupported, match=r"cannot be re-cut.*data_iterator=fs\.data_iterator"):
        adapter.failslow_prepare_microbatch_plan(_plan(2, 6), rank=0)
    adapter._step_data = adapter._data_source([None, None])
    assert adapter._step_data == "none"
    assert adapter.failslow_prepare_microbatch_plan(_plan(2, 6), rank=0)


def test_the_loops_own_dataloader_over_a_distributed_sampler_is_re_cut():
    """Megatron-LM's way: ``iter(DataLoader(..., sampler=DistributedSampler(rank=dp_rank)))``
    is taken over at the first training step (tests/adapters/common/test_own_loader.py reads
    it; the e2e test trains on it)."""
    dataset = list(range(64))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, seed=1)
    iterator = iter(DataLoader(dataset, batch_size=2, sampler=sampler))
    adapter = _adapter()
    assert adapter._data_source(iterator) == "own"
    assert adapter._data_source(iterator) == "own" and len(adapter.split.samplers) == 1
    adapter._step_data = "own"
    assert adapter.failslow_capabilities().microbatch_plans == ""
    assert adapter.failslow_prepare_microbatch_plan(_plan(2, 6), rank=0)


def test_topology_swaps_are_declared_with_their_reason():
    adapter = _adapter()
    assert "model_provider" in adapter.failslow_capabilities().topology_plans
    adapter.model_provider = lambda: None
    assert adapter.failslow_capabilities().topology_plans == ""
    adapter._swap_refusal = "context parallelism > 1: the topology record has no CP coordinates"
    assert "context parallelism" in adapter.failslow_capabilities().topology_plans


def test_a_rollback_in_place_puts_megatrons_scheduler_back_where_the_snapshot_was():
    """OptimizerParamScheduler.load_state_dict steps forward from where it stands: restoring a
    snapshot of step 32 into a scheduler at step 56 gave 88, and the wrong learning rate."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from failslow.adapters.megatron.plugin import _load_scheduler

    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=16,
        lr_decay_steps=1000, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=1000, wd_incr_style="constant",
    )  # fmt: skip
    for _ in range(4):
        scheduler.step(increment=8)
    state, lr = scheduler.state_dict(), optimizer.param_groups[0]["lr"]
    for _ in range(3):
        scheduler.step(increment=8)
    assert optimizer.param_groups[0]["lr"] != lr
    _load_scheduler(scheduler, state)
    assert scheduler.num_steps == 32
    assert optimizer.param_groups[0]["lr"] == lr
