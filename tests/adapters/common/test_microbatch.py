"""ReplicaSplit after a smaller world resumed a larger one (odyssey Eq. 12-13)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from failslow.adapters.common.microbatch import ReplicaSplit
from failslow.errors import ConfigError, FailslowError


def test_a_smaller_world_keeps_the_old_global_batch_and_gradient() -> None:
    """Eight micro-batches of a 4-replica world on 3 replicas: 3, 3, 2 - together exactly the
    old global batch - and each micro-loss scaled so that DeepSpeed's 1/G (G = 2) and the
    3-way mean give the old world's 1/8 per micro-batch."""
    data = TensorDataset(torch.arange(64.0).reshape(64, 1))
    old = []
    for r in range(4):
        split = ReplicaSplit(replica=r, replicas=4, micro_batches=8)
        loader = iter(split.loader(data, micro_batch_size=2, shuffle=True, seed=3))
        old += [next(loader)[0] for _ in range(split.count)]
    new = []
    for r in range(3):
        split = ReplicaSplit(replica=r, replicas=3, micro_batches=6)  # DeepSpeed's G * D
        assert split.keep_global_batch(8) == (3, 3, 2)
        assert split.count == (3, 3, 2)[r]
        scale = split.loss_scale(framework_divides_by_accumulation=True)
        assert scale * (1 / 2) / 3 == pytest.approx(1 / 8)  # x scale, / G, mean over D
        loader = iter(split.loader(data, micro_batch_size=2, shuffle=True, seed=3))
        new += [next(loader)[0] for _ in range(split.count)]
    assert torch.equal(torch.cat(old), torch.cat(new))  # the same samples, in the same order


def test_a_restart_in_place_of_the_smaller_world_keeps_the_old_global_batch() -> None:
    """The 3-replica world of the test above, restarted in place from its own snapshot: its
    split is built for its configured 6 micro-batches again, and the snapshot's counts bring
    back the old global batch of 8, its scale and the same samples from that step on (it
    once failed: "micro-batch counts [3, 3, 2] must sum to the 6 micro-batches")."""
    data = TensorDataset(torch.arange(64.0).reshape(64, 1))
    resumed, restarted = [], []
    for r in range(3):
        split = ReplicaSplit(replica=r, replicas=3, micro_batches=6)
        split.keep_global_batch(8)
        loader = iter(split.loader(data, micro_batch_size=2, shuffle=True, seed=3))
        batches = [next(loader)[0] for _ in range(2 * split.count)]  # steps 0 and 1
        resumed += batches[split.count :]
        state = split.state_dict(step=1)

        again = ReplicaSplit(replica=r, replicas=3, micro_batches=6)
        again.load_state_dict(state)
        assert (again.micro_batches, again.counts) == (8, (3, 3, 2))
        scale = again.loss_scale(framework_divides_by_accumulation=True)
        assert scale == split.loss_scale(framework_divides_by_accumulation=True) == 6 / 8
        loader = iter(again.loader(data, micro_batch_size=2, shuffle=True, seed=3, start_step=1))
        restarted += [next(loader)[0] for _ in range(again.count)]
    assert torch.equal(torch.cat(resumed), torch.cat(restarted))


def test_keep_global_batch_refuses_what_it_cannot_keep() -> None:
    split = ReplicaSplit(replica=0, replicas=3, micro_batches=3, minimum=1)
    with pytest.raises(ConfigError, match="cannot give each of 3 DP replicas at least 1"):
        split.keep_global_batch(2)
    split.loader(TensorDataset(torch.zeros(8, 1)), micro_batch_size=1)
    with pytest.raises(FailslowError, match="data loader was built before the restore"):
        split.keep_global_batch(8)


# ---- what a rank ran against the plan (the closed loop) ----------------------------------------
def _plan(*counts: int) -> Any:
    from failslow.core.planner.allocation import loss_weights
    from failslow.core.planner.plans import MicroBatchPlan

    return MicroBatchPlan(counts=counts, weights=tuple(loss_weights(counts)))


def _read_step(loader_iter: object, split: ReplicaSplit, n: int) -> None:
    for _ in range(n):
        next(loader_iter)  # type: ignore[call-overload]


def test_a_rank_that_ran_its_share_is_in_effect() -> None:
    data = TensorDataset(torch.arange(64.0).reshape(64, 1))
    split = ReplicaSplit(replica=2, replicas=4, micro_batches=8)
    split.micro_loss_scale = lambda: 1 / 2  # the framework's 1 / G, G = 8 / 4
    batches = iter(split.loader(data, micro_batch_size=2))
    plan = _plan(3, 2, 1, 2)
    assert split.ready(plan) == (3, 2, 1, 2)
    _read_step(batches, split, 2)  # step 0, the even split
    split.apply(plan, step=1)
    _read_step(batches, split, 1)  # step 1: one micro-batch
    assert split.verify(plan, step=1, forwards=1) == ""


