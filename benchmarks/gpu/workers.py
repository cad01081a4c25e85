"""What each row of ``benchmarks/gpu/check.py`` runs in a process of its own (issue 50).

    python benchmarks/gpu/workers.py ROW [--options]

Every worker prints one JSON object as its last stdout line; ``check.py`` reads it. They need
CUDA except where a row says otherwise (``--device cpu`` runs the same code on the CPU, over
gloo, so the check can be dry-run on a machine without a GPU: nothing it prints then is a GPU
figure).

Rows:

* ``nccl_job``: the job ``failslow run`` launches in row 2 - one rank (``torchrun``'s env), a
  bf16 matmul and an all-reduce of a 16 MiB gradient-like tensor per step;
* ``calls``: row 3, host time per ``dist.all_reduce`` of 1 KiB on the job's process group, in
  blocks that alternate capture off and the Python hook on (``--modes``), in this process's
  environment (the check runs it without and with the shim's ``LD_PRELOAD``);
* ``gpt``: rows 4 and 6, a GPT-2 medium (355 M parameters, transformers, fp32 master weights,
  bf16 autocast, fused AdamW, batch 8 x 1024) in a one-rank DDP world on NCCL; ``--snapshot``
  interleaves blocks with and without the every-step :class:`Snapshotter`;
* ``gemm``: row 5, the controller's GEMM task and bf16/fp32 timings, healthy and beside a
  competing process (``burn``) on the same GPU, judged by the controller's :func:`diagnose`;
* ``burn``: back-to-back bf16 matmuls until killed (the competing stream of row 5);
* ``megatron``: row 8, Megatron-core's GPTModel (TP1 PP1) on the device with
  ``failslow.megatron.attach``: steps, a snapshot, more steps, restore, the same steps again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _device(args: argparse.Namespace) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("workers: no CUDA device (use --device cpu for a dry run)")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _world(device: torch.device) -> None:
    """A one-rank world (torchrun's env when it launched us, else a private TCPStore)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _emit(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)


# -- row 2: the job under failslow run ------------------------------------------------------------
def nccl_job(args: argparse.Namespace) -> None:
    device = _device(args)
    _world(device)
    n = 2048 if device.type == "cuda" else 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    grad = torch.randn(4 << 20, device=device)  # 16 MiB of fp32, like a DDP bucket
    step_s = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        for _ in range(8):
            a = torch.tanh(a @ a / n)
        dist.all_reduce(grad)
        grad.mul_(0.5)
        _sync(device)
        step_s.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    _emit({"steps": args.steps, "step_ms": 1e3 * statistics.median(step_s)})


def probe(args: argparse.Namespace) -> None:
    """The CUDA runtime calls the shim's device timing makes, from Python, with their codes."""
    import ctypes

    device = _device(args)
    torch.zeros(1, device=device)
    maps = Path("/proc/self/maps").read_text().splitlines()
    loaded = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    out: dict[str, Any] = {"loaded": loaded}
    rt = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            rt = ctypes.CDLL(name, mode=os.RTLD_NOW | os.RTLD_NOLOAD)
            out["found"] = name
            break
        except OSError:
            continue
    if rt is None:
        _emit(out)
        return
    stream = ctypes.c_void_p(torch.cuda.Stream().cuda_stream)
    ev0, ev1, cap, ms = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int(), ctypes.c_float()
    codes = {
        "is_capturing": rt.cudaStreamIsCapturing(stream, ctypes.byref(cap)),
        "create0": rt.cudaEventCreateWithFlags(ctypes.byref(ev0), 0),
        "record0": rt.cudaEventRecord(ev0, stream),
        "create1": rt.cudaEventCreateWithFlags(ctypes.byref(ev1), 0),
        "record1": rt.cudaEventRecord(ev1, stream),
    }
    torch.cuda.synchronize()
    codes["query1"] = rt.cudaEventQuery(ev1)
    codes["elapsed"] = rt.cudaEventElapsedTime(ctypes.byref(ms), ev0, ev1)
    out.update(codes=codes, ms=ms.value, capturing=cap.value)
    _emit(out)


# -- row 3: cost per call --------------------------------------------------------------------------
def calls(args: argparse.Namespace) -> None:
    import failslow.nccl_hook as hook

    device = _device(args)
    ring_dir = os.environ.get("FAILSLOW_RING_DIR") or tempfile.mkdtemp(prefix="fs-calls-")
    _world(device)
    t = torch.ones(256, device=device)  # 1 KiB
    modes = args.modes.split(",")
    for _ in range(200):  # warm-up: NCCL's first calls connect and tune
        dist.all_reduce(t)
    _sync(device)
    per_mode: dict[str, list[float]] = {m: [] for m in modes}
    order = [*modes, *reversed(modes)] * args.rounds  # ABBA: drift cancels
    flags: dict[str, bool] = {}
    for mode in order:
        if mode == "hook":
            capture = hook.install(ring_dir, global_rank=0)
            flags = {
                "native_hook": capture.native is not None,
                "hook_defers_nccl": bool(capture.defer_nccl),
            }
        _sync(device)
        t0 = time.perf_counter_ns()
        for _ in range(args.calls):
            dist.all_reduce(t)
        _sync(device)
        per_mode[mode].append((time.perf_counter_ns() - t0) / args.calls)
        if mode == "hook":
            hook.uninstall()
    dist.destroy_process_group()
    _emit(
        {
            "calls": 200 + args.calls * len(order),
            "ring_records": _ring_records(ring_dir),
            "ns_per_call": {m: statistics.median(v) for m, v in per_mode.items()},
            "spread": {m: [min(v), max(v)] for m, v in per_mode.items()},
            **flags,
        }
    )


# -- rows 4 and 6: a GPT training step -------------------------------------------------------------
def _gpt(device: torch.device, small: bool) -> tuple[Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    if small:  # the CPU dry run
        config = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=1024)
    else:  # GPT-2 medium
        config = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(device)
    return model, config


def gpt(args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel

    device = _device(args)
    _world(device)
    small = device.type != "cuda"
    model, config = _gpt(device, small)
    params = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.index is not None else None, bucket_cap_mb=25
    )
    fused = device.type == "cuda"
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    batch, seq = (8, 1024) if not small else (2, 64)
    g = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)

    def forward_backward() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = ddp(input_ids=tokens, labels=tokens).loss
        loss.backward()
        logged = loss.detach().float()
        dist.all_reduce(logged)  # the mean loss the training loop logs

    def state(step: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}

    snap = None
    if args.snapshot:
        from failslow.core.checkpoint.snapshot import Snapshotter

        shm = Path("/dev/shm")
        where = None
        if shm.is_dir():
            free = os.statvfs(shm)
            # two slots of the state (fp32 params + two Adam moments) with headroom
            if free.f_bavail * free.f_frsize > 3 * 2 * 3 * 4 * params:
                where = Path(tempfile.mkdtemp(prefix="fs-gpu-snap-", dir=shm))
        snap = Snapshotter(where, rank=0)
    ring_records = _ring_records()
    for _ in range(args.warmup):
        forward_backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    if snap is not None:  # the first two snapshots plan, allocate and page-lock both slots
        for k in range(2):
            snap.start(state(k), k)
            snap.wait_sealed(timeout_s=300)
        snap.taken = snap.skipped = 0
    _sync(device)
    blocks = args.blocks.split(",")
    times: dict[str, list[float]] = {b: [] for b in blocks}
    cpu: dict[str, list[float]] = {b: [] for b in blocks}
    stall: list[float] = []
    step = 0
    if snap is not None:
        snap.on_sealed(lambda s, _buf: None)
    for block in [*blocks, *reversed(blocks)] * args.rounds:
        use = snap is not None and block == "snapshot"
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            forward_backward()
            if use:
                s0 = time.perf_counter()
                snap.wait_consistent()
                stall.append(time.perf_counter() - s0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if use:
                s0 = time.perf_counter()
                snap.start(state(step), step)
                stall[-1] += time.perf_counter() - s0
        _sync(device)
        if use:
            snap.wait_consistent()
        times[block].append((time.perf_counter() - t0) / args.steps)
        cpu[block].append((time.process_time() - c0) / args.steps)
    result: dict[str, Any] = {
        "params": params,
        "step_s": {b: statistics.median(v) for b, v in times.items()},
        "cpu_s": {b: statistics.median(v) for b, v in cpu.items()},
        "block_step_s": times,
        "steps": args.steps,
        "rounds": args.rounds,
        "ring_records": _ring_records() - ring_records,
    }
    if snap is not None:
        snap.wait_sealed(timeout_s=120)
        result["snapshot"] = _snapshot_figures(snap, stall)
        snap.close()
    dist.destroy_process_group()
    _emit(result)


def _snapshot_figures(snap: Any, stall: list[float]) -> dict[str, Any]:
    last = snap.stats  # the newest committed snapshot's costs
    nbytes = last.nbytes if last else 0
    return {
        "nbytes": nbytes,
        "stall_ms_median": 1e3 * statistics.median(stall) if stall else None,
        "stall_ms_max": 1e3 * max(stall) if stall else None,
        "copy_s": last.copy_s if last else None,
        "seal_s": last.seal_s if last else None,
        "copy_gb_s": nbytes / last.copy_s / 1e9 if last and last.copy_s else None,
        "taken": snap.taken,
        "skipped": snap.skipped,
    }


def _ring_records(ring_dir: str | None = None) -> int:
    """Records written to this process's rings so far (0 with capture off)."""
    from failslow.core.ring import RingReader, find_rings

    ring_dir = ring_dir or os.environ.get("FAILSLOW_RING_DIR")
    if not ring_dir or not Path(ring_dir).is_dir():
        return 0
    total = 0
    for path in find_rings(ring_dir):
        reader = RingReader(path)
        total += len(reader.poll())
    return total


# -- row 5: GEMM validation ------------------------------------------------------------------------
def gemm(args: argparse.Namespace) -> None:
    import subprocess

    from failslow.config import FailslowConfig
    from failslow.core.localize.diagnose import diagnose
    from failslow.core.localize.validation.gemm import gemm_seconds
    from failslow.runtime.agent import run_task

    device = _device(args)
    size = None if device.type == "cuda" else 256
    config = FailslowConfig()  # the controller's defaults
    threshold = config.detection.threshold
    task = config.validation.gemm_task()
    if size:
        task["size"] = size

    def timed() -> dict[str, float]:
        return {k: float(v) for k, v in run_task(task).items() if k != "first"}

    t0 = time.perf_counter()
    first = timed()
    round_s = time.perf_counter() - t0
    healthy = [timed() for _ in range(args.repeats)]
    dtypes = ("bfloat16", "float32")
    spread = {d: [] for d in dtypes}
    for _ in range(args.repeats):
        for d, s in gemm_seconds(dtypes=dtypes, size=size, repetitions=3, device=device).items():
            spread[d].append(s)
    burner = subprocess.Popen(
        [sys.executable, __file__, "burn", "--device", args.device],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert burner.stdout is not None
        if burner.stdout.readline().strip() != "ready":  # its context is up, kernels running
            raise RuntimeError("the competing process did not start")
        time.sleep(args.burn_warmup)
        slowed = timed()
        # repeat before blame (the task's "confirm", issue 49): rank 3 is timed again and keeps
        # the fastest of both; a sustained competitor must still be named
        again = timed()
    finally:
        burner.terminate()
        burner.wait(timeout=30)
    peers = {r: {"ok": healthy[r]} for r in range(min(3, len(healthy)))}
    healthy_only = diagnose(peers, None, threshold=threshold)
    with_slow = diagnose({**peers, 3: {"ok": slowed}}, None, threshold=threshold)
    named = [s.rank for s in with_slow.slow_ranks] if with_slow else []
    confirmed = {d: min(v, again[d]) for d, v in slowed.items()}
    with_confirmed = diagnose({**peers, 3: {"ok": confirmed}}, None, threshold=threshold)
    _emit(
        {
            "task": task,
            "round_s": round_s,
            "first": first,
            "healthy": healthy,
            "slowed": slowed,
            "spread": {
                d: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                for d, v in spread.items()
            },
            "threshold": threshold,
            "healthy_named": [s.rank for s in healthy_only.slow_ranks] if healthy_only else [],
            "slowed_named": named,
            "slowdown": max(slowed.values()) / statistics.median(max(h.values()) for h in healthy),
            "confirmed": confirmed,
            "confirmed_named": [s.rank for s in with_confirmed.slow_ranks]
            if with_confirmed
            else [],
            "confirmed_slowdown": max(confirmed.values())
            / statistics.median(max(h.values()) for h in healthy),
        }
    )


def burn(args: argparse.Namespace) -> None:
    device = _device(args)
    n = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)
    _sync(device)
    print("ready", flush=True)
    while True:
        for _ in range(4):
            torch.matmul(a, b)
        _sync(device)


# -- row 8: Megatron-core on the device ------------------------------------------------------------
def megatron(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    import failslow.megatron
    from failslow.demo.megatron_job import GptProvider, GptShape

    device = _device(args)
    if device.type != "cuda":
        from failslow.demo.megatron_cpu import redirect_cuda_to_cpu

        redirect_cuda_to_cpu()
    else:  # the restored run must repeat the first one bit for bit
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    _world(device)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    shape = GptShape(
        layers=4, hidden=512, heads=8, seq=256, vocab=4096, micro_batch_size=4, samples=4096
    )
    model, optimizer, scheduler = GptProvider(
        1, 1, False, shape, 1e-3, cpu_initialization=device.type != "cuda"
    )()
    config = model[0].config
    fs = failslow.megatron.attach(
        model, optimizer, scheduler, num_microbatches=2, micro_batch_size=shape.micro_batch_size
    )
    params = list(model[0].module.parameters())
    on = {str(p.device) for p in params}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab, (shape.samples, shape.seq + 1), generator=g)

    def forward_step(data_iterator: Any, chunk: Any) -> tuple[Any, Any]:
        batch = next(data_iterator).to(device)
        positions = torch.arange(shape.seq, device=device).unsqueeze(0).expand(batch.shape[0], -1)
        output = chunk(batch[:, :-1], positions, None, labels=batch[:, 1:])

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    def steps(n: int, start: int) -> list[float]:
        losses = []
        for i in range(n):
            data = iter(tokens[(start + i) * 8 : (start + i + 1) * 8].split(4))
            model[0].zero_grad_buffer()
            optimizer.zero_grad()
            out = fs.forward_backward(
                forward_step_func=forward_step,
                data_iterator=data,
                model=model,
                num_microbatches=2,
                seq_length=shape.seq,
                micro_batch_size=shape.micro_batch_size,
                forward_only=False,
            )
            optimizer.step()
            scheduler.step(increment=8)
            losses.append(sum(float(x["lm loss"]) for x in out) / len(out))
        _sync(device)
        return losses

    from failslow.core.checkpoint.snapshot import Snapshotter

    t0 = time.perf_counter()
    first = steps(4, 0)
    step_s = (time.perf_counter() - t0) / 4
    with Snapshotter(None, rank=0) as snap:  # the every-step snapshot S4 restores from
        snap.start(fs.failslow_snapshot_state(4), 4)
        snap.wait_sealed()
        after = steps(3, 4)
        ref = [p.detach().clone() for p in params]
        loaded = snap.load()
        assert loaded is not None and loaded[0] == 4, loaded
        restored = fs.failslow_restore_state(loaded[1], 4)
    again = steps(3, 4)
    diff = max(float((p.detach() - r).abs().max()) for p, r in zip(params, ref, strict=True))
    fs.close()
    dist.destroy_process_group()
    _emit(
        {
            "megatron": _version("megatron-core"),
            "devices": sorted(on),
            "step_s": step_s,
            "losses": first,
            "after": after,
            "again": again,
            "restored": bool(restored),
            "max_param_diff": diff,
            "cpu_initialization": bool(config.use_cpu_initialization),
        }
    )


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "row", choices=["nccl_job", "probe", "calls", "gpt", "gemm", "burn", "megatron"]
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--modes", default="off,hook")
    ap.add_argument("--blocks", default="off")
    ap.add_argument("--snapshot", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--burn-warmup", type=float, default=0.5)
    args = ap.parse_args()
    globals()[args.row](args)


if __name__ == "__main__":
    main()
