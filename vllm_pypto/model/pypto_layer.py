"""A Qwen3 decoder layer on the PyPTO backend (Ascend, or pypto-interpret on a CPU).

Decode-only steps (one new token per sequence) run each layer as one PyPTO kernel
(kernels/ascend/kernels.decode_layer) that reads this layer's attention metadata from vLLM's
forward context and writes the new K/V into vLLM's own paged cache, as vLLM's attention op
would. Every other step (prefill, mixed prefill + decode, a warm-up pass) runs our PyPTO
norm + quant, A8W8 linear and MLP kernels around the platform's attention, which writes the
cache there. Both write the same cache in the same layout, so prefix-cache hits read either.

It runs eager (the model class is excluded from torch.compile): the layer chooses its path from
the step's metadata at run time, as vLLM's attention op does, and pypto's jit builds, caches and
launches each kernel from Python, which a traced graph would only wrap.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

from ..kernels import layer_ref
from ..kernels.ascend import paging

# flags with PyPTO kernels; any other refuses to start rather than run without it
SUPPORTED_FLAGS = frozenset({"fused_qk_norm_rope"})


# pypto-interpret: the interpreter copies a layer's whole cache on every call (a 1 GiB cache ran a
# 24 GiB machine out of memory within two decode steps), so unless asked otherwise it gets this
INTERPRET_KV_BYTES = 32 << 20
INTERPRET_KV_WARN_BYTES = 256 << 20


def prepare(vllm_config, backend) -> None:
    """Before the model is built, in the worker (the KV cache is sized after the model loads): no
    torch.compile and no graph capture, what --enforce-eager sets, so users need not pass it (the
    docstring above says why); under pypto-interpret a small KV cache unless one was asked for."""
    from vllm.config import CompilationMode, CUDAGraphMode

    from ..kernels import logger

    cc = vllm_config.compilation_config
    if cc.mode != CompilationMode.NONE or cc.cudagraph_mode != CUDAGraphMode.NONE:
        logger.info("pypto-a8w8: the PyPTO backend runs the model eager (no torch.compile, no graph capture)")
        cc.mode, cc.cudagraph_mode = CompilationMode.NONE, CUDAGraphMode.NONE
    if not getattr(backend, "interpret", False):
        return
    cache = vllm_config.cache_config
    if cache.kv_cache_memory_bytes is None:
        cache.kv_cache_memory_bytes = INTERPRET_KV_BYTES
        logger.info("pypto-a8w8: pypto-interpret sizes the KV cache at %d MiB (the interpreter copies a layer's "
                    "whole cache per call); --kv-cache-memory-bytes sets another size", INTERPRET_KV_BYTES >> 20)
    elif cache.kv_cache_memory_bytes > INTERPRET_KV_WARN_BYTES:
        logger.warning("pypto-a8w8: a %d MiB KV cache under pypto-interpret: the interpreter copies a layer's "
                       "whole cache on every call, so memory and time grow with it; 16-64 MiB suffice for tests",
                       cache.kv_cache_memory_bytes >> 20)


def check_layer(layer) -> None:
    """At model init: what the decode kernel assumes of this layer."""
    unsupported = sorted(layer.flags - SUPPORTED_FLAGS)
    if unsupported:
        raise ValueError(f"pypto-a8w8 flag(s) {unsupported} have no PyPTO kernel; the PyPTO backend supports "
                         f"{sorted(SUPPORTED_FLAGS)}")
    attn = layer.self_attn
    rope = attn.rotary_emb
    if type(rope) is not RotaryEmbedding or rope.rotary_dim != attn.head_dim or not rope.is_neox_style:
        raise ValueError(f"the PyPTO decode kernel implements full-width rotate-half RoPE; this layer has "
                         f"{type(rope).__name__}(rotary_dim={rope.rotary_dim}, head_dim={attn.head_dim})")
    if getattr(attn.qkv_proj, "tp_size", 1) > 1:
        raise ValueError("the PyPTO backend runs one rank: tensor parallelism is not implemented for it")


def _weights(layer) -> dict:
    """The decode kernel's weights, gathered once (the tensors are the layer's own)."""
    cached = getattr(layer, "_pypto_weights", None)
    if cached is None:
        from .qwen3 import _packed, takes_int8

        attn, mlp = layer.self_attn, layer.mlp
        linears = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj, "gate_up_proj": mlp.gate_up_proj,
                   "down_proj": mlp.down_proj}
        bf16 = [n for n, lin in linears.items() if not takes_int8(lin)]
        if bf16:
            raise ValueError(f"the PyPTO decode kernel runs every linear in int8; {bf16} are kept in bf16 "
                             f"(checkpoint ignore list)")
        cached = {n: _packed(lin) for n, lin in linears.items()}
        cached.update(input_layernorm=layer.input_layernorm.weight, q_norm=attn.q_norm.weight,
                      k_norm=attn.k_norm.weight, post_attention_layernorm=layer.post_attention_layernorm.weight)
        layer._pypto_weights = cached
    return cached


def _cos_sin(layer, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's (cos, sin) [T, hd/2] as the kernel's qk mode expects: vLLM's own table
    (bf16 on a bf16 model, as its RotaryEmbedding applies it) or, with fused_qk_norm_rope, fp32."""
    attn = layer.self_attn
    if "fused_qk_norm_rope" in layer.flags:
        return layer_ref.rope_cos_sin(positions, attn.head_dim, layer.rope_theta)
    table = attn.rotary_emb.cos_sin_cache.index_select(0, positions.long().flatten())
    return table.float().chunk(2, dim=-1)


def _qk_norm_rope(layer, positions, q, k):
    """Prefill's QK-norm + RoPE with the numerics of the decode kernel's qk mode: the fused
    reference with the flag, else vLLM's own torch implementations (forward_native) whichever
    implementation the platform would dispatch to, so that prefill and decode agree."""
    if "fused_qk_norm_rope" in layer.flags:
        return layer._qk_norm_rope(positions, q, k)
    attn = layer.self_attn
    T, hd = q.shape[0], attn.head_dim
    q = attn.q_norm.forward_native(q.reshape(T, -1, hd)).reshape(T, -1)
    k = attn.k_norm.forward_native(k.reshape(T, -1, hd)).reshape(T, -1)
    return attn.rotary_emb.forward_native(positions, q, k)


def forward(layer, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
            first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    attn = layer.self_attn
    backend = attn.qkv_proj.quant_method.backend
    meta, attn_layer, kv_cache, _ = get_attention_context(attn.attn.layer_name)
    batch = paging.decode_batch(meta)
    if batch is not None and batch.size != hidden_states.shape[0]:
        batch = None  # padded token rows: take the general path, which handles any row count
    if first:
        backend.step_done(decode=batch is not None)
    if batch is not None:
        qk_mode = "fused" if "fused_qk_norm_rope" in layer.flags else "vllm"
        return backend.decode_layer(hidden_states, residual, _weights(layer), kv_cache, batch,
                                    _cos_sin(layer, positions), layer.input_layernorm.variance_epsilon, qk_mode,
                                    getattr(attn_layer, "isa", None))
    # prefill / mixed: PyPTO norm + quant and linears, the platform's attention, the PyPTO MLP block
    qkv, residual = layer._norm_into(layer.input_layernorm, attn.qkv_proj, hidden_states, residual)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = _qk_norm_rope(layer, positions, q, k)
    out, _ = attn.o_proj(attn.attn(q, k, v))
    w = _weights(layer)
    return backend.mlp_block(out, residual, layer.post_attention_layernorm.weight, w["gate_up_proj"],
                             w["down_proj"], layer.post_attention_layernorm.variance_epsilon)
