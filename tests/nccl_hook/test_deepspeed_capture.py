"""DeepSpeed ZeRO-1 (2 ranks, CPU/gloo): the hook sees DeepSpeed's collectives.

DeepSpeed calls ``torch.distributed`` through references it stored at import; the hook sits in
the c10d dispatcher below them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from failslow.core.events import OpCode

pytest.importorskip("deepspeed")
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(300),
]

from _worlds import run_world  # noqa: E402


def test_zero1_step_collectives_captured(tmp_path: Path) -> None:
    world = run_world("deepspeed", 2, tmp_path, env={"DS_ACCELERATOR": "cpu"})
    keys = set()
    for r in world:
        res = r.result["result"]
        for step in range(res["steps"]):
            ev = sorted(r.window(f"ds_step{step}"), key=lambda e: e.t_start_ns)
            grads = [e for e in ev if e.op == OpCode.ALLREDUCE and e.nbytes > 4]
            gathers = [e for e in ev if e.op == OpCode.ALLGATHER]
            # ZeRO-1: one gradient all-reduce of every parameter byte, then the updated
            # partitions all-gathered (this rank's partition: 1/world of the parameters).
            assert sum(e.nbytes for e in grads) == res["param_bytes"]
            assert sum(e.nbytes for e in gathers) == res["param_bytes"] // res["world"]
            assert all(e.t_end_ns >= e.t_start_ns for e in ev)
            keys |= {e.group_key for e in ev}
    assert len(keys) >= 1
    assert all(k in world[0].groups for k in keys)
