"""Torch custom ops wrapping the kernels, so vLLM's torch.compile traces them as
opaque calls (with a fake implementation for shape propagation) instead of
tracing into Python or graph-breaking on `torch._int_mm`."""

from __future__ import annotations

import torch
from torch.library import Library

from vllm.utils.torch_utils import direct_register_custom_op

from . import layer_ref, reference

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


# The model class's fused ops (kernels/layer_ref.py), one dispatch each.
def _rmsnorm_quant_ref(x: torch.Tensor, residual: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                       deferred: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer_ref.rmsnorm_quant(x, residual, gamma, eps, deferred)


def _rmsnorm_quant_fake(x, residual, gamma, eps, deferred):
    x2 = x.reshape(-1, x.shape[-1])
    return torch.empty_like(x2, dtype=torch.int8), x2.new_empty(x2.shape[0], dtype=torch.float32), torch.empty_like(x2)


def _silu_mul_quant_ref(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return layer_ref.silu_mul_quant(gate_up)


def _silu_mul_quant_fake(gate_up):
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    return (x2.new_empty(x2.shape[0], x2.shape[1] // 2, dtype=torch.int8),
            x2.new_empty(x2.shape[0], dtype=torch.float32))


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    return layer_ref.silu_mul(g, u)


def _silu_mul_fake(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _linear_q_ref(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
                  ) -> torch.Tensor:
    return layer_ref.linear_q(q, scale, weight, weight_scale)


def _linear_q_fake(q, scale, weight, weight_scale):
    return q.new_empty(q.shape[0], weight_scale.shape[0], dtype=torch.bfloat16)


def _gate_up_silu_quant_ref(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    return layer_ref.gate_up_silu_quant(q, scale, weight, weight_scale)


def _gate_up_silu_quant_fake(q, scale, *packed):
    n = packed[-1].shape[0]
    return q.new_empty(q.shape[0], n // 2), scale.new_empty(q.shape[0])


for _name, _fn, _fake in (("rmsnorm_quant_ref", _rmsnorm_quant_ref, _rmsnorm_quant_fake),
                          ("silu_mul_quant_ref", _silu_mul_quant_ref, _silu_mul_quant_fake),
                          ("silu_mul", _silu_mul, _silu_mul_fake),
                          ("a8w8_linear_q_ref", _linear_q_ref, _linear_q_fake),
                          ("gate_up_silu_quant_ref", _gate_up_silu_quant_ref, _gate_up_silu_quant_fake)):
    direct_register_custom_op(_name, _fn, fake_impl=_fake, target_lib=pypto_lib, dispatch_key="CPU")


def _qk_norm_rope_cache_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            q_gamma: torch.Tensor, k_gamma: torch.Tensor, eps: float, cos_sin: torch.Tensor,
                            kv_cache: torch.Tensor | None, slots: torch.Tensor | None, interior: str) -> torch.Tensor:
    return layer_ref.qk_norm_rope_cache(q, k, v, positions, q_gamma, k_gamma, eps, cos_sin, kv_cache, slots, interior)


def _qk_norm_rope_cache_fake(q, k, v, positions, q_gamma, k_gamma, eps, cos_sin, kv_cache, slots, interior):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


direct_register_custom_op("qk_norm_rope_cache_ref", _qk_norm_rope_cache_ref, mutates_args=["kv_cache"],
                          fake_impl=_qk_norm_rope_cache_fake, target_lib=pypto_lib, dispatch_key="CPU")


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

    torch.library.register_fake("pypto_cpu::a8w8_linear_q")(
        lambda q, scale, packed, comp, weight_scale: _linear_q_fake(q, scale, packed, weight_scale))
    torch.library.register_fake("pypto_cpu::rmsnorm_quant")(
        lambda x, residual, gamma, eps, deferred: list(_rmsnorm_quant_fake(x, residual, gamma, eps, deferred)))
    torch.library.register_fake("pypto_cpu::silu_mul")(_silu_mul_fake)
    torch.library.register_fake("pypto_cpu::silu_mul_quant")(lambda gate_up: list(_silu_mul_quant_fake(gate_up)))
    torch.library.register_fake("pypto_cpu::gate_up_silu_quant")(
        lambda q, scale, packed, comp, weight_scale: list(_gate_up_silu_quant_fake(q, scale, weight_scale)))
    torch.library.register_fake("pypto_cpu::qk_norm_rope_cache")(_qk_norm_rope_cache_fake)
    torch.library.register_fake("pypto_cpu::decode_attention")(
        lambda q, kv_cache, seq_lens, block_table, num_kv_heads, scale, interior:
        q.new_empty(q.shape[0], q.shape[1] * q.shape[2]))
    torch.library.register_fake("pypto_cpu::decoder_layer")(
        lambda x, residual, positions, weights, *layer_args: [torch.empty_like(x), torch.empty_like(x)])


_register_native_fakes()
