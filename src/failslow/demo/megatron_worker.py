"""One rank of the Megatron-core mitigation demo: GPT, PP2 x DP2 on CPU/gloo, one line of failslow.

Run by :mod:`failslow.demo.mitigation` as ``python -m failslow.demo.megatron_worker``. This is
a Megatron-LM training loop with failslow: the model, DDP, optimizer and scheduler built as
Megatron-LM builds them (:mod:`failslow.demo.megatron_job`), ``fs = failslow.megatron.attach(
model, optimizer, scheduler)``, and ``fs.forward_backward(...)`` where the loop called
``get_forward_backward_func()(...)``. The control store comes from ``$FAILSLOW_STORE``, the rings
from ``$FAILSLOW_RING_DIR`` (both set by the launcher, as ``failslow run --controller`` does);
the slowdown is injected from outside. The worker records its step times and, at the end, every
rank's parameters (``parameters-rank<r>.npz``; rank 0's also as ``parameters.npz``; by
Megatron's layout-free names as ``model-rank<r>.npz``). Beside where Megatron-LM logs them,
each step's loss (the last pipeline stage's) and gradient norm go to
``failslow.report_metrics`` (byterobust 4.1: a NaN, Inf or 5x jump asks for a rollback). Faults
for the demo and tests come through the plugin API (``FAILSLOW_DEMO_FAULT``,
:mod:`failslow.demo.fault_plugin`).

Environment: RANK, WORLD_SIZE, FAILSLOW_DEMO_STORE_PORT (and _HOST), FAILSLOW_DEMO_STEPS,
FAILSLOW_DEMO_OUT, FAILSLOW_DEMO_MICRO_BATCHES (per replica), FAILSLOW_DEMO_MICRO_BATCH_SIZE,
FAILSLOW_DEMO_WIDTH (hidden size), FAILSLOW_DEMO_CONFIG, FAILSLOW_DEMO_STOP_FILE (when every
rank sees it: end); for the hot-update tests FAILSLOW_DEMO_CRASH_AT_START and
FAILSLOW_DEMO_LOG_TAG; FAILSLOW_DEMO_LOADER (``failslow``, the default: ``fs.data_iterator``;
``own``: the loop's own iterator, :func:`~failslow.demo.megatron_job.pretraining_iterator`,
which failslow re-cuts per plan). Under torchrun (no FAILSLOW_DEMO_STORE_PORT) it joins torchrun's
rendezvous; restarted in place with an in-memory snapshot (``checkpoint.every_steps``), it
resumes at the snapshot's iteration. FAILSLOW_DEMO_SAVE_EVERY_STEP=1 (a reference run) also
saves each rank's model after every step (``model-step<N>-rank<r>.npz``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

PIPELINE_STAGES = 2


def main() -> None:

    from failslow.demo.worker_io import (
        all_ranks_see,
        announce_start,
        finish,
        join_world,
        run_record,
        worker_env,
        write_progress,
    )

    env = worker_env()  # a bad update that crashes at start does so before Megatron's imports
    import numpy as np

    import failslow
    import failslow.megatron
    from failslow.demo import fault_plugin
    from failslow.demo.megatron_job import GptShape, build_gpt, pretraining_iterator, train_step

    rank, world, steps, per_replica, out = env.rank, env.world, env.steps, env.per_replica, env.out
    join_world(rank, world)
    hidden = int(os.environ.get("FAILSLOW_DEMO_WIDTH", "128"))
    shape = GptShape(
        layers=4, hidden=hidden, heads=4, seq=64, vocab=512,
        micro_batch_size=int(os.environ.get("FAILSLOW_DEMO_MICRO_BATCH_SIZE", "8")),
        samples=8192,
    )  # fmt: skip
    # the grid failslow run chose if the job goes on without lost ranks (odyssey), else PP2
    tp, pp = failslow.megatron.parallel_sizes(1, PIPELINE_STAGES)
    job = build_gpt(tp, pp, seed=0, shape=shape)
    fs = failslow.megatron.attach(
        job.model,
        job.optimizer,
        job.scheduler,
        model_provider=job.extra["model_provider"],  # S3: rebuilt in place on new groups
        config=json.loads(os.environ.get("FAILSLOW_DEMO_CONFIG", "{}")),
        num_microbatches=per_replica,
        micro_batch_size=shape.micro_batch_size,
    )
    if os.environ.get("FAILSLOW_DEMO_LOADER", "failslow") == "own":  # Megatron-LM's own
        data = pretraining_iterator(
            job.dataset, steps=steps, iteration=fs.iteration, micro_batches=per_replica,
            micro_batch_size=shape.micro_batch_size,
        )  # fmt: skip
    else:
        data = fs.data_iterator(job.dataset)
    # tests and demos: a fault through the plugin API (hang, slow: the machine's, by slot)
    for fault in fault_plugin.from_env(job.model[0], lambda: fs.iteration):
        fs.session.pm.register(fault)
    stop_file = os.environ.get("FAILSLOW_DEMO_STOP_FILE")
    resumed = fs.session.resumed_step  # a restart in place (hot update) resumes from memory
    announce_start(rank, resumed)
    first = fs.iteration
    step_end: list[float] = [time.time()]
    every_step = os.environ.get("FAILSLOW_DEMO_SAVE_EVERY_STEP") == "1"

    def model() -> dict[str, Any]:
        return {name: t.detach().cpu().numpy() for name, t in fs.global_tensors().items()}

    for step in range(first, steps):
        if stop_file and all_ranks_see(stop_file):
            break  # the launcher ends the job here (every rank at the same step)
        losses, grad_norm = train_step(job, fs, data)
        # beside Megatron's training_log (byterobust 4.1): the loss where the last stage has
        # it, the gradient norm everywhere; a NaN, Inf or 5x jump asks for a rollback
        metrics = {} if grad_norm is None else {"grad_norm": grad_norm}
        if losses:
            metrics["loss"] = sum(float(x["lm loss"]) for x in losses) / len(losses)
        failslow.report_metrics(step, **metrics)
        step_end.append(time.time())
        if rank == 0:  # the launcher's view of the job's progress (it injects by step)
            write_progress(out, rank, step_end, first, step)
        if every_step:  # a reference run: the model after each step, for runs of any length
            np.savez(out / f"model-step{fs.iteration}-rank{rank}.npz", **model())
    record = run_record(rank, step_end, first, resumed, fs)
    record["coords"] = list(fs.topology.coords[rank])  # the role it ends in (after a swap)
    params = {n: p.detach().cpu().numpy() for n, p in job.model[0].module.named_parameters()}
    np.savez(out / f"model-rank{rank}.npz", **model())  # by layout-free names (any grid)
    finish(out, rank, record, params, fs, every_rank=True)


if __name__ == "__main__":
    main()
