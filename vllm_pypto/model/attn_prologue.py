"""Flag `native_attn_prologue`: a decoder layer's attention on vLLM-CPU as one opaque op.

By default a layer runs, between its QKV GEMM and O GEMM, vLLM's q/k RMSNorms and RoPE (traced
by torch.compile), then vLLM's Attention layer: a Python `unified_kv_cache_update` op that
writes K and V into the paged cache, and a Python `unified_attention_with_output` op around
vLLM-CPU's attention kernel. With the flag, one op (`torch.ops.pypto.attention_prologue`, opaque
to torch.compile as vLLM's own attention ops are) looks this layer's cache and metadata up
once, runs the backend's fused QK-norm + RoPE + cache write (csrc/attn_prologue.cpp natively;
the torch reference is layer_ref.qk_norm_rope_cache) and hands the rotated q straight to
vLLM-CPU's attention implementation, which reads K and V back from the cache.

Numerics are those of flag fused_qk_norm_rope (fp32, one bf16 rounding), with the rms from an
fp64 mean square; prefill, decode and prefix-cache hits all read the cache this op writes.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.utils.torch_utils import direct_register_custom_op

from ..kernels import get_backend, layer_ref
from ..kernels.ascend.paging import INTERIORS
from ..kernels.ops import pypto_lib

_TABLES: dict[tuple[int, int, float], torch.Tensor] = {}


def rope_table(max_positions: int, head_dim: int, theta: float) -> torch.Tensor:
    """One fp32 cos | sin table per (length, head_dim, theta), shared by every layer."""
    key = (max_positions, head_dim, theta)
    if key not in _TABLES:
        _TABLES[key] = layer_ref.rope_table(max_positions, head_dim, theta)
    return _TABLES[key]


def check_layer(layer, max_positions: int) -> None:
    """At model init: what the op implements, else a clear error naming what this layer has."""
    attn = layer.self_attn
    rope = attn.rotary_emb
    if type(rope) is not RotaryEmbedding or rope.rotary_dim != attn.head_dim or not rope.is_neox_style:
        raise ValueError(f"flag native_attn_prologue implements full-width rotate-half RoPE; this layer has "
                         f"{type(rope).__name__}(rotary_dim={rope.rotary_dim}, head_dim={attn.head_dim})")
    impl = attn.attn.impl
    if type(impl).__name__ != "CPUAttentionBackendImpl":
        raise ValueError(f"flag native_attn_prologue writes vLLM-CPU's paged KV cache; this layer's attention "
                         f"backend is {type(impl).__name__}")
    unsupported = {"kv_cache_dtype": impl.kv_cache_dtype != "auto", "alibi_slopes": impl.alibi_slopes is not None,
                   "sinks": getattr(impl, "sinks", None) is not None, "kv sharing": impl.kv_sharing_target_layer_name
                   is not None}
    if any(unsupported.values()):
        raise ValueError(f"flag native_attn_prologue supports a bf16 ('auto') KV cache without alibi, sinks or KV "
                         f"sharing; this layer has {[k for k, v in unsupported.items() if v]}")
    if max_positions < 1:
        raise ValueError(f"flag native_attn_prologue: max_model_len {max_positions}")


def check_interior(interior: str | None, flag: str) -> None:
    """At run time, before a cache write: vLLM-CPU's attention ISA packs its cache in a way we write."""
    if interior not in INTERIORS:
        raise RuntimeError(f"flag {flag}: vLLM-CPU's {interior!r} attention packs its KV cache in a way this op "
                           f"does not write (known: {sorted(INTERIORS)})")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, q_gamma: torch.Tensor,
               k_gamma: torch.Tensor, cos_sin: torch.Tensor, eps: float, layer_name: str) -> torch.Tensor:
    meta, layer, kv_cache, slots = get_attention_context(layer_name)
    T, hd = q.shape[0], layer.head_size
    out = q.new_empty(T, layer.num_heads * layer.head_size_v)
    write = slots is not None and kv_cache.numel() > 0
    interior = getattr(layer, "isa", None)
    if write:
        check_interior(interior, "native_attn_prologue")
    q = get_backend().qk_norm_rope_cache(q, k, v, positions, q_gamma, k_gamma, eps, cos_sin,
                                         kv_cache if write else None, slots if write else None, interior or "vec")
    if meta is None:  # a warm-up or profiling pass: no attention, as vLLM-CPU's own forward
        return out
    layer.impl.forward(layer, q.view(T, -1, hd), k.view(T, -1, hd), v.view(T, -1, hd), kv_cache, meta,
                       output=out.view(T, -1, layer.head_size_v))
    return out


def _attention_fake(q, k, v, positions, q_gamma, k_gamma, cos_sin, eps, layer_name):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


direct_register_custom_op("attention_prologue", _attention, fake_impl=_attention_fake, target_lib=pypto_lib,
                          dispatch_key="CPU")


def attention(layer, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The layer's attention output [T, nq*hd] from its QKV GEMM's q, k, v."""
    attn = layer.self_attn
    return torch.ops.pypto.attention_prologue(q, k, v, positions, attn.q_norm.weight, attn.k_norm.weight,
                                              layer.pypto_cos_sin, attn.q_norm.variance_epsilon,
                                              attn.attn.layer_name)
