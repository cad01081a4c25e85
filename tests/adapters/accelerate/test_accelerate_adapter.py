"""The Accelerate registration's errors and refusals, without a world (the conformance suite
runs it in Accelerate's own loop on real DDP and FSDP2 jobs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip(
    "accelerate", reason="needs the Accelerate extra: pip install failslow[accelerate]"
)

import failslow.accelerate
from failslow.adapters.accelerate.plugin import AccelerateAdapter
from failslow.adapters.common.microbatch import ReplicaSplit
from failslow.core.planner.allocation import loss_weights
from failslow.core.planner.plans import MicroBatchPlan
from failslow.errors import ConfigError


def _accelerator() -> SimpleNamespace:
    return SimpleNamespace(
        _models=[],
        _optimizers=[],
        _schedulers=[],
        prepare=lambda *a: a,
        gradient_accumulation_steps=2,
        _dataloaders=[],
    )


def test_a_misspelt_setting_is_one_line_naming_it_before_anything_is_built():
    with pytest.raises(ConfigError, match="detecton") as info:
        failslow.accelerate.attach(_accelerator(), config={"detecton": {}})
    assert "\n" not in str(info.value)


def test_before_prepare_the_registration_waits_and_says_so():
    accelerator = _accelerator()
    fs = failslow.accelerate.attach(accelerator)
    assert accelerator.prepare == fs._prepare_then_start  # prepare starts the session
    with pytest.raises(ConfigError, match=r"once accelerator.prepare\(model"):
        _ = fs.loader
    assert accelerator.prepare("x") == ("x",)  # nothing prepared yet: still waiting
    assert fs.adapter is None


def test_two_models_are_refused_naming_the_counts():
    accelerator = _accelerator()
    accelerator._models, accelerator._optimizers = [object(), object()], [object()]
    with pytest.raises(ConfigError, match=r"one model and one optimizer.*got 2 and 1"):
        AccelerateAdapter(accelerator)


def test_plans_need_the_share_aware_loader():
    adapter = AccelerateAdapter.__new__(AccelerateAdapter)
    adapter.flavor, adapter.unshard_once = "ddp", False
    adapter.split = ReplicaSplit(replica=0, replicas=2, micro_batches=4, framework="Accelerate")
    adapter.split.loader_hint = "build the training loader with fs.loader(dataset)"
    counts = (1, 3)
    plan = MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))
    with pytest.raises(ConfigError) as info:
        adapter.failslow_prepare_microbatch_plan(plan, rank=0)
    assert "a loader failslow does not re-cut per plan" in str(info.value)
    assert str(info.value).endswith("fs.loader(dataset)")


def test_a_single_process_job_is_refused_with_what_to_do():
    import torch

    accelerator = _accelerator()
    accelerator._models = [torch.nn.Linear(2, 2)]
    accelerator._optimizers = [SimpleNamespace(optimizer=None)]
    with pytest.raises(ConfigError, match=r"not distributed.*accelerate launch --num_processes"):
        AccelerateAdapter(accelerator, micro_batch_size=2)


def test_an_hsdp_swap_is_declared_with_accelerates_reason():
    from failslow.adapters.accelerate.plugin import NO_REBUILD

    adapter = AccelerateAdapter.__new__(AccelerateAdapter)
    adapter.flavor, adapter.unshard_once, adapter.model_factory = "hsdp", False, lambda m: m
    adapter.split = ReplicaSplit(replica=0, replicas=2, micro_batches=4, framework="Accelerate")
    assert adapter.failslow_capabilities().topology_plans == NO_REBUILD
