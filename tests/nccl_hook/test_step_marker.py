"""Step markers from the global optimizer post-hook, on real torch optimizers (no world needed:
the marker writes into a ring directly)."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch

from failslow.core.events import OpCode
from failslow.core.ring import RingReader, RingWriter, ring_path
from failslow.nccl_hook.step_marker import StepMarker, optimizer_key


def engine_class() -> Any:
    """A fresh class each time: the marker wraps a class's ``step`` once, for good."""

    class Engine:
        """A framework's step around a torch optimizer: accumulates ``accumulate`` micro-steps,
        steps the optimizer on the last, then does more work (ZeRO's parameter all-gather)."""

        def __init__(self, model: torch.nn.Module, accumulate: int) -> None:
            self.opt = torch.optim.SGD(model.parameters(), lr=0.1)
            self.accumulate = accumulate
            self.micro = 0
            self.after: list[int] = []

        def step(self) -> None:
            self.micro += 1
            if self.micro % self.accumulate == 0:
                self.opt.step()
                time.sleep(0.002)  # the work after the optimizer, before the step returns
                self.after.append(time.monotonic_ns())

    return Engine


def _markers(path: Path) -> Any:
    reader = RingReader(path)
    try:
        records = reader.poll()
    finally:
        reader.close()
    assert (records["op"] == int(OpCode.STEP)).all()
    return records


def _run(tmp_path: Path, body: Any) -> Any:
    writer = RingWriter(ring_path(tmp_path, 0, 1), capacity=1 << 8, global_rank=0)
    marker = StepMarker()
    marker.attach(lambda: writer)
    try:
        body()
    finally:
        marker.detach()
    return _markers(writer.path)


def test_a_plain_optimizer_is_marked_after_each_step(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())

    def body() -> None:
        for _ in range(5):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()

    marks = _run(tmp_path, body)
    assert list(marks["call_index"]) == list(range(5))
    assert set(marks["group_key"].tolist()) == {optimizer_key(opt)}
    assert (marks["t_end_ns"] == marks["t_start_ns"]).all() and (marks["nbytes"] == 0).all()


def test_a_framework_step_is_marked_when_it_returns_once_per_optimizer_step(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(4, 2)
    engine = engine_class()(model, accumulate=2)

    def body() -> None:
        for _ in range(10):  # 5 optimizer steps
            model(torch.ones(3, 4)).sum().backward()
            engine.step()

    marks = _run(tmp_path, body)
    # the wrapper is installed during the first optimizer step, which stays unmarked; the
    # later ones are marked when Engine.step returned, after its own work
    assert len(marks) == 4 and list(marks["call_index"]) == list(range(4))
    assert set(marks["group_key"].tolist()) == {optimizer_key(engine.opt)}
    t = marks["t_start_ns"]
    assert all(a <= m for a, m in zip(engine.after[1:], t, strict=True))
    assert all(m < a for m, a in zip(t, engine.after[2:], strict=False))


def test_a_copied_framework_object_steps_its_own_optimizer(tmp_path: Path) -> None:
    """The wrapper sits on the class: a deep copy made after wrapping trains itself only."""
    model = torch.nn.Linear(4, 2)
    engine = engine_class()(model, accumulate=1)

    def body() -> None:
        model(torch.ones(3, 4)).sum().backward()
        engine.step()  # wraps Engine.step
        twin = copy.deepcopy(engine)
        before = [p.detach().clone() for p in model.parameters()]
        twin_params = [p for g in twin.opt.param_groups for p in g["params"]]
        for p in twin_params:
            p.grad = torch.ones_like(p)
        twin.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    marks = _run(tmp_path, body)
    assert len(marks) == 1  # the copy's step (the first one wrapped the class, unmarked)


def test_detached_marker_writes_nothing_and_steps_still_run(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    engine = engine_class()(model, accumulate=1)

    def body() -> None:
        for _ in range(2):
            model(torch.ones(3, 4)).sum().backward()
            engine.step()

    assert len(_run(tmp_path, body)) == 1
    engine.step()  # Engine.step is still wrapped; no marker is attached
    assert engine.micro == 3
    assert len(_markers(ring_path(tmp_path, 0, 1))) == 1
