"""The every-step snapshot engine (byterobust 6.3): dual slots, consistency, recovery, restarts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.checkpoint import blob
from failslow.core.checkpoint.snapshot import SnapshotError, Snapshotter, _LayoutCache

torch = pytest.importorskip("torch")

from test_blob import assert_bitwise  # noqa: E402  (after the torch skip)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A node-local directory as in production: tmpfs when the machine has one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="failslow-test-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def state_at(step: int, width: int = 16) -> dict[str, Any]:
    """A deterministic training-like state for ``step``."""
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(width, width, generator=gen),
            "b": torch.randn(width, generator=gen).half(),
        },
        "optim": {"exp_avg": torch.randn(width, width, generator=gen).bfloat16(), "step": step},
        "ids": torch.arange(step, step + 5),
        "np": np.full(3, step, dtype=np.int32),
        "meta": {"lr": 1e-3 / (step + 1), "name": "job"},
    }


def snapshot(snap: Snapshotter, state: Any, step: int) -> None:
    snap.start(state, step)
    snap.wait_consistent()
    assert snap.wait_sealed(timeout_s=30) == step


@pytest.mark.parametrize("where", ["memory", "shm"])
def test_load_is_bitwise(where: str, shm_dir: Path) -> None:
    with Snapshotter(None if where == "memory" else shm_dir, rank=0) as snap:
        assert snap.latest() is None and snap.load() is None
        for step in range(4):
            snapshot(snap, state_at(step), step)
        loaded = snap.load()
        assert loaded is not None
        assert loaded[0] == 3
        assert_bitwise(state_at(3), loaded[1])
        assert snap.stats is not None and snap.stats.step == 3 and snap.stats.nbytes > 0


def test_mutation_after_wait_consistent_does_not_reach_the_snapshot(shm_dir: Path) -> None:
    state = state_at(1, width=256)
    expected = {k: v.clone() for k, v in state["model"].items()}
    with Snapshotter(shm_dir, rank=0) as snap:
        snap.start(state, 1)
        snap.wait_consistent()
        for t in state["model"].values():  # the optimizer step
            t.add_(1)
        snap.wait_sealed()
        loaded = snap.load()
        assert loaded is not None
        assert_bitwise(expected, loaded[1]["model"])


def corrupt_payload(path: Path) -> None:
    with open(path, "r+b") as f:
        head = f.read(blob.HEADER_BYTES)
        manifest = blob.header_of(memoryview(head))["manifest_bytes"]
        f.seek(blob._align(blob.HEADER_BYTES + manifest) + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_newest_slot_falls_back_to_the_previous_step(shm_dir: Path) -> None:
    with Snapshotter(shm_dir, rank=3) as snap:
        snapshot(snap, state_at(10), 10)
        snapshot(snap, state_at(11), 11)
        newest = next(p for p in shm_dir.glob("rank3-slot*.fsck") if blob.verify(
            memoryview(p.read_bytes())) == 11)  # fmt: skip
        corrupt_payload(newest)  # bit rot in tmpfs, seen through the mapping
        loaded = snap.load()
        assert loaded is not None and loaded[0] == 10
        assert_bitwise(state_at(10), loaded[1])
        snapshot(snap, state_at(12), 12)  # the corrupt slot is free again, 10 is kept
        assert snap.load() is not None and snap.load()[0] == 12  # type: ignore[index]
    with Snapshotter(shm_dir, rank=3) as again:
        assert again.load()[0] == 12  # type: ignore[index]


def test_corrupt_slot_is_skipped_after_a_restart(shm_dir: Path) -> None:
    with Snapshotter(shm_dir, rank=0) as snap:
        snapshot(snap, state_at(1), 1)
        snapshot(snap, state_at(2), 2)
    corrupt_payload(shm_dir / "rank0-slot1.fsck")  # step 2 went to the second slot
    with Snapshotter(shm_dir, rank=0) as snap:
        assert snap.load()[0] == 1  # type: ignore[index]


CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_snapshot import state_at
    from failslow.core.checkpoint.snapshot import Snapshotter

    snap = Snapshotter(Path({directory!r}), rank=1)
    for step in range(1, 4):
        snap.start(state_at(step), step)
        snap.wait_consistent()
        snap.wait_sealed()
    snap.start(state_at(4), 4)
    os._exit(0)  # died mid-snapshot: no close, maybe no seal
    """
)


