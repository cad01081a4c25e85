"""Benchmark job: Megatron-core 1F1B, PP=2 x DP=2 (world 4) on CPU/gloo.

Megatron's schedules hard-code "cuda" allocations; the test-only device redirect
``failslow.demo.megatron_cpu`` puts them on the CPU (benchmarking harness only).
DP gradients are all-reduced over Megatron's data-parallel group after each forward-backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _job import StepTimer, finish, start
from megatron.core import parallel_state as ps
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

from failslow.demo.megatron_cpu import redirect_cuda_to_cpu

SEQ, MBS, HIDDEN, MICRO = 64, 8, 512, 4

args = start(__doc__)
ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
redirect_cuda_to_cpu()
config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                           pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)


class Stage(torch.nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.config, self.model_type, self.first = config, ModelType.encoder_or_decoder, first
        self.net = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.ReLU(),
                                       torch.nn.Linear(2 * HIDDEN, HIDDEN))
        self.input_tensor = None

    def set_input_tensor(self, t):  # type: ignore[no-untyped-def]
        self.input_tensor = t[0] if isinstance(t, list) else t

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.net(x if self.first else self.input_tensor)


torch.manual_seed(ps.get_pipeline_model_parallel_rank())
model = Stage(ps.is_pipeline_first_stage())
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
fb = get_forward_backward_func()
dp_group = ps.get_data_parallel_group()


def forward_step(data_iterator, model):  # type: ignore[no-untyped-def]
    out = model(next(data_iterator))
    return out, lambda o: (o.square().mean(), {})


timer = StepTimer()
for _ in range(args.steps):
    data = iter([torch.randn(SEQ, MBS, HIDDEN) for _ in range(MICRO)])
    opt.zero_grad()
    fb(forward_step_func=forward_step, data_iterator=data, model=[model],
       num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dist.get_world_size(dp_group)
    opt.step()
    timer.step_done()
timer.write(args.out, "megatron_pp2dp2")
finish()
