"""One rank of the demo job: a tiny transformer language model trained with DDP over gloo.

Run by the demo launcher as ``python -m failslow.demo.worker``; configured by the environment
(RANK, WORLD_SIZE, FAILSLOW_STORE_PORT, FAILSLOW_RING_DIR, FAILSLOW_DEMO_STEPS,
FAILSLOW_DEMO_OUT). The worker knows nothing about fail-slows: capture is switched on by the
hook, the slowdown comes from outside. It writes its own step timer (the ground truth the
ACF-derived iteration times are compared with) to ``steps-rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _build_model(vocab: int, d_model: int, layers: int):
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            layer = nn.TransformerEncoderLayer(
                d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(
                layer, num_layers=layers, enable_nested_tensor=False
            )
            self.head = nn.Linear(d_model, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            seq = tokens.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(seq)
            return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))

    return TinyLM()


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from failslow import nccl_hook

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    steps = int(os.environ.get("FAILSLOW_DEMO_STEPS", "240"))
    out = Path(os.environ["FAILSLOW_DEMO_OUT"])
    torch.set_num_threads(1)
    nccl_hook.install()

    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["FAILSLOW_STORE_PORT"]), world_size=world, is_master=False,
        timeout=__import__("datetime").timedelta(seconds=120),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

    torch.manual_seed(0)
    vocab, seq, batch = 512, 64, 16
    model = DistributedDataParallel(_build_model(vocab, d_model=128, layers=3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1000 + rank)
    loss_fn = torch.nn.CrossEntropyLoss()

    step_end_ns: list[int] = [time.monotonic_ns()]
    losses: list[float] = []
    for step in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=data)
        logits = model(tokens[:, :-1])
        loss = loss_fn(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0:  # a logging all-reduce every 10 steps, as real jobs do
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        step_end_ns.append(time.monotonic_ns())

    (out / f"steps-rank{rank}.json").write_text(
        json.dumps({"rank": rank, "pid": os.getpid(), "step_end_ns": step_end_ns, "loss": losses})
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
