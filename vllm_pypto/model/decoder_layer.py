"""Flag `native_decoder_layer`: a whole decoder layer on vLLM-CPU as one native op.

With flag native_attn_prologue a layer still makes about eight calls from Python: two norm +
quant ops, four GEMMs, the attention op (itself Python around the native prologue and vLLM-CPU's
kernel), and the views torch.compile's wrapper issues between them. At batch 1 on a 2-CPU host
that glue cost about 150 us a layer, a sixth of a 0.6B step (docs/performance.md). With this flag
the compiled graph calls one native op a layer (`torch.ops.pypto_cpu.decoder_layer`,
csrc/decoder_layer.cpp), which runs the same kernels in the same order, vLLM-CPU's attention
kernel included (through the torch dispatcher). So its output is native_attn_prologue's, bit for
bit, with deferred_rms and fused_gate_up_silu as set. With flag native_decode_attention, a
decode-only step's attention is ours (csrc/decode_attention.cpp) instead of vLLM-CPU's kernel.

What the op needs of vLLM's forward context (each layer's KV cache, the slot mapping, the
attention metadata) is handed to the extension once a step by `step()`, which the model class
runs around its compiled forward; vLLM's own attention op looks the same things up per layer,
from Python.
"""

from __future__ import annotations

import contextlib

import torch

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.models.utils import extract_layer_index

from ..kernels import get_backend
from ..quant.linear import PyptoA8W8LinearMethod
from . import attn_prologue

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _linear(layer, path: str):
    owner, name = path.split(".")
    return getattr(getattr(layer, owner), name)


def check_layer(layer) -> None:
    """At model init (after native_attn_prologue's own checks): what the op runs, else a clear error."""
    backend = get_backend()
    if not backend.fused_decoder_layer:
        raise ValueError(f"flag native_decoder_layer needs the native CPU kernels; the {backend.name!r} backend "
                         f"runs layers op by op (use native_attn_prologue there)")
    not_int8 = []
    for path in LINEARS:
        lin = _linear(layer, path)
        method = getattr(lin, "quant_method", None)
        if (not isinstance(method, PyptoA8W8LinearMethod) or method.run_bf16 or lin.bias is not None
                or (isinstance(lin, RowParallelLinear) and lin.tp_size > 1)):
            not_int8.append(path)
    if not_int8:
        raise ValueError(f"flag native_decoder_layer runs every linear of a layer as an int8 GEMM without bias on one "
                         f"rank; in this layer {not_int8} do not (checkpoint ignore list, flag bf16_down_proj, a "
                         f"bias, or a tensor-parallel row shard)")
    if layer.input_layernorm.variance_epsilon != layer.post_attention_layernorm.variance_epsilon:
        raise ValueError("flag native_decoder_layer: the two layer norms have different eps")
    layer.pypto_layer_index = extract_layer_index(layer.self_attn.attn.layer_name)


@contextlib.contextmanager
def step(layers):
    """Around one forward of the model whose decoder `layers` run this op: their KV caches, slot
    mapping and attention metadata, from vLLM's forward context, into the extension."""
    from .. import _C

    ctx = get_forward_context()
    attn = [layer.self_attn.attn for layer in layers]
    metas = ctx.attn_metadata
    if isinstance(metas, list):  # speculative decoding: [0] is the base model's
        metas = metas[0]
    per_layer = [(metas[a.layer_name] if isinstance(metas, dict) else metas,
                  ctx.slot_mapping.get(a.layer_name) if isinstance(ctx.slot_mapping, dict) else None) for a in attn]
    m, slot_mapping = per_layer[0]
    if any(lm is not m or ls is not slot_mapping for lm, ls in per_layer):
        raise RuntimeError("flag native_decoder_layer: the layers have more than one KV cache group (attention "
                           "metadata or slot mapping differ between layers)")
    caches = [torch.empty(0)] * (max(layer.pypto_layer_index for layer in layers) + 1)
    for layer, a in zip(layers, attn):
        caches[layer.pypto_layer_index] = a.kv_cache
    interior = getattr(attn[0], "isa", None)
    if slot_mapping is not None and caches[layers[0].pypto_layer_index].numel() > 0:
        attn_prologue.check_interior(interior, "native_decoder_layer")
    if m is None:  # a warm-up or profiling pass: no attention, as vLLM-CPU's own forward
        _C.decoder_layer_step(caches, slot_mapping, [], None, True, 0, interior or "vec")
    else:
        _C.decoder_layer_step(caches, slot_mapping, [m.query_start_loc, m.seq_lens, m.block_table,
                                                     m.scheduler_metadata], m.dynamic_causal, m.causal,
                              m.num_actual_tokens, interior or "vec")
    try:
        yield
    finally:
        _C.decoder_layer_step_end()


def forward(layer, positions: torch.Tensor, hidden_states: torch.Tensor,
            residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    attn = layer.self_attn
    impl = attn.attn.impl
    weights = [layer.input_layernorm.weight, attn.q_norm.weight, attn.k_norm.weight,
               layer.post_attention_layernorm.weight]
    for path in LINEARS:
        lin = _linear(layer, path)
        weights += [getattr(lin, n) for n in lin._pypto_packed]  # weight_packed, weight_comp, weight_scale
    out, residual = torch.ops.pypto_cpu.decoder_layer(
        hidden_states, residual, positions, weights, layer.pypto_layer_index, attn.attn.num_heads,
        attn.attn.num_kv_heads, layer.input_layernorm.variance_epsilon, attn.q_norm.variance_epsilon,
        layer.pypto_cos_sin, impl.scale, impl.sliding_window, float(impl.logits_soft_cap),
        "deferred_rms" in layer.flags, "fused_gate_up_silu" in layer.flags, "native_decode_attention" in layer.flags)
    return out, residual
