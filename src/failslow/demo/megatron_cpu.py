"""Megatron-core 0.16 on a CPU: a device redirect for its hard-coded CUDA calls (demo and tests).

Megatron-core allocates with ``device="cuda"`` / ``torch.cuda.current_device()``, calls
``torch.cuda.synchronize()`` and keeps its tensor-parallel RNG states as CUDA generator states
(FRAMEWORKS_ON_CPU.md, "Megatron-core"). :func:`redirect_cuda_to_cpu` replaces the module-level
``torch`` name in the modules that do so with a proxy whose "cuda" allocations land on ``cpu``,
whose synchronize is a no-op and whose CUDA RNG is the CPU generator. Megatron's own code (the
schedules, p2p, DDP buffers, optimizer, GPT model) runs unchanged; only the device moves.

The CPU demo (``failslow demo --framework megatron``) and the tests use it; the adapter never
does (:mod:`failslow.adapters.megatron` runs whatever device the job uses).
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch

MODULES = (
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.parallel_state",
    "megatron.core.rerun_state_machine",
)
_ALLOCATORS = (
    "empty", "zeros", "ones", "tensor", "full", "randn", "rand", "arange", "empty_like",
    "zeros_like", "ones_like", "as_tensor",
)  # fmt: skip


def _on_cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
    device = kwargs.get("device")
    if device is not None and "cuda" in str(device):
        kwargs = dict(kwargs, device="cpu")
    return kwargs


class _CpuCuda:
    """``torch.cuda`` as the redirected modules see it."""

    def current_device(self) -> str:
        return "cpu"

    def synchronize(self, *_a: Any, **_k: Any) -> None:
        return None

    def get_rng_state(self, *_a: Any, **_k: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, *_a: Any, **_k: Any) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def is_available(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _ALLOCATORS:
            return lambda *a, **k: value(*a, **_on_cpu(k))
        return value


def redirect_cuda_to_cpu() -> None:
    """Point Megatron-core's "cuda" at the CPU (idempotent; call before building the model)."""
    proxy = _TorchOnCpu()
    for name in MODULES:
        module = importlib.import_module(name)
        module.torch = proxy  # type: ignore[attr-defined]
    rng = importlib.import_module("megatron.core.tensor_parallel.random")
    rng._get_cuda_rng_state = lambda *a, clone=False, **k: (  # type: ignore[attr-defined]
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    rng._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[attr-defined]
    _cpu_tensors_typed_as_cuda("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer")


_CUDA_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _cpu_tensors_typed_as_cuda(module_name: str, class_name: str) -> None:
    """The distributed optimizer accepts parameters by ``param.type()`` naming a CUDA type: while
    it sorts them (``_build_model_and_main_param_groups``), CPU tensors report the CUDA name."""
    cls = getattr(importlib.import_module(module_name), class_name)
    build = cls.__dict__["_build_model_and_main_param_groups"]
    if getattr(build, "_failslow_cpu", False):
        return
    original = cls._build_model_and_main_param_groups  # bound (a classmethod)

    def typed_as_cuda(*args: Any, **kwargs: Any) -> Any:
        tensor_type = torch.Tensor.type

        def cuda_type(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            name = tensor_type(self, *a, **k)
            return _CUDA_TYPES.get(name, name) if not a and not k else name

        torch.Tensor.type = cuda_type  # type: ignore[method-assign]
        try:
            return original(*args, **kwargs)
        finally:
            torch.Tensor.type = tensor_type  # type: ignore[method-assign]

    typed_as_cuda._failslow_cpu = True  # type: ignore[attr-defined]
    cls._build_model_and_main_param_groups = staticmethod(typed_as_cuda)