def test_a_new_process_resumes_from_the_directory(shm_dir: Path) -> None:
    child = CHILD.format(tests=str(Path(__file__).parent), directory=str(shm_dir))
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    with Snapshotter(shm_dir, rank=1) as snap:
        loaded = snap.load()
        assert loaded is not None and loaded[0] in (3, 4)
        assert_bitwise(state_at(loaded[0]), loaded[1])
        snapshot(snap, state_at(5), 5)  # and carries on over the slot not holding the newest
        assert snap.load()[0] == 5  # type: ignore[index]
        older = [blob.verify(memoryview(p.read_bytes())) for p in shm_dir.glob("rank1-slot*")]
        assert sorted(older) == [loaded[0], 5]


def test_this_process_reads_a_snapshot_left_by_another(shm_dir: Path) -> None:
    with Snapshotter(shm_dir, rank=0) as snap:
        snapshot(snap, state_at(8), 8)
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from failslow.core.checkpoint.snapshot import Snapshotter
        with Snapshotter(Path({str(shm_dir)!r}), rank=0) as snap:
            step, state = snap.load()
            print(step, state["model"]["w"].double().sum().item(), state["optim"]["step"])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=120
    )
    step, total, counter = out.stdout.split()
    assert int(step) == 8 and int(counter) == 8
    assert float(total) == state_at(8)["model"]["w"].double().sum().item()


def test_one_owner_per_rank_and_directory(shm_dir: Path) -> None:
    with Snapshotter(shm_dir, rank=0):
        with pytest.raises(SnapshotError, match="another live process"):
            Snapshotter(shm_dir, rank=0)
        Snapshotter(shm_dir, rank=1).close()  # other ranks share the directory


def test_structure_change_replans_and_grows_the_slot(shm_dir: Path) -> None:
    with Snapshotter(shm_dir, rank=0) as snap:
        snapshot(snap, state_at(0), 0)
        assert snap.stats is not None and snap.stats.replanned
        snapshot(snap, state_at(1), 1)  # same structure, other values (step, lr)
        assert not snap.stats.replanned
        assert_bitwise(state_at(1), snap.load()[1])  # type: ignore[index]
        bigger = state_at(2, width=64)  # new shapes: new layout, bigger slots
        snapshot(snap, bigger, 2)
        assert snap.stats.replanned
        assert_bitwise(bigger, snap.load()[1])  # type: ignore[index]
        extra = {**state_at(3, width=64), "new": torch.ones(3)}
        snapshot(snap, extra, 3)
        assert snap.stats.replanned
        assert_bitwise(extra, snap.load()[1])  # type: ignore[index]
        snapshot(snap, state_at(4), 4)  # back to small: a slot never shrinks, still reads
        assert snap.stats.replanned
        assert_bitwise(state_at(4), snap.load()[1])  # type: ignore[index]


@dataclass
class Opaque:
    """An arbitrary object in a training state (DeepSpeed's optimizer state holds its
    ``LossScaler``): pickled into the manifest, never walked."""

    n: float


def test_state_with_an_arbitrary_object_that_changes_is_planned_once(shm_dir: Path) -> None:
    """The object is compared by its pickle: a new value re-pickles the manifest, the layout
    stays (it was planned afresh every step before), and the snapshot holds the new value."""
    with Snapshotter(shm_dir, rank=0) as snap:
        for step in range(3):
            snapshot(snap, {"w": torch.ones(2), "obj": Opaque(step)}, step)
            assert snap.stats is not None and snap.stats.replanned == (step == 0)
            assert snap.load()[1]["obj"] == Opaque(step)  # type: ignore[index]


