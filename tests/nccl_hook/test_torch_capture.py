"""The Python hook on a real 2-rank gloo world: every op kind, DDP and FSDP2 (one shared world
per kernel: the C++ one of native/hook.cpp, built by ``./dev setup``, and the Python one)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from failslow.core.events import Flags, OpCode

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(300),
]

from _worlds import RankResult, require_native_hook, run_world  # noqa: E402


@pytest.fixture(scope="module", params=["native", "python"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> list[RankResult]:
    from failslow import envvars

    if request.param == "native":
        require_native_hook()
    kernel = "1" if request.param == "native" else "0"
    ranks = run_world("torch", 2, Path(tmp_path_factory.mktemp(f"torch_world_{request.param}")),
                      env={envvars.NATIVE_HOOK: kernel})
    assert all(r.result["native"] == (request.param == "native") for r in ranks)
    return ranks


def test_every_op_kind_recorded(world: list[RankResult]) -> None:
    for r in world:
        expected = r.result["result"]["ops"]["expected"]
        got = sorted(r.window("ops"), key=lambda e: e.t_start_ns)
        assert len(got) == len(expected), f"rank {r.rank}: {[e.op.name for e in got]}"
        for e, x in zip(got, expected, strict=True):
            assert (int(e.op), e.nbytes, e.peer, e.group_key) == (
                x["op"], x["nbytes"], x["peer"], x["key"]
            ), f"rank {r.rank}: {e} != {x}"
            assert e.t_end_ns >= e.t_start_ns > 0
            if "dtype" in x:
                assert int(e.dtype) == x["dtype"], f"rank {r.rank}: {e}"
            if "async_op" in x:
                assert bool(e.flags & Flags.ASYNC_OP) == x["async_op"], f"rank {r.rank}: {e}"
        assert r.writer_dropped == 0


def test_group_keys_equal_across_ranks(world: list[RankResult]) -> None:
    keys = [{e.group_key for e in r.window("ops")} for r in world]
    assert keys[0] == keys[1] and len(keys[0]) == 2


def test_call_index_counts_per_group(world: list[RankResult]) -> None:
    for r in world:
        by_group: dict[int, list[int]] = {}
        for e in sorted(r.events, key=lambda e: e.t_start_ns):
            by_group.setdefault(e.group_key, []).append(e.call_index)
        for seq in by_group.values():
            assert seq == list(range(seq[0], seq[0] + len(seq)))


def test_groupinfo_published_for_world_and_unsorted_group(world: list[RankResult]) -> None:
    for r in world:
        ops = r.result["result"]["ops"]
        w = r.groups[ops["world_key"]]
        assert w.ranks == (0, 1) and w.role == "world" and w.backend == "gloo"
        assert w.name == ops["world_name"]
        g = r.groups[ops["new_group"]["key"]]
        assert g.ranks == (1, 0), "group order, not sorted"
        assert g.name == ops["new_group"]["name"]


def test_uninstall_stops_capture(world: list[RankResult]) -> None:
    for r in world:
        assert r.window("uninstalled") == []


def test_ddp_bucket_allreduces_captured(world: list[RankResult]) -> None:
    for r in world:
        ddp = r.result["result"]["ddp"]
        assert ddp["equal"], "training with the hook must match training without it bitwise"
        # Step 0 uses the first-iteration bucket; later steps the rebuilt buckets.
        for step in range(2, ddp["steps"]):
            ars = [e for e in r.window(f"ddp_step{step}") if e.op == OpCode.ALLREDUCE]
            assert len(ars) >= 2, "bucket_cap_mb forces more than one bucket"
            assert sum(e.nbytes for e in ars) == ddp["param_bytes"]
            assert {e.group_key for e in ars} == {ddp["world_key"]}


def test_fsdp2_allgathers_and_reduce_scatters(world: list[RankResult]) -> None:
    for r in world:
        f = r.result["result"]["fsdp2"]
        for step in range(f["steps"]):
            ev = r.window(f"fsdp_step{step}")
            ag = Counter(e.nbytes for e in ev if e.op == OpCode.ALLGATHER)
            rs = Counter(e.nbytes for e in ev if e.op == OpCode.REDUCE_SCATTER)
            # Each sharded layer is gathered in forward and again in backward (resharded after
            # forward), and its full gradient reduce-scattered once.
            assert ag == Counter({b: 2 for b in f["layer_shard_bytes"]})
            assert rs == Counter({b: 1 for b in f["layer_bytes"]})
            assert {e.group_key for e in ev} == {f["mesh_key"]}


def test_every_optimizer_step_ends_with_a_step_marker(world: list[RankResult]) -> None:
    """One marker per optimizer step, after the step's calls, from DDP's and FSDP2's torch
    optimizers alike (the global post-hook); none while the hook is uninstalled."""
    for r in world:
        assert not [m for m in r.markers if _inside(m.t_start_ns, r, "uninstalled")]
        steps = [f"ddp_step{s}" for s in range(r.result["result"]["ddp"]["steps"])]
        steps += [f"fsdp_step{s}" for s in range(r.result["result"]["fsdp2"]["steps"])]
        indices = []
        for name in steps:
            marks = [m for m in r.markers if _inside(m.t_start_ns, r, name)]
            assert len(marks) == 1, f"rank {r.rank}, {name}: {len(marks)} step markers"
            (mark,) = marks
            assert mark.op == OpCode.STEP and mark.t_end_ns == mark.t_start_ns
            assert mark.nbytes == 0 and mark.peer == -1
            assert all(e.t_start_ns < mark.t_start_ns for e in r.window(name))
            indices.append((mark.group_key, mark.call_index))
        keys = {k for k, _ in indices}
        assert len(keys) == 1, "the same model shape and optimizer class: one key"
        assert [i for _, i in indices] == list(range(len(steps)))


def _inside(t: int, r: RankResult, name: str) -> bool:
    t0, t1 = r.result["windows"][name]
    return t0 <= t <= t1
