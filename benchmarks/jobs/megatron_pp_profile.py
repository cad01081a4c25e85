"""Benchmark job: Megatron-core 1F1B, PP=2 (world 2, DP=1) on CPU/gloo, profile + step times.

One launch measures, round after round (``--rounds``), interleaved so that slow drifts of the
shared machine hit every micro-batch count alike:

1. the isolated profile the odyssey estimator needs (section IV-C), taken on both stages at the
   same time (both cores busy, as in the pipeline's steady state) but without the pipeline:
   Megatron's own ``schedules.forward_step`` / ``schedules.backward_step`` of one micro-batch
   on the stage (the last stage's forward includes the loss, its backward starts from the
   loss; stage 1's input requires grad as a received activation does, stage 0's does not),
   in the schedule's order (stage s keeps S - s micro-batches in flight), timed one call at a
   time with the compute thread's run-queue wait; the optimizer update (SGD ``step`` +
   ``zero_grad``) of each stage; and the point-to-point time of one activation
   (``[seq, mbs, hidden]`` fp32): one steady-state exchange through Megatron's
   ``P2PCommunicator`` (activation one way, gradient the other) and a plain gloo send/recv
   ping-pong (one way = round trip / 2);
2. the real pipeline: ``get_forward_backward_func()`` (the 1F1B schedule) for every micro-batch
   count of ``--micro``, ``--warmup`` untimed steps then ``--steps`` timed steps each (wall
   time between consecutive optimizer steps on each rank, ``time.perf_counter``).

Nothing is rebuilt between micro-batch counts (same model, optimizer, data tensors); the data
are created once, outside every timed region. Megatron's schedules hard-code "cuda"
allocations; the test-only device redirect ``failslow.demo.megatron_cpu`` puts them on
the CPU (benchmarking harness only). The failslow hook is not installed (this job measures the
estimator, not capture). Rank 0 writes everything (both ranks' samples) as JSON to ``--out``.
Started by ``benchmarks/step_time_estimator.py`` (it owns the TCPStore, as ``launch.py`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _job import finish
from megatron.core import parallel_state as ps
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.transformer.transformer_config import TransformerConfig

from failslow.demo.megatron_cpu import redirect_cuda_to_cpu

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--out", required=True)
ap.add_argument("--micro", default="2,4,8,16", help="micro-batch counts, comma separated")
ap.add_argument("--rounds", type=int, default=3, help="rounds run in any case")
ap.add_argument("--min-clean", type=int, default=8, help="clean steps wanted per Nm")
ap.add_argument("--max-rounds", type=int, default=10)
ap.add_argument("--budget-s", type=float, default=180, help="no new round after this")
ap.add_argument(
    "--max-run-delay",
    type=float,
    default=0.03,
    help="a step is clean if run-queue wait <= this fraction of its wall time",
)
ap.add_argument("--warmup", type=int, default=1, help="untimed steps per block")
ap.add_argument("--steps", type=int, default=4, help="timed steps per block")
ap.add_argument("--reps", type=int, default=8, help="profiled F/B pairs per block")
ap.add_argument("--p2p-reps", type=int, default=20, help="ping-pongs per block")
ap.add_argument("--seq", type=int, default=64)
ap.add_argument("--mbs", type=int, default=4)
ap.add_argument("--hidden", type=int, default=512)
ap.add_argument("--layers", type=int, default=1, help="transformer layers per stage")
args = ap.parse_args()
MICRO = [int(m) for m in args.micro.split(",")]
SEQ, MBS, HIDDEN = args.seq, args.mbs, args.hidden

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False
)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
redirect_cuda_to_cpu()
config = TransformerConfig(
    num_layers=world * args.layers,
    hidden_size=HIDDEN,
    num_attention_heads=8,
    pipeline_model_parallel_size=world,
    pipeline_dtype=torch.float32,
)
stage = ps.get_pipeline_model_parallel_rank()
first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
pp_group = ps.get_pipeline_model_parallel_group()


class Stage(torch.nn.Module):
    """``--layers`` pre-norm transformer encoder layers ([seq, batch, hidden], no dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.config, self.model_type = config, ModelType.encoder_or_decoder
        self.layers = torch.nn.Sequential(
            *[
                torch.nn.TransformerEncoderLayer(
                    HIDDEN, 8, 4 * HIDDEN, dropout=0.0, norm_first=True
                )
                for _ in range(args.layers)
            ]
        )
        self.input_tensor = None

    def set_input_tensor(self, t):  # type: ignore[no-untyped-def]
        self.input_tensor = t[0] if isinstance(t, list) else t

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.layers(x if first else self.input_tensor)


torch.manual_seed(stage)
model = Stage()
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
fb = get_forward_backward_func()
data = [torch.randn(SEQ, MBS, HIDDEN) for _ in range(max(MICRO))]
shape = (SEQ, MBS, HIDDEN)


def forward_step(data_iterator, model):  # type: ignore[no-untyped-def]
    out = model(next(data_iterator))
    return out, lambda o: (o.square().mean(), {})


def run_delay_s() -> float:
    """Seconds the calling (compute) thread has waited on a run queue: runnable while other
    processes or threads had the CPU (``/proc/thread-self/schedstat``)."""
    return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9


def _timed_op(fn, *a, **k):  # type: ignore[no-untyped-def]
    """(result, seconds, run-queue wait as a fraction of the seconds)."""
    d0, t0 = run_delay_s(), time.perf_counter()
    out = fn(*a, **k)
    t1, d1 = time.perf_counter(), run_delay_s()
    return out, t1 - t0, (d1 - d0) / (t1 - t0)


def profile_stage(reps: int) -> dict[str, list[float]]:
    """Isolated F/B of one micro-batch through Megatron's forward_step/backward_step, in the
    schedule's order (stage s keeps S - s micro-batches in flight: stage 0 of 2 runs
    F1 F2 B1 F3 B2 ...), plus the optimizer update; every sample with its run-queue wait."""
    out: dict[str, list[float]] = {
        k: [] for k in ("forward_s", "forward_delay", "backward_s", "backward_delay", "update_s")
    }
    store_: list = []
    it = iter(data * (reps + 4))
    grad_out = torch.randn(shape)
    depth = world - stage
    queue: list = []
    for i in range(reps + depth + 1):  # the first pairs warm the allocator and are dropped
        x = None if first else torch.randn(shape).requires_grad_(True)  # a received activation
        (y, _), tf, df = _timed_op(
            _forward_step,
            forward_step,
            it,
            model,
            1,
            x,
            store_,
            config,
            cp_group_size=1,
            is_last_stage=last,
        )
        queue.append((x, y))
        if len(queue) < depth:
            continue
        x, y = queue.pop(0)
        _, tb, db = _timed_op(
            _backward_step, x, y, None if last else grad_out, ModelType.encoder_or_decoder, config
        )
        store_.clear()
        if i > depth:
            out["forward_s"].append(tf)
            out["forward_delay"].append(df)
            out["backward_s"].append(tb)
            out["backward_delay"].append(db)
    for _ in range(3):  # the update of a full set of grads (tiny next to F/B, measured anyway)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        out["update_s"].append(time.perf_counter() - t0)
    return out


comm = P2PCommunicator(pp_group=pp_group, config=config)


def profile_p2p(reps: int) -> dict[str, list[float]]:
    """Isolated p2p of one activation between the two stages (both ranks call at once).

    ``exchange_s``: one steady-state 1F1B exchange through Megatron's own communicator - stage 0
    ``send_forward_recv_backward``, stage 1 ``send_backward_recv_forward`` (an activation one
    way, a gradient the other, as one batched isend/irecv pair), timed on each rank;
    ``oneway_s``: a plain gloo send/recv ping-pong, round trip / 2 (rank 0)."""
    buf = torch.randn(shape)
    peer = dist.get_global_rank(pp_group, 1 - stage)
    out: dict[str, list[float]] = {"exchange_s": [], "oneway_s": []}
    for i in range(reps + 3):
        dist.barrier(group=pp_group)
        t0 = time.perf_counter()
        if first:
            comm.send_forward_recv_backward(buf, shape, is_last_stage=False)
        else:
            comm.send_backward_recv_forward(buf, shape, is_first_stage=False)
        if i >= 3:
            out["exchange_s"].append(time.perf_counter() - t0)
    for i in range(reps + 3):
        t0 = time.perf_counter()
        if first:
            dist.send(buf, peer, group=pp_group)
            dist.recv(buf, peer, group=pp_group)
        else:
            dist.recv(buf, peer, group=pp_group)
            dist.send(buf, peer, group=pp_group)
        if i >= 3:
            out["oneway_s"].append((time.perf_counter() - t0) / 2)
    return out


# Diagnostic only (never an estimator input): the same forward_step/backward_step calls timed
# inside the running pipeline, to show where the pipeline's time goes.
inside: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "p2p_s": []}
_record = [False]


