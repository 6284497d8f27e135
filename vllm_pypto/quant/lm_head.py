"""Flag int8_lm_head: the lm_head as one more A8W8 GEMM, the linears' numerics (int8 weight with
one fp32 scale per vocab row, per-token activation quantization, fp32 epilogue, bf16 logits).

On the small Qwen3 shapes the bf16 head is the biggest read of a decode step (41% of the 0.6B
model's bytes per token); int8 halves it. The weight loads as bf16 by vLLM's own vocab-parallel
loader (padding, tensor-parallel vocab shards, tied embeddings), and is quantized after loading.
Per-row scales make each vocab shard's quantization that of the whole head. With tied embeddings
the bf16 table stays for the lookup and the int8 copy is extra (half its size); an untied bf16
head is freed.
"""

from __future__ import annotations

import torch
from torch.nn import Parameter

from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from ..kernels import get_backend
from ..kernels.reference import quantize_weight_per_channel

ROWS_AT_ONCE = 8192  # quantize in slices: an fp32 copy of a 14B head would be 3 GiB


class PyptoA8W8LMHeadMethod(UnquantizedEmbeddingMethod):
    def __init__(self):
        self.backend = get_backend()

    def process_weights_after_loading(self, layer) -> None:
        w = layer.weight.data
        parts = [quantize_weight_per_channel(w[i:i + ROWS_AT_ONCE]) for i in range(0, w.shape[0], ROWS_AT_ONCE)]
        q, scale = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        del parts
        packed = self.backend.prepack(q, scale)
        del q
        if not getattr(layer, "_pypto_tied", False):  # tied: the lookup still needs the bf16 table
            del layer.weight
        for name, tensor in packed.items():
            layer.register_parameter(name, Parameter(tensor, requires_grad=False))
        layer._pypto_packed = tuple(packed)

    def tie_weights(self, layer, embed_tokens):
        layer._pypto_tied = True
        return super().tie_weights(layer, embed_tokens)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self.backend.linear(x, {n: getattr(layer, n) for n in layer._pypto_packed})
        return out if bias is None else out + bias
