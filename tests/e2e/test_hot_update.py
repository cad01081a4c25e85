"""Hot update of a real DeepSpeed job, an FSDP2 job, an Accelerate job and a Megatron-core job,
end to end (byterobust 6.1, 6.3; invariant 5).

``failslow run --controller 4 -- torchrun --nproc-per-node 4 -m failslow.demo.ds_worker``: a
ZeRO-1 job on CPU/gloo with an in-memory snapshot every step (its failslow block). While it
trains, ``failslow update submit --urgent`` changes its code path (a logging change: the
``FAILSLOW_DEMO_LOG_TAG`` the worker prints with); every rank commits its snapshot at one step
boundary and exits, the launcher restarts the job in place with the update, and every rank
resumes at that step. Then a bad update (the new version crashes at start) is submitted: it is
rolled back automatically within probation, and the job resumes again from its snapshot.

The same for ``failslow.demo.fsdp_worker`` under torchrun (PyTorch FSDP2, HSDP over 2 replicas x 2
shards, SGD with momentum, ``failslow.fsdp.attach``: each rank's snapshot holds its own shards),
for ``failslow.demo.accelerate_worker`` under ``accelerate launch`` (Accelerate's own loop over
the shuffled DataLoader it prepared, FSDP2 through its plugin: a resumed rank's fresh loader is
walked over the steps already trained, so it reads on where the job stopped), and for
``failslow.demo.megatron_worker`` (GPT, TP1 x PP2 x DP2, Megatron DDP, Adam,
scheduler, ``failslow.megatron.attach``), started by failslow's own launcher (``failslow run
--nproc-per-node 4 --preload megatron.core``): its ranks, the update's and the rollback's, are
forked from a process that imported Megatron once (``import megatron.core`` costs ~7 CPU-s per
process; three launches of four ranks under torchrun paid it twelve times). The torchrun path
is the DeepSpeed job's; the failslow launcher's hot update across two nodes is
``tests/e2e/test_failstop.py``'s.

Correctness: the final parameters (every rank's for Megatron) are bitwise those of the same job
run without any update - both restarts resumed the exact state (model, optimizer state -
ZeRO-1 partitions with momentum, FSDP2's shards with theirs, Adam moments and step -,
scheduler, data position, RNGs), so
the same operations ran on the same values.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from failslow.demo.rank_launch import COMPARED
from failslow.demo.worker_io import launch_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 60
SETTINGS = COMPARED  # runs compared bitwise: no mitigation strategy


WORKERS = {
    # framework: (the rank's module, its micro-batch size, parameter files compared)
    "deepspeed": ("failslow.demo.ds_worker", "32", ["parameters.npz"]),
    "fsdp": ("failslow.demo.fsdp_worker", "64", ["parameters.npz"]),
    "accelerate": ("failslow.demo.accelerate_worker", "64", ["parameters.npz"]),
    "megatron": ("failslow.demo.megatron_worker", "8", [f"model-rank{r}.npz" for r in range(4)]),
}
LAUNCHERS = {
    # framework: how ``failslow run`` starts its 4 ranks
    "deepspeed": ["--", sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "4"],
    "fsdp": ["--", sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "4"],
    "accelerate": ["--", sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
                   "--multi_gpu", "--num_processes", "4", "--num_machines", "1",
                   "--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1",
                   "--main_process_port", "0"],
    "megatron": ["--nproc-per-node", "4", "--preload", "megatron.core", "--no-warm", "--"],
}  # fmt: skip


def _env(out: Path, framework: str = "deepspeed") -> dict[str, str]:
    return launch_env(
        out,
        STEPS,
        FAILSLOW_DEMO_CONFIG=json.dumps(SETTINGS),
        FAILSLOW_DEMO_MICRO_BATCH_SIZE=WORKERS[framework][1],
    )


def _launch(tmp: Path, name: str, framework: str) -> tuple[subprocess.Popen[str], Path, Path]:
    out, state = tmp / name, tmp / f"{name}-state"
    out.mkdir()
    command = [
        sys.executable, "-m", "failslow.cli", "run", "--controller", "4",
        "--ring-dir", str(tmp / f"{name}-rings"), "--state-dir", str(state),
        "--snapshot-dir", str(tmp / f"{name}-snapshots"),
        "--probation", "120", "--update-poll", "0.3", "--no-shim", *LAUNCHERS[framework],
        "-m", WORKERS[framework][0],
    ]  # fmt: skip
    log = open(tmp / f"{name}.log", "w")
    env = _env(out, framework)
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, out, state


def _step(out: Path) -> int:
    try:
        record = json.loads((out / "progress-rank0.json").read_text())
    except (OSError, ValueError):
        return -1
    return max((s for s, _ in record["steps"]), default=-1)


def _wait(what, proc: subprocess.Popen[str], log: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if proc.poll() is not None:
            raise AssertionError(f"launcher ended ({proc.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _update(state: Path, *args: str) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "failslow.cli", "update", "submit", "--state-dir", str(state),
         "--urgent", *args],
        capture_output=True, text=True, env=_env(state), check=True,
    )  # fmt: skip
    return int(json.loads(_list(state))[-1]["id"]) if done.returncode == 0 else -1


def _list(state: Path) -> str:
    return subprocess.run(
        [sys.executable, "-m", "failslow.cli", "update", "list", "--json", "--state-dir",
         str(state)],
        capture_output=True, text=True, env=_env(state), check=True,
    ).stdout  # fmt: skip


@pytest.mark.parametrize("framework", sorted(WORKERS))
def test_hot_update_resumes_at_the_same_step_and_a_bad_one_is_rolled_back(
    tmp_path: Path, framework: str, request: pytest.FixtureRequest
) -> None:
    module = {"deepspeed": "deepspeed", "fsdp": "torch", "accelerate": "accelerate",
              "megatron": "megatron.core"}[framework]  # fmt: skip
    extra = f"needs the {framework} extra: pip install failslow[{framework}]"
    pytest.importorskip(module, reason=extra)
    # the job without updates, run once for every module (tests/e2e/conftest.py)
    reference = request.getfixturevalue(f"{framework}_reference")

    proc, out, state = _launch(tmp_path, "updated", framework)
    log = tmp_path / "updated.log"
    _wait(lambda: _step(out) >= 12, proc, log)
    good = _update(state, "--env", "FAILSLOW_DEMO_LOG_TAG=v2 ", "--note", "logging change")
    _wait(lambda: "v2 rank 0: resumed at step" in log.read_text() and _step(out) >= 30, proc, log)
    bad = _update(state, "--env", "FAILSLOW_DEMO_CRASH_AT_START=1", "--note", "broken")
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]

    text = log.read_text()
    history = {row["id"]: row for row in json.loads(_list(state))}
    assert history[good]["outcome"] == "applied", history[good]
    assert history[bad]["outcome"] == "rolled_back", history[bad]
    stopped_at = history[good]["applied_step"]
    # every rank came back at the step the update stopped it, with the new code path
    for rank in range(4):
        assert f"v2 rank {rank}: resumed at step {stopped_at}" in text
    assert "crashing at start as configured" in text
    # after the rollback the job resumed once more, still with the good update's code
    assert text.count("v2 rank 0: resumed at step") == 2

    wanted = reference(STEPS)  # rank 0's parameters; Megatron: each rank's
    for rank, file in enumerate(WORKERS[framework][2]):
        got = np.load(out / file)
        want = wanted.parts[rank] if framework == "megatron" else wanted
        assert sorted(got.files) == sorted(want.files)
        for name in want.files:
            assert np.array_equal(got[name], want[name]), f"{file}: {name}"