def _timed(fn, key):  # type: ignore[no-untyped-def]
    def wrapper(*a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = fn(*a, **k)
        if _record[0]:
            inside[key].append(time.perf_counter() - t0)
        return out

    return wrapper


_forward_step, _backward_step = schedules.forward_step, schedules.backward_step
schedules.forward_step = _timed(_forward_step, "forward_s")
schedules.backward_step = _timed(_backward_step, "backward_s")
P2PCommunicator._communicate = _timed(P2PCommunicator._communicate, "p2p_s")


def run_steps(nm: int, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """Wall seconds of ``steps`` timed steps and each one's run-queue wait fraction."""
    times, delays = [], []
    mark, d_mark = time.perf_counter(), run_delay_s()
    for i in range(warmup + steps):
        _record[0] = i >= warmup
        opt.zero_grad()
        fb(
            forward_step_func=forward_step,
            data_iterator=iter(data[:nm]),
            model=[model],
            num_microbatches=nm,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        opt.step()
        now, d_now = time.perf_counter(), run_delay_s()
        if i >= warmup:
            times.append(now - mark)
            delays.append((d_now - d_mark) / (now - mark))
        mark, d_mark = now, d_now
    _record[0] = False
    return times, delays


# Blocks: one per (round, Nm), the Nm order reversed every other round; each profiles right
# before it runs the pipeline, so profile and steps see the machine of the same moment.
# The 2 cores are shared with other jobs, and in a pipeline a stall of either rank stalls both.
# A timed step is "clean" if neither rank's compute thread waited on the run queue for more
# than --max-run-delay of the step (the same for both ranks: the max is all-reduced). Rounds go
# on until every Nm has --min-clean clean steps (or --max-rounds / --budget-s run out).
blocks = []
t_start = time.monotonic()
run_steps(max(MICRO), 2, 0)  # whole-job warm-up (first-touch allocations, gloo pairs)
n_clean = dict.fromkeys(MICRO, 0)
r = 0
while r < args.max_rounds and (r < args.rounds or min(n_clean.values()) < args.min_clean):
    if r >= args.rounds and time.monotonic() - t_start > args.budget_s:
        break
    for nm in MICRO if r % 2 == 0 else MICRO[::-1]:
        dist.barrier()
        prof = profile_stage(args.reps)
        dist.barrier()
        prof.update(profile_p2p(args.p2p_reps))
        dist.barrier()
        inside.update(forward_s=[], backward_s=[], p2p_s=[])
        step_s, step_delay = run_steps(nm, args.warmup, args.steps)
        worst = torch.tensor(step_delay, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        clean = [bool(w <= args.max_run_delay) for w in worst.tolist()]
        n_clean[nm] += sum(clean)
        blocks.append(
            {
                "round": r,
                "nm": nm,
                **prof,
                "step_s": step_s,
                "step_delay": step_delay,
                "step_delay_max": worst.tolist(),
                "step_clean": clean,
                "in_pipeline": {k: list(v) for k, v in inside.items()},
            }
        )
    r += 1

gathered: list = [None] * world
dist.all_gather_object(gathered, {"stage": stage, "blocks": blocks})
if rank == 0:
    Path(args.out).write_text(
        json.dumps(
            {
                "job": "megatron_pp_profile",
                "world": world,
                "pp": world,
                "dp": 1,
                "config": {
                    "seq": SEQ,
                    "mbs": MBS,
                    "hidden": HIDDEN,
                    "layers_per_stage": args.layers,
                    "micro": MICRO,
                    "rounds": r,
                    "warmup": args.warmup,
                    "steps": args.steps,
                    "reps": args.reps,
                    "p2p_reps": args.p2p_reps,
                    "min_clean": args.min_clean,
                    "max_run_delay": args.max_run_delay,
                    "activation_bytes": SEQ * MBS * HIDDEN * 4,
                    "torch": torch.__version__,
                    "threads_per_rank": torch.get_num_threads(),
                },
                "wall_s": time.monotonic() - t_start,
                "ranks": sorted(gathered, key=lambda g: g["stage"]),
            }
        )
    )
finish()
