"""Megatron-core 1F1B with PP=2 on CPU/gloo for the hook test (runs inside ``_worker.py``).

The pipeline schedule and its p2p calls are Megatron's own; only "cuda" allocations are
redirected to the CPU by :mod:`failslow.demo.megatron_cpu` (demo and tests only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

SEQ, MBS, HIDDEN, MICRO = 8, 4, 64, 4


class Stage(torch.nn.Module):
    def __init__(self, config: Any, first: bool) -> None:
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.first = first
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, t: Any) -> None:
        self.input_tensor = t[0] if isinstance(t, list) else t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x if self.first else self.input_tensor))


def scenario_megatron(ctx: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from failslow.demo.megatron_cpu import redirect_cuda_to_cpu

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    redirect_cuda_to_cpu()
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
        pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
    )
    torch.manual_seed(ps.get_pipeline_model_parallel_rank())
    model = Stage(config, first=ps.is_pipeline_first_stage())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fb = get_forward_backward_func()

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> Any:
        x = next(data_iterator)
        out = model(x)

        def loss_func(output: torch.Tensor) -> Any:
            loss = output.square().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    steps = 3
    for step in range(steps):
        data = iter([torch.randn(SEQ, MBS, HIDDEN) for _ in range(MICRO)])

        def one(data: object = data) -> None:
            opt.zero_grad()
            fb(forward_step_func=forward_step, data_iterator=data, model=[model],
               num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS,
               forward_only=False)
            opt.step()

        ctx["phases"].run(f"pp_step{step}", one)
    pp_group = ps.get_pipeline_model_parallel_group()
    other = next(r for r in dist.get_process_group_ranks(pp_group) if r != dist.get_rank())
    return {
        "steps": steps,
        "micro": MICRO,
        "act_bytes": SEQ * MBS * HIDDEN * 4,
        "peer": other,
        "first": ps.is_pipeline_first_stage(),
        "pp_ranks": dist.get_process_group_ranks(pp_group),
        "pp_name": pp_group.group_name,
    }
