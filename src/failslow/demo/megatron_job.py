"""A Megatron-LM-style GPT job on CPU/gloo: the demo's and the tests' model (FRAMEWORKS_ON_CPU.md).

What Megatron users run, small: ``GPTModel`` with the local layer spec, Megatron's
``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam, optionally the distributed
optimizer), ``OptimizerParamScheduler`` and ``finalize_model_grads``, on the grid of
``initialize_model_parallel(tp, pp)``. The CUDA allocations Megatron-core hard-codes are moved
to the CPU by :mod:`failslow.demo.megatron_cpu` (demo and tests only).

Linear layers have no biases (``add_bias_linear=False``, as in LLaMA-style GPTs). With biases,
the attention's key bias has an analytically zero gradient (softmax ignores a shift shared by
every key); Adam divides its rounding noise (~1e-10) by its own square root and moves the bias
by ~lr in a random direction, so two runs that sum the same gradients in another order
differ by ~1e-4 relative - Adam amplifying rounding, not a different gradient. Without biases
the uneven-plan runs equal the even split's within the conformance bound (1e-6 relative).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class GptShape:
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    seq: int = 32
    vocab: int = 128
    micro_batch_size: int = 2
    samples: int = 256


@dataclass
class GptJob:
    """The pieces a Megatron-LM training loop holds."""

    model: list[Any]
    optimizer: Any
    scheduler: Any
    config: Any
    shape: GptShape
    dataset: Any
    extra: dict[str, Any] = field(default_factory=dict)

    def forward_step(self, data_iterator: Any, model: Any) -> tuple[Any, Any]:
        """Megatron's ``forward_step_func``: the batch (first/last stages), the loss function."""
        shape = self.shape
        batch = next(data_iterator) if data_iterator is not None else None
        tokens = labels = None
        if batch is not None:
            tokens, labels = batch[:, :-1], batch[:, 1:]
        positions = torch.arange(shape.seq).unsqueeze(0).expand(shape.micro_batch_size, -1)
        output = model(tokens, positions, None, labels=labels)

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule scales loss in place

        return output, loss_func