structures = st.recursive(
    st.one_of(
        st.integers(0, 3).map(lambda n: torch.zeros(n)),
        st.sampled_from([0, 1, True, 1.0, -0.0, 0.0, "a", None, b"x"]),
        st.integers(0, 2).map(lambda n: np.zeros(n, dtype=np.float32)),
        st.sampled_from([1.0, 2.0]).map(Opaque),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=2).map(tuple),
        st.dictionaries(st.sampled_from(["a", "b", 1, True]), children, max_size=3),
    ),
    max_leaves=8,
)


def test_a_tensor_and_a_value_that_trade_places_change_the_layout() -> None:
    """Same keys, same tensors, same values - but a tensor and a value swapped places: the
    cached layout must not be reused (hypothesis found it: the structure key recorded where
    the tensors were, not where the values were)."""
    first = {"b": torch.zeros(0), 1: torch.zeros(0), "a": 0}
    second = {"b": torch.zeros(0), 1: 0, "a": torch.zeros(0)}
    _, cache = _LayoutCache.plan(first)
    assert cache is not None
    assert cache.layout_for(second) is None  # a new structure: planned afresh


def test_a_state_holding_an_object_keeps_its_layout_cached() -> None:
    """DeepSpeed's optimizer state holds a ``LossScaler``: the layout was planned afresh every
    step (a walk and a pickle of the whole manifest in the training thread) because an object
    could not be compared. It is compared by its pickle, and one object held in two places
    is not taken for two equal ones (the manifest's pickle shares it)."""
    scaler = Opaque(1.0)
    state = {"optimizer": {"loss_scaler": scaler, "exp_avg": torch.zeros(3)}, "step": 1}
    _, cache = _LayoutCache.plan(state)
    assert cache is not None
    assert cache.layout_for(state).manifest == blob.plan(state).manifest
    scaler.n = 2.0  # the scaler moved: the same structure, a new manifest
    assert cache.layout_for(state).manifest == blob.plan(state).manifest
    shared = {"a": scaler, "b": scaler}
    twins = {"a": Opaque(2.0), "b": Opaque(2.0)}
    _, cache = _LayoutCache.plan(shared)
    assert blob.plan(twins).manifest != blob.plan(shared).manifest
    assert cache is not None and cache.layout_for(twins).manifest == blob.plan(twins).manifest


@given(sequence=st.lists(structures, min_size=1, max_size=6))
@settings(max_examples=150, deadline=None)
def test_cached_layout_matches_a_fresh_plan(sequence: list[Any]) -> None:
    """Whatever a state changes into, the cached path yields blob.plan's exact manifest."""
    layout, cache = _LayoutCache.plan(sequence[0])
    for state in sequence[1:]:
        fresh = blob.plan(state)
        cached = cache.layout_for(state) if cache is not None else None
        if cached is None:
            layout, cache = _LayoutCache.plan(state)
            cached = layout
        assert cached.manifest == fresh.manifest
        assert [o for _, o in cached.tensors] == [o for _, o in fresh.tensors]
        assert cached.payload_bytes == fresh.payload_bytes


def test_on_sealed_gets_each_step_and_its_buffer(shm_dir: Path) -> None:
    seen: list[tuple[int, int, int]] = []

    def backup(step: int, buf: memoryview) -> None:
        assert threading.current_thread() is not threading.main_thread()
        seen.append((step, blob.verify(buf), len(buf)))

    with Snapshotter(shm_dir, rank=0) as snap:
        snap.on_sealed(backup)
        for step in (5, 6, 7):
            snapshot(snap, state_at(step), step)
        snap.close()  # waits for the callbacks
    assert [(s, v) for s, v, _ in seen] == [(5, 5), (6, 6), (7, 7)]
    assert all(n == blob.plan(state_at(5)).total_bytes for *_, n in seen)


def test_busy_snapshot_is_skipped_and_counted(shm_dir: Path) -> None:
    release = threading.Event()
    with Snapshotter(shm_dir, rank=0) as snap:
        snap.on_sealed(lambda step, buf: release.wait(30))  # a slow peer
        snap.start(state_at(1), 1)
        snap.wait_consistent()
        snap.start(state_at(2), 2)  # step 1 is still being sent
        assert snap.skipped == 1
        snap.wait_consistent()  # nothing pending for step 2: returns at once
        release.set()
        assert snap.wait_sealed() == 1
        snap._pending.done.wait(30)  # type: ignore[union-attr]  # the callback has returned
        snapshot(snap, state_at(3), 3)
        assert snap.taken == 2 and snap.load()[0] == 3  # type: ignore[index]


