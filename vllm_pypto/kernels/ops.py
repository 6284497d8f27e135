"""Torch custom ops wrapping the kernels, so vLLM's torch.compile traces them as
opaque calls (with a fake implementation for shape propagation) instead of
tracing into Python or graph-breaking on `torch._int_mm`."""

from __future__ import annotations

import torch
from torch.library import Library

from vllm.utils.torch_utils import direct_register_custom_op

from . import reference

# The library object must outlive the ops; one per process, created on import.
pypto_lib = Library("pypto", "FRAGMENT")


def _a8w8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return reference.a8w8_linear(x, weight, weight_scale)


def _a8w8_linear_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize_per_token(x.reshape(-1, x.shape[-1]))


def _quantize_per_token_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.numel() // x.shape[-1]
    return (x.new_empty(m, x.shape[-1], dtype=torch.int8), x.new_empty(m, dtype=torch.float32))


direct_register_custom_op("a8w8_linear_ref", _a8w8_linear_ref, fake_impl=_a8w8_linear_fake,
                          target_lib=pypto_lib, dispatch_key="CPU")
direct_register_custom_op("quantize_per_token_ref", _quantize_per_token, fake_impl=_quantize_per_token_fake,
                          target_lib=pypto_lib, dispatch_key="CPU")


def _register_native_fakes() -> None:
    """Shapes of the native CPU ops for torch.compile; they exist only where _C is built."""
    try:
        from .. import _C  # noqa: F401  (importing it registers torch.ops.pypto_cpu.*)
    except ImportError:
        return

    @torch.library.register_fake("pypto_cpu::a8w8_linear")
    def _(x, packed, comp, weight_scale):
        return x.new_empty(*x.shape[:-1], weight_scale.shape[0])

    @torch.library.register_fake("pypto_cpu::a8w8_gemm_s32")
    def _(x, packed, comp, amax, N):
        return x.new_empty(amax.shape[0], N, dtype=torch.int32)


_register_native_fakes()