def test_what_a_rank_ran_instead_of_the_plan_is_said() -> None:
    data = TensorDataset(torch.arange(64.0).reshape(64, 1))
    split = ReplicaSplit(replica=2, replicas=4, micro_batches=8)
    split.micro_loss_scale = lambda: 1 / 2
    batches = iter(split.loader(data, micro_batch_size=2))
    plan = _plan(3, 2, 1, 2)
    split.apply(plan, step=0)
    _read_step(batches, split, 1)
    # a loop of its own ran two forwards (the Trainer's accumulation)
    assert split.verify(plan, step=0, forwards=2) == (
        "ran 2 micro-batches in step 0, the plan gives its replica 1 (the training loop "
        "decides the count, not failslow)"
    )
    # the framework divided by another count: the weight is off
    split.micro_loss_scale = lambda: 1 / 4
    assert split.verify(plan, step=0, forwards=1).startswith(
        "weighted its gradient 0.25 in step 0 (1 micro-losses x 0.25), the plan 0.5"
    )
    split.micro_loss_scale = lambda: 1 / 2
    # the data of the step came from somewhere else: nothing read from the share-aware loader
    assert split.verify(plan, step=5, forwards=1) == (
        "read none of step 5's micro-batches from the share-aware loader (the loop feeds other "
        "data)"
    )
    # interleaved: two forwards per micro-batch
    split.forwards_per_micro_batch = 2
    assert split.verify(plan, step=0, forwards=2) == ""


def test_a_plan_is_refused_where_the_rank_reads_data_failslow_cannot_re_cut() -> None:
    split = ReplicaSplit(replica=0, replicas=2, micro_batches=4)
    split.loader_hint = "use fs.loader(dataset)"
    with pytest.raises(ConfigError, match=r"does not re-cut per plan.*use fs\.loader\(dataset\)$"):
        split.ready(_plan(1, 3))
    assert split.verify(_plan(1, 3), step=0, forwards=0).startswith("its split runs 2")
    split.reads_data = lambda: False  # a middle pipeline stage: no data of its own
    assert split.ready(_plan(1, 3)) == (1, 3)


def test_a_plan_is_refused_when_the_last_step_trained_on_a_loader_of_its_own() -> None:
    """The share-aware loader exists but the loop trains on a loader of its own: the last step
    read nothing from it, so a plan would change the count but not the data."""
    data = TensorDataset(torch.arange(64.0).reshape(64, 1))
    split = ReplicaSplit(replica=0, replicas=2, micro_batches=4)
    steps = {"first": 0, "now": 1}
    split.bind(lambda step: [], lambda: (steps["first"], steps["now"]))
    batches = iter(split.loader(data, micro_batch_size=2))
    with pytest.raises(ConfigError, match="step 0 trained on micro-batches the share-aware"):
        split.ready(_plan(1, 3))
    _read_step(batches, split, 2)  # step 0 read from it after all
    assert split.ready(_plan(1, 3)) == (1, 3)
    steps["first"] = 1  # a process resumed at step 1: step 0 was not its own
    steps["now"] = 1
    assert split.ready(_plan(1, 3)) == (1, 3)


def test_counts_in_force_can_be_set_again_after_the_loader_read_ahead() -> None:
    """A rollback to the counts in force must not fail on a loader that read ahead (it would
    change nothing)."""
    from failslow.adapters.common.data import ShareSampler

    sampler = ShareSampler(64, micro_batch_size=2, micro_batches=4, replica=0, replicas=2)
    reads = iter(sampler)
    for _ in range(6):  # three steps read
        next(reads)
    sampler.set_counts((2, 2), step=1)  # nothing changes
    with pytest.raises(FailslowError, match="already read up to step 2"):
        sampler.set_counts((1, 3), step=1)


def test_the_size_form_checks_samples_and_the_gradient_weight_the_adapter_applied() -> None:
    """Issue 46: every replica runs the loop's G micro-batches, the plan sizes them; the
    adapter notes the factor it put on each micro-loss (samples over B, times the
    framework's 1 / G) and the check compares their sum with the plan's weight."""
    data = TensorDataset(torch.arange(64.0).reshape(64, 1))
    split = ReplicaSplit(replica=1, replicas=4, micro_batches=8)
    split.by_size = 2
    batches = iter(split.loader(data, micro_batch_size=2))
    plan = _plan(1, 3, 2, 2)
    split.apply(plan, step=0)
    sizes = [len(next(batches)[0]) for _ in range(split.count)]
    assert split.count == 2 and sizes == [3, 3]
    assert [split.sample_share(j) for j in range(2)] == [1.5, 1.5]
    assert split.verify(plan, step=0, forwards=2) == ""  # nothing noted: reads only
    for j in range(2):
        split.note_weight(0, split.sample_share(j) / 2)
    assert split.verify(plan, step=0, forwards=2) == ""
    split.note_weight(0, 0.5)  # one micro-loss weighed twice
    assert split.verify(plan, step=0, forwards=2).startswith(
        "weighted its gradient 2 in step 0 (its micro-losses' factors by their samples), the "
        "plan 1.5"
    )
    with pytest.raises(ConfigError, match="sized in units of 2"):
        split.loader(data, micro_batch_size=4)
