"""The ``device`` fault (failslow.demo.slow_device): compute slowed, collectives not, switched
at step boundaries from a file. Accounting, not timing: what the mode waited is what its
factor owes for the operators it timed (give or take the carried remainder)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode

from failslow.demo import slow_device
from failslow.demo.slow_device import MIN_WAIT_S, SlowDevice, failslow_on_step, switch
from failslow.errors import ConfigError


def _owed_matches(mode: SlowDevice) -> None:
    owed = (mode.factor - 1.0) * mode.timed_s
    assert mode.timed_s > 0
    # what it slept plus what it carries is what it owed (a sleep overshoots: the carry < 0)
    assert mode.waited_s + mode._debt == pytest.approx(owed, rel=1e-9, abs=1e-12)
    assert mode._debt < MIN_WAIT_S


def test_forward_backward_and_optimizer_are_slowed_by_the_factor() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    with SlowDevice(3.0) as mode:
        loss = model(x).square().mean()
        forward_s = mode.timed_s
        loss.backward()  # the autograd engine's operators run under the thread's mode
        backward_s = mode.timed_s - forward_s
        opt.step()
    assert forward_s > 0 and backward_s > 0 and mode.timed_s > forward_s + backward_s
    _owed_matches(mode)
    assert _get_current_dispatch_mode() is None  # left with the block


def test_a_slowed_step_computes_the_same_numbers() -> None:
    def step() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        model(torch.randn(8, 16)).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = step()
    with SlowDevice(2.0):
        slowed = step()
    for a, b in zip(plain, slowed, strict=True):
        assert torch.equal(a, b)


def test_collectives_are_not_timed(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(1024)
        with SlowDevice(4.0) as mode:
            dist.all_reduce(t)
            dist.broadcast(t, 0)
            assert mode.timed_s == 0.0 and mode.waited_s == 0.0
            t.mul_(2.0)  # compute on the same thread is timed
            assert mode.timed_s > 0
    finally:
        dist.destroy_process_group()


def test_switched_at_step_boundaries_for_its_rank_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "slow-device.json"
    monkeypatch.setenv(slow_device.ENV, str(path))
    monkeypatch.setenv("RANK", "2")
    failslow_on_step(step=0, step_time_s=0.1)
    assert _get_current_dispatch_mode() is None  # no file: no fault
    switch(path, 1, 4.0)
    failslow_on_step(step=1, step_time_s=0.1)
    assert _get_current_dispatch_mode() is None  # another rank's device
    switch(path, 2, 4.0)
    try:
        failslow_on_step(step=2, step_time_s=0.1)
        assert slow_device._active is not None and slow_device._active.factor == 4.0
        assert _get_current_dispatch_mode() is not None
        failslow_on_step(step=3, step_time_s=0.1)  # unchanged: the same mode stays
        first = slow_device._active
        switch(path, 2, 2.0)
        os.utime(path, ns=(1, 1))  # a new mtime, whatever the clock's resolution
        failslow_on_step(step=4, step_time_s=0.1)
        assert slow_device._active is not first and slow_device._active.factor == 2.0
    finally:
        switch(path, None)
        failslow_on_step(step=5, step_time_s=0.1)
    assert slow_device._active is None and _get_current_dispatch_mode() is None
    assert not path.exists()


def test_a_factor_below_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="factor must be >= 1"):
        switch(tmp_path / "f.json", 0, 0.5)
    with pytest.raises(ConfigError, match="factor must be >= 1"):
        SlowDevice(0.0)
    switch(tmp_path / "f.json", 0, 1.5)
    assert json.loads((tmp_path / "f.json").read_text()) == {"rank": 0, "factor": 1.5}