def init_grid(tp: int, pp: int, seed: int) -> None:
    """(Re)build Megatron's process groups for ``tp`` x ``pp`` (DP is the rest) and seed."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from failslow.adapters.megatron.grid import destroy_grid
    from failslow.demo.megatron_cpu import redirect_cuda_to_cpu

    redirect_cuda_to_cpu()
    if ps.model_parallel_is_initialized():
        destroy_grid()  # the old groups too, not only Megatron's references to them
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt(
    tp: int, pp: int, *, seed: int, distributed_optimizer: bool = False,
    shape: GptShape | None = None, lr: float = 1e-3,
) -> GptJob:  # fmt: skip
    """A fresh GPT job on a fresh ``tp`` x ``pp`` grid; the same ``seed`` builds the same job.
    ``job.extra["model_provider"]`` rebuilds model, optimizer and scheduler on the process
    groups in place (what ``failslow.megatron.attach(model_provider=...)`` wants)."""
    from megatron.core.utils import get_model_config

    shape = shape or GptShape()
    init_grid(tp, pp, seed)
    provider = GptProvider(tp, pp, distributed_optimizer, shape, lr)
    model, optimizer, scheduler = provider()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (shape.samples, shape.seq + 1), generator=g)
    job = GptJob(model, optimizer, scheduler, get_model_config(model[0]), shape, _Tokens(tokens))
    job.extra["model_provider"] = provider
    return job


@dataclass(frozen=True)
class GptProvider:
    """Model chunks (DDP-wrapped), optimizer and scheduler on Megatron's current groups: the
    ``model_provider`` of a Megatron-LM job, extended to the optimizer and scheduler."""

    tp: int
    pp: int
    distributed_optimizer: bool
    shape: GptShape
    lr: float
    cpu_initialization: bool = True
    """False: Megatron initializes the weights on the current CUDA device (a GPU job without
    the CPU redirect; benchmarks/gpu)."""

    def __call__(self) -> tuple[list[Any], Any, Any]:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.transformer_config import TransformerConfig

        shape, lr, distopt = self.shape, self.lr, self.distributed_optimizer
        config = TransformerConfig(
            num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            pipeline_dtype=torch.float32, use_cpu_initialization=self.cpu_initialization,
            gradient_accumulation_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
            add_bias_linear=False,
        )  # fmt: skip
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=shape.vocab,
            max_sequence_length=shape.seq,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
        )
        if not self.cpu_initialization:  # Megatron-LM's get_model moves the model too
            gpt.cuda(torch.cuda.current_device())
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distopt)
        model = DistributedDataParallel(config, ddp_config, gpt)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.01, clip_grad=0.0,
                use_distributed_optimizer=distopt,
            ),
            [model],
        )  # fmt: skip
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=2,
            lr_decay_steps=1000, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
            wd_incr_steps=1000, wd_incr_style="constant",
        )  # fmt: skip
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = model.no_sync
        config.grad_scale_func = optimizer.scale_loss
        return [model], optimizer, scheduler


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class PretrainingSampler:
    """How a Megatron-LM loop reads a pretraining dataset (its ``MegatronPretrainingSampler``
    with ``dataloader_type="single"``, written here for the demo with the same attributes):
    consecutive global micro-batches of ``micro_batch_size * data_parallel_size`` samples from
    ``consumed_samples`` on (a resumed run starts at ``iteration * global_batch_size``), this
    replica's slice of each. Like Megatron-LM's, it keeps ``data_parallel_rank`` and
    ``micro_batch_times_data_parallel_size``, not the data-parallel size itself."""

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int,
        data_parallel_rank: int, data_parallel_size: int,
    ) -> None:  # fmt: skip
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return self.total_samples  # as Megatron-LM's: samples, not batches

    def __iter__(self) -> Any:
        width = self.micro_batch_times_data_parallel_size
        lo = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - width + 1, width):
            yield list(range(start + lo, start + lo + self.micro_batch_size))


class ShuffledEpochs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``epochs`` passes over ``dataset``, each in the order of a permutation seeded with
    ``seed + epoch`` (Megatron-LM's GPT dataset shuffles its sample index when it is built)."""

    def __init__(self, dataset: Any, epochs: int, seed: int = 0) -> None:
        self.dataset, self.epochs, self.seed = dataset, epochs, seed
        self._order: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.dataset) * self.epochs

    def __getitem__(self, i: int) -> Any:
        epoch, at = divmod(i, len(self.dataset))
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(len(self.dataset), generator=g))
        return self.dataset[int(self._order[1][at])]


def pretraining_iterator(
    dataset: Any, *, steps: int, iteration: int, micro_batches: int, micro_batch_size: int,
) -> Any:  # fmt: skip
    """The loop's own data iterator, built as a Megatron-LM loop builds one:
    ``iter(DataLoader(dataset, batch_sampler=PretrainingSampler(...)))`` over enough shuffled
    epochs for ``steps`` steps of ``micro_batches`` per replica, from ``iteration`` on. Where
    the dataset holds whole global batches (the demo's), each step reads the samples
    ``fs.data_iterator(dataset)`` reads (the same permutation per epoch), split over the
    replicas otherwise."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    global_batch = micro_batches * micro_batch_size * dp
    epochs = -(-steps * global_batch // len(dataset))
    sampler = PretrainingSampler(
        len(dataset) * epochs, iteration * global_batch, micro_batch_size, rank, dp
    )
    loader = torch.utils.data.DataLoader(ShuffledEpochs(dataset, epochs), batch_sampler=sampler)
    return iter(loader)


def train_step(job: GptJob, adapter: Any, data: Any) -> tuple[list[Any], float | None]:
    """One iteration of the Megatron-LM loop with failslow's ``forward_backward``: the
    micro-batches' losses (the last pipeline stage's; empty on the others) and the gradient
    norm ``optimizer.step()`` returned (all-reduced over the model-parallel groups)."""
    for chunk in job.model:
        chunk.zero_grad_buffer()
    job.optimizer.zero_grad()
    losses = adapter.forward_backward(
        forward_step_func=job.forward_step,
        data_iterator=data,
        model=job.model,
        num_microbatches=adapter.split.micro_batches // adapter.split.replicas,
        seq_length=job.shape.seq,
        micro_batch_size=job.shape.micro_batch_size,
        forward_only=False,
    )
    ok, grad_norm, _ = job.optimizer.step()
    if ok:
        job.scheduler.step(increment=adapter.split.micro_batches * job.shape.micro_batch_size)
    return list(losses or []), None if grad_norm is None else float(grad_norm)
