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


def test_keep_global_batch_refuses_what_it_cannot_keep() -> None:
    split = ReplicaSplit(replica=0, replicas=3, micro_batches=3, minimum=1)
    with pytest.raises(ConfigError, match="cannot give each of 3 DP replicas at least 1"):
        split.keep_global_batch(2)
    split.loader(TensorDataset(torch.zeros(8, 1)), micro_batch_size=1)
    with pytest.raises(FailslowError, match="data loader was built before the restore"):
        split.keep_global_batch(8)
