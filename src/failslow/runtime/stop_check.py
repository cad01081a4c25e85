"""One machine's stop-time checks (byterobust 4.2 "Diagnose", 4.3 "NaN loss diagnosis"), run as
``python -m failslow.runtime.stop_check`` by ``failslow run`` on every slot of the job while
training is stopped (:mod:`failslow.node.stop_checks`).

The machines form a gloo world of their own (``RANK``, ``WORLD_SIZE``, the launcher's rendezvous
store) and each runs, in order:

1. **device**: ``C = A @ B`` for fixed 512 x 512 float32 inputs, against the same product in
   float64 - the relative error, and the time (median of 3);
2. **bitwise alignment**: one training step of a fixed reference model - a transformer encoder
   layer and a linear head, predefined weights (a fixed seed), fixed input and target, MSE, one
   SGD step - on one CPU thread (on CUDA: deterministic algorithms and cuBLAS workspace); the
   SHA-256 of the loss, every gradient and every updated weight. Identical machines compute
   identical bits;
3. **links**: a ring - each machine sends a known 1 MiB pattern to the next and checks, byte for
   byte, what the previous one sent, within the timeout.

The result (:func:`failslow.core.diagnosis.stop_checks.judge` reads it) is written to the job's
state directory after the local tests and again after the link test, so a machine whose link
test never ends has still reported its device and digest. Plugins registered for the job
(``$FAILSLOW_PLUGINS``, entry points) see ``failslow_stop_check_start`` first. Exit 0 when the
tests ran, whatever they found; 2 when this process cannot run them (its environment).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any

from failslow import envvars
from failslow.core.control.stop import STOP_CHECKS, write_rank_result

SEED = 20251013
"""The reference computation's weights, input and target: every machine draws the same."""
GEMM_SIZE = 512
LINK_BYTES = 1 << 20


def _device(torch: Any) -> Any:
    """The machine's device: its CUDA device (``LOCAL_RANK``) where there is one, else the CPU
    (the CUDA path is not exercised on the CPU machines this is tested on)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_test(torch: Any, device: Any = None) -> dict[str, float]:
    """The GEMM's relative error against float64, and its median time over 3 runs."""
    device = device or torch.device("cpu")
    generator = torch.Generator().manual_seed(SEED)
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, generator=generator).to(device)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, generator=generator).to(device)
    exact = a.double().cpu() @ b.double().cpu()
    times, product = [], None
    for _ in range(3):
        _sync(torch, device)
        started = time.perf_counter()
        product = a @ b
        _sync(torch, device)
        times.append(time.perf_counter() - started)
    assert product is not None
    error = float((product.double().cpu() - exact).abs().max() / exact.abs().max())
    return {"rel_error": error, "seconds": statistics.median(times)}


def reference_digest(torch: Any, device: Any = None) -> str:
    """The SHA-256 of one training step of the fixed reference model (see the module)."""
    from torch import nn

    device = device or torch.device("cpu")
    digest = hashlib.sha256()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        layer = nn.TransformerEncoderLayer(
            d_model=64, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True
        )
        model = nn.Sequential(layer, nn.Linear(64, 8)).to(device)
        x = torch.randn(4, 16, 64).to(device)
        target = torch.randn(4, 16, 8).to(device)
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    with torch.no_grad():  # one SGD step by hand (torch.optim's first use imports dynamo: 0.7 s)
        for p in model.parameters():
            p -= 0.1 * p.grad
    digest.update(loss.detach().cpu().numpy().tobytes())
    for p in model.parameters():
        assert p.grad is not None
        digest.update(p.grad.cpu().numpy().tobytes())
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def _pattern(torch: Any, sender: int) -> Any:
    words = torch.arange(LINK_BYTES // 4, dtype=torch.int64)
    return ((words * 2654435761 + sender * 40503) % (1 << 31)).to(torch.int32)


def link_test(torch: Any, dist: Any, rank: int, world: int) -> dict[str, Any]:
    """Send the pattern to the next machine, check the previous one's (one ring pass)."""
    prev, succ = (rank - 1) % world, (rank + 1) % world
    received = torch.empty(LINK_BYTES // 4, dtype=torch.int32)
    started = time.perf_counter()
    try:
        sent = dist.isend(_pattern(torch, rank), succ)
        dist.recv(received, prev)
        sent.wait()
    except Exception as exc:  # a peer gone or the timeout: this link is bad
        return {"from": prev, "ok": False, "why": f"no transfer: {type(exc).__name__}",
                "seconds": time.perf_counter() - started}  # fmt: skip
    seconds = time.perf_counter() - started
    wrong = int((received != _pattern(torch, prev)).sum())
    why = "" if not wrong else f"{wrong} of {received.numel()} words corrupted"
    return {"from": prev, "ok": not wrong, "why": why, "seconds": seconds}


def main() -> int:
    try:
        spec = json.loads(os.environ[envvars.STOP_CHECK])
        name, rank = str(spec["name"]), int(os.environ["RANK"])
        world, state_dir = int(os.environ["WORLD_SIZE"]), os.environ[envvars.STATE_DIR]
    except (KeyError, ValueError, TypeError) as exc:
        print(f"failslow stop check: cannot run here: {exc!r}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    from failslow.plugins import plugin_manager

    started = time.perf_counter()
    device = _device(torch)
    torch.set_num_threads(1)  # the same reductions in the same order on every machine
    if device.type == "cuda":  # CPU kernels are deterministic at one thread (and this costs 1 s)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    plugin_manager().hook.failslow_stop_check_start(rank=rank, incident=spec.get("incident", {}))
    result: dict[str, Any] = {"slot": os.environ.get(envvars.SLOT), "on": str(device)}
    result["device"] = device_test(torch, device)
    result["digest"] = reference_digest(torch, device)
    result["local_s"] = time.perf_counter() - started
    write_rank_result(state_dir, STOP_CHECKS, name, rank, result)
    if world > 1:
        timeout = datetime.timedelta(seconds=float(spec.get("timeout_s", 60)))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        result["join_s"] = time.perf_counter() - started - result["local_s"]
        try:
            result["link"] = link_test(torch, dist, rank, world)
            write_rank_result(state_dir, STOP_CHECKS, name, rank, result)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
