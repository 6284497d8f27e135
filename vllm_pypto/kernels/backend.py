"""The interface every kernel backend implements (the numerics contract is reference.py).

A backend turns a loaded int8 weight and its per-channel scales into whatever layout its kernel
wants (`prepack`, once at load) and runs the A8W8 linear on bf16 activations (`linear`). Adding
a backend is a file with a subclass, and a line in select.py's BACKENDS.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class A8W8Backend(ABC):
    name: str
    runs_layers = False  # True: the model class hands it whole decoder layers (the PyPTO backend)
    fused_decoder_layer = False  # True: it has flag native_decoder_layer's one-op layer (model/decoder_layer.py)

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

    @abstractmethod
    def gemm_int32(self, x: torch.Tensor, amax: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
        """bf16 [M, K] quantized with the given row amax (fp32 [M], floored) -> the exact int32
        sums [M, N], no epilogue. Tensor-parallel row shards all-reduce these."""

    # The model class's fused ops (reference: kernels/layer_ref.py). The defaults run the torch
    # reference as one custom op each; a backend with native kernels overrides them.
    def linear_q(self, q: torch.Tensor, scale: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
        """Already-quantized activations (int8 [M,K], fp32 scale [M]) -> bf16 [M, N]."""
        w, ws = self.unpacked(packed)
        return torch.ops.pypto.a8w8_linear_q_ref(q, scale, w, ws)

    def rmsnorm_quant(self, x, residual, gamma, eps: float, deferred: bool = False):
        """(x [+ residual]) -> (q, scale, h: the next residual)."""
        return tuple(torch.ops.pypto.rmsnorm_quant_ref(x, residual, gamma, eps, deferred))

    def silu_mul_quant(self, gate_up):
        return tuple(torch.ops.pypto.silu_mul_quant_ref(gate_up))

    def silu_mul(self, gate_up):
        """bf16(SiLU(gate) * up) for a bf16 (tensor-parallel) down-proj."""
        return torch.ops.pypto.silu_mul(gate_up)

    def gate_up_silu_quant(self, q, scale, packed):
        w, ws = self.unpacked(packed)
        return tuple(torch.ops.pypto.gate_up_silu_quant_ref(q, scale, w, ws))

    def qk_norm_rope_cache(self, q, k, v, positions, q_gamma, k_gamma, eps: float, cos_sin, kv_cache, slots,
                           interior: str):
        """Flag native_attn_prologue: rotated bf16 q [T, nq*hd]; k (normed, rotated) and v written into
        vLLM-CPU's paged cache at `slots` (layer_ref.qk_norm_rope_cache)."""
        return torch.ops.pypto.qk_norm_rope_cache_ref(q, k, v, positions, q_gamma, k_gamma, eps, cos_sin, kv_cache,
                                                      slots, interior)

    def unpacked(self, packed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 [N,K] and fp32 [N] for the reference ops (a backend that repacks overrides every op)."""
        return packed["weight"], packed["weight_scale"]
