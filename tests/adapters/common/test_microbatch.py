"""ReplicaSplit after a smaller world resumed a larger one (odyssey Eq. 12-13)."""

from __future__ import annotations

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
