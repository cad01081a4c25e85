"""Test-only device redirect that lets Megatron-core's pipeline schedules run on CPU.

Megatron-core 0.16 hard-codes ``device="cuda"`` / ``torch.cuda.current_device()`` and calls
``torch.cuda.synchronize()`` in its p2p communication and schedules. :func:`redirect_cuda_to_cpu`
replaces the module-level ``torch`` name in those modules with a proxy whose CUDA allocations
land on ``cpu`` and whose synchronize is a no-op. Megatron's own code (the 1F1B schedule, its
p2p calls through ``torch.distributed``) runs unchanged; only the device is redirected.
Never use this outside tests.
"""

from __future__ import annotations

import types
from typing import Any

import torch

_MODULES = (
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
)


class _CpuCuda:
    """``torch.cuda`` as seen by the redirected modules."""

    def current_device(self) -> str:
        return "cpu"

    def synchronize(self, *_a: Any, **_k: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _cpu_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    dev = kwargs.get("device")
    if dev is not None and "cuda" in str(dev):
        kwargs = dict(kwargs, device="cpu")
    return kwargs


class _TorchOnCpu(types.ModuleType):
    """A stand-in for ``torch`` that puts "cuda" tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in ("empty", "zeros", "ones", "tensor", "full", "randn"):
            return lambda *a, **k: value(*a, **_cpu_kwargs(k))
        return value


def redirect_cuda_to_cpu() -> None:
    import importlib

    proxy = _TorchOnCpu()
    for name in _MODULES:
        importlib.import_module(name).torch = proxy