def test_busy_snapshot_waits_when_asked(shm_dir: Path) -> None:
    release = threading.Event()
    with Snapshotter(shm_dir, rank=0, on_busy="wait") as snap:
        snap.on_sealed(lambda step, buf: release.wait(30))
        snap.start(state_at(1), 1)
        threading.Timer(0.2, release.set).start()
        snap.start(state_at(2), 2)  # blocks until step 1 has been sent
        assert snap.skipped == 0
        assert snap.wait_sealed() == 2


def test_going_back_in_time_discards_newer_snapshots(shm_dir: Path) -> None:
    with Snapshotter(shm_dir, rank=0, slots=3) as snap:
        for step in (10, 11, 12):
            snapshot(snap, state_at(step), step)
        snapshot(snap, state_at(6), 6)  # resumed from an older checkpoint elsewhere
        assert snap.load()[0] == 6  # type: ignore[index]
    with Snapshotter(shm_dir, rank=0, slots=3) as snap:
        assert snap.load()[0] == 6  # type: ignore[index]  # 11 and 12 are not resurrected


def test_copy_failure_is_raised_on_the_training_thread(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(dst: Any, tensor: Any) -> None:
        raise RuntimeError("device lost")

    with Snapshotter(shm_dir, rank=0) as snap:
        snapshot(snap, state_at(1), 1)
        monkeypatch.setattr(blob, "_copy_into", broken)
        snap.start(state_at(2), 2)
        with pytest.raises(SnapshotError, match=r"step 2 failed.*device lost"):
            snap.wait_consistent()
        monkeypatch.undo()
        assert snap.load()[0] == 1  # type: ignore[index]
        snapshot(snap, state_at(3), 3)


def test_rejects_bad_arguments(shm_dir: Path) -> None:
    with pytest.raises(ValueError, match="slots=1"):
        Snapshotter(shm_dir, rank=0, slots=1)
    with pytest.raises(ValueError, match="on_busy"):
        Snapshotter(shm_dir, rank=0, on_busy="never")  # type: ignore[arg-type]
    snap = Snapshotter(None, rank=0)
    snap.close()
    with pytest.raises(SnapshotError, match="closed"):
        snap.start({}, 0)


def test_a_rollback_forgets_the_steps_from_the_bad_one_in_slots_and_held_backups(
    shm_dir: Path,
) -> None:
    """A rollback before step 11: this rank's slots of 11 and 12 and the backups it holds of
    12 are uncommitted, on disk too - a restart after it cannot resume them - and 10 stays."""
    from failslow.core.checkpoint.backup import backup_path, committed_step, forget_backups

    with Snapshotter(shm_dir, rank=3, slots=3, on_busy="wait") as snap:
        for step in (10, 11, 12):
            snapshot(snap, state_at(step), step)
        by_step = {
            blob.verify(memoryview(p.read_bytes())): p for p in shm_dir.glob("rank3-slot*.fsck")
        }
        for k, step in enumerate((11, 12)):  # as if held for ward 5
            backup_path(shm_dir, 5, k).write_bytes(by_step[step].read_bytes())
        assert snap.forget_from(11) == [11, 12]
        loaded = snap.load()
        assert loaded is not None and loaded[0] == 10
        assert_bitwise(state_at(10), loaded[1])
    assert forget_backups(shm_dir, [5, 6], 12) == [12]  # ward 6: nothing held, no error

    def held() -> list[int | None]:
        return [committed_step(memoryview(backup_path(shm_dir, 5, k).read_bytes())) for k in (0, 1)]

    assert held() == [11, None]
    with Snapshotter(shm_dir, rank=3, slots=3, on_busy="wait") as again:
        assert again.load()[0] == 10  # type: ignore[index]
        snapshot(again, state_at(11), 11)  # the job snapshots the forgotten steps anew
        loaded = again.load()
        assert loaded is not None and loaded[0] == 11
        assert_bitwise(state_at(11), loaded[1])
