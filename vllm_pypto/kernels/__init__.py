"""Kernel backends behind one small interface.

A backend turns a loaded int8 weight and its per-channel scales into whatever layout
its kernel wants (`prepack`, once at load) and runs the A8W8 linear on bf16
activations (`linear`). The numerics contract is `reference.a8w8_linear`.

Backends: `reference` (torch, always there). Native CPU and PyPTO/Ascend backends
plug in here and are imported lazily, so the serving path never imports what the
machine cannot run. Choose with VLLM_PYPTO_BACKEND=auto|reference (default auto).
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from functools import cache

import torch

# A child of "vllm" so our lines use vLLM's log format and level.
logger = logging.getLogger("vllm.pypto")


class A8W8Backend(ABC):
    name: str

    @abstractmethod
    def isa(self) -> str:
        """What actually executes the int8 GEMM, for the once-per-process log line."""

    @abstractmethod
    def prepack(self, weight: torch.Tensor, weight_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """int8 [N,K] + fp32 [N] -> tensors stored on the layer. Must not keep `weight` alive
        if it repacks it (no second resident copy)."""

    @abstractmethod
    def linear(self, x: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
        """bf16 [..., K] -> bf16 [..., N] following the reference numerics."""


class ReferenceBackend(A8W8Backend):
    name = "reference"

    def isa(self) -> str:
        return "torch._int_mm (oneDNN/ATen int8 GEMM), fp32 epilogue in torch"

    def prepack(self, weight, weight_scale):
        return {"weight": weight.contiguous(), "weight_scale": weight_scale.float().contiguous()}

    def linear(self, x, packed):
        return torch.ops.pypto.a8w8_linear_ref(x, packed["weight"], packed["weight_scale"])


BACKENDS = ("auto", "reference")


def cpu_isa_flags() -> list[str]:
    """The int8-relevant ISA extensions this CPU reports (Linux /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ("avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8") if f in flags]


@cache
def get_backend(name: str | None = None) -> A8W8Backend:
    name = (name or os.environ.get("VLLM_PYPTO_BACKEND", "auto")).strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"VLLM_PYPTO_BACKEND={name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    from . import ops  # noqa: F401  registers torch.ops.pypto.*

    backend = ReferenceBackend()
    logger.info("pypto-a8w8: linear layers run on backend=%s (%s); CPU ISA: %s",
                backend.name, backend.isa(), " ".join(cpu_isa_flags()) or "unknown")
    return backend
