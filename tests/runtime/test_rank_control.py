"""The rank agent on the capture's trap (failslow.runtime.rank_control): what it armed does not
outlive it.

A validation round's pause request arms the trap at a collective ahead of the rank (greyhound
4.3). If the agent is detached before the rank gets there - the session closed at the end of
training, the exit handler's turn - nothing can release that pause any more: the collective at
the target (an exit barrier, a next session's first call) parked until the trap's own timeout,
its peers waiting inside it. Seen once as two ranks of a healthy DeepSpeed job under ``failslow
run --controller 4`` saying "paused for 60.0 s without a release" after a validation round, the
job taking 158 s instead of ~40 s. A 1-rank gloo job with the real capture and a real control
store: the request is armed, the agent detached, and the next collectives run through the target
without parking (the trap's own release counter stays 0; the timeout is 5 s here so that the
unfixed code fails in seconds, not in a minute).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]

SCRIPT = r"""
import json, sys, time
import torch
import torch.distributed as dist
import failslow.nccl_hook as hook
from failslow.core.control.store import open_store
from failslow.runtime import rank_control

control = open_store("tcp://127.0.0.1:0?master=1")
capture = hook.install(sys.argv[1])
job = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("gloo", store=job, rank=0, world_size=1)
dist.all_reduce(torch.ones(8))
agent = rank_control.attach(capture, control, poll_s=0.01)
words = capture.ensure_ring()
deadline = time.monotonic() + 20
while rank_control._current.position() is None and time.monotonic() < deadline:
    time.sleep(0.01)
key, next_call = rank_control._current.position()[:2]
control.set_json(
    "failslow/validate/pause", {"epoch": 1, "group_key": key, "call_index": next_call + 2}
)
while words.header_word("control") != 1 and time.monotonic() < deadline:
    time.sleep(0.01)
armed = words.header_word("control")
rank_control.detach()  # the session closed: nobody will release round 1
for _ in range(5):
    dist.all_reduce(torch.ones(8))  # call next_call + 2 is among these
print(json.dumps({
    "armed": armed, "control": words.header_word("control"),
    "self_releases": words.header_word("self_releases"),
}), flush=True)
dist.destroy_process_group()
"""


def test_a_pause_armed_by_a_detached_agent_does_not_park_the_next_collectives(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "rings")],
        capture_output=True, text=True, timeout=100,
        env={**os.environ, "FAILSLOW_PAUSE_TIMEOUT_S": "5"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    words = json.loads(result.stdout.strip().splitlines()[-1])
    assert words["armed"] == 1, words  # the request reached the trap: the case is set up
    assert words == {"armed": 1, "control": 0, "self_releases": 0}, result.stderr[-2000:]
    assert "without a release" not in result.stderr
