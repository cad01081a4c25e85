"""Megatron-core 1F1B, PP=2 (2 ranks, CPU/gloo): the hook sees the pipeline's p2p traffic."""

from __future__ import annotations

from pathlib import Path

import pytest

from failslow.core.events import OpCode, group_key

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(300),
]

from _worlds import run_world  # noqa: E402


def test_pp2_send_recv_captured_with_peers(tmp_path: Path) -> None:
    world = run_world("megatron", 2, tmp_path)
    for r in world:
        res = r.result["result"]
        key = group_key(res["pp_name"], res["pp_ranks"])
        assert r.groups[key].ranks == tuple(res["pp_ranks"])
        for step in range(res["steps"]):
            ev = r.window(f"pp_step{step}")
            sends = [e for e in ev if e.op == OpCode.SEND]
            recvs = [e for e in ev if e.op == OpCode.RECV]
            # 1F1B, 2 stages: every micro-batch's activation goes 0 -> 1, its gradient 1 -> 0.
            assert len(sends) == res["micro"] and len(recvs) == res["micro"]
            assert {(e.peer, e.nbytes, e.group_key) for e in sends + recvs} == {
                (res["peer"], res["act_bytes"], key)
            }
            assert all(e.t_end_ns >= e.t_start_ns for e in ev)
