"""Qwen3 under pypto-a8w8: each decoder layer as a few fused kernels.

vLLM's own Qwen3 runs, per layer, RMSNorm, a linear that quantizes its input, q/k norms,
RoPE, attention, a linear, RMSNorm, a linear, SiLU*up and a linear that quantizes its
input again: every activation makes a bf16 round trip before it is quantized. This
class keeps vLLM's modules (so weights load by the Hugging Face names, and attention,
the paged KV cache, prefix caching and chunked prefill are vLLM's) and changes only the
forward, so that each int8 GEMM is fed by the op that produced its activation:

    rmsnorm(+residual)+quant -> QKV GEMM+dequant -> QK-norm, RoPE -> attention (vLLM)
    -> O GEMM -> rmsnorm(+residual)+quant -> gate_up GEMM -> SiLU*up+quant -> down GEMM

A linear that cannot take quantized input (kept bf16 by the checkpoint's ignore list or by
flag bf16_down_proj, or a row-parallel shard under tensor parallelism, whose scale must
come from all ranks) gets the stock bf16 path instead; outputs stay correct either way.

Selected by the quantization config (`maybe_update_config` names this architecture) when
`--quantization pypto-a8w8` serves a Qwen3ForCausalLM checkpoint; VLLM_PYPTO_MODEL=vllm
keeps vLLM's class with our linears (A/B comparisons).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index, maybe_prefix

from .. import flags
from ..kernels import get_backend, layer_ref
from ..quant.linear import PyptoA8W8LinearMethod
from . import attn_prologue, decoder_layer, pypto_layer


def takes_int8(linear: nn.Module) -> bool:
    """Whether this linear runs our int8 GEMM on (q, scale) it is handed."""
    return (isinstance(getattr(linear, "quant_method", None), PyptoA8W8LinearMethod)
            and getattr(linear, "_pypto_packed", None) is not None
            and getattr(linear, "_pypto_tp_reduce", None) is None)


def _packed(linear: nn.Module) -> dict[str, torch.Tensor]:
    return {n: getattr(linear, n) for n in linear._pypto_packed}


def _linear_q(linear: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = linear.quant_method.backend.linear_q(q, scale, _packed(linear))
    return out if linear.bias is None or linear.skip_bias_add else out + linear.bias


class PyptoQwen3DecoderLayer(Qwen3DecoderLayer):
    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.flags = flags.active(getattr(get_current_vllm_config(), "additional_config", None))
        if "guardrail_broken_q_rope" in self.flags:
            self.flags |= {"fused_qk_norm_rope"}
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if "fused_qk_norm_rope" in self.flags and rope.get("rope_type", "default") != "default":
            raise ValueError(f"flag fused_qk_norm_rope implements plain RoPE only; this checkpoint's "
                             f"rope_parameters are {rope}")
        self.rope_theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 1e6)))
        # the guardrail's broken RoPE exists in the torch path only: it keeps that path
        native = "guardrail_broken_q_rope" not in self.flags
        self.one_op = native and "native_decoder_layer" in self.flags
        if "native_decode_attention" in self.flags and not self.one_op:
            raise ValueError("flag native_decode_attention runs inside flag native_decoder_layer's op; set both")
        self.prologue = native and ("native_attn_prologue" in self.flags or self.one_op)
        if self.prologue:
            max_len = get_current_vllm_config().model_config.max_model_len
            attn_prologue.check_layer(self, max_len)
            if self.one_op:
                decoder_layer.check_layer(self)
            self.register_buffer("pypto_cos_sin", attn_prologue.rope_table(max_len, self.self_attn.head_dim,
                                                                           self.rope_theta), persistent=False)
        # PyPTO backend: whole layers on its kernels (pypto_layer.py)
        self.pypto = get_backend().runs_layers
        if self.pypto:
            pypto_layer.check_layer(self)
            self.first = extract_layer_index(self.self_attn.attn.layer_name) == 0

    def _norm_into(self, norm, linear, x, residual):
        """norm(x + residual) into `linear` -> (linear's output, new residual)."""
        if not takes_int8(linear):
            if residual is None:
                h, residual = norm(x), x
            else:
                h, residual = norm(x, residual)
            return linear(h)[0], residual
        q, scale, residual = linear.quant_method.backend.rmsnorm_quant(
            x, residual, norm.weight, norm.variance_epsilon, "deferred_rms" in self.flags)
        return _linear_q(linear, q, scale), residual

    def _qk_norm_rope(self, positions, q, k):
        attn = self.self_attn
        T, hd = q.shape[0], attn.head_dim
        q3, k3 = q.view(T, -1, hd), k.view(T, -1, hd)
        if "fused_qk_norm_rope" in self.flags:
            # Plain torch, so that torch.compile can fuse it: as one opaque custom op it ran ~30
            # eager ops per layer (+25% TPOT on 0.6B); traced it measured +10-20% alone and no
            # loss with the other flags, within this host's noise (docs/performance.md, flags).
            q3, k3 = layer_ref.qk_norm_rope(q3, k3, positions, attn.q_norm.weight, attn.k_norm.weight,
                                            attn.q_norm.variance_epsilon, self.rope_theta,
                                            "guardrail_broken_q_rope" in self.flags)
            return q3.reshape(T, -1), k3.reshape(T, -1)
        q, k = attn.q_norm(q3).view(q.shape), attn.k_norm(k3).view(k.shape)
        return attn.rotary_emb(positions, q, k)

    def _mlp(self, x, residual):
        mlp, norm = self.mlp, self.post_attention_layernorm
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if not takes_int8(gate_up):
            y, residual = self._norm_into(norm, gate_up, x, residual)
            return down(mlp.act_fn(y))[0], residual
        backend = gate_up.quant_method.backend
        q, scale, residual = backend.rmsnorm_quant(x, residual, norm.weight, norm.variance_epsilon,
                                                   "deferred_rms" in self.flags)
        if not takes_int8(down):
            # Our SiLU numerics, so that a tensor-parallel down-proj (which quantizes this bf16
            # input with a scale from all ranks) computes exactly what TP=1 does.
            return down(backend.silu_mul(_linear_q(gate_up, q, scale)))[0], residual
        if "fused_gate_up_silu" in self.flags and gate_up.bias is None:
            q, scale = backend.gate_up_silu_quant(q, scale, _packed(gate_up))
        else:
            q, scale = backend.silu_mul_quant(_linear_q(gate_up, q, scale))
        return _linear_q(down, q, scale), residual

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pypto:
            return pypto_layer.forward(self, positions, hidden_states, residual, self.first)
        if self.one_op:
            return decoder_layer.forward(self, positions, hidden_states, residual)
        attn = self.self_attn
        qkv, residual = self._norm_into(self.input_layernorm, attn.qkv_proj, hidden_states, residual)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        if self.prologue:
            out, _ = attn.o_proj(attn_prologue.attention(self, positions, q, k, v))
            return self._mlp(out, residual)
        q, k = self._qk_norm_rope(positions, q, k)
        out, _ = attn.o_proj(attn.attn(q, k, v))
        return self._mlp(out, residual)


class PyptoQwen3Model(Qwen3Model):
    decoder_layer_type = PyptoQwen3DecoderLayer


class PyptoQwen3ForCausalLM(Qwen3ForCausalLM):
    """vLLM's Qwen3ForCausalLM (interfaces, weight names, packed modules) on PyptoQwen3Model."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        if get_backend().runs_layers:
            pypto_layer.prepare(vllm_config, get_backend())
        config = vllm_config.model_config.hf_config
        self.config, self.vllm_config = config, vllm_config
        self.quant_config = vllm_config.quant_config
        self.model = PyptoQwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=self.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        # flag native_decoder_layer: the layers whose op reads this step's KV caches and metadata
        self.one_op_layers = [layer for layer in self.model.layers if getattr(layer, "one_op", False)]

    def forward(self, *args, **kwargs):
        if not self.one_op_layers:
            return super().forward(*args, **kwargs)
        with decoder_layer.step(self.one_op_layers):
            return super().forward(*args, **kwargs)
