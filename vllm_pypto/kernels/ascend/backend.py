"""The PyPTO backend: our kernels (kernels.py) behind the A8W8Backend interface, run on an
Ascend NPU (torch_npu importable). Selected with VLLM_PYPTO_BACKEND=pypto; `auto` takes it
only where torch_npu imports. Never imported on a CPU serving path.
"""

from __future__ import annotations

import torch

from .. import A8W8Backend


def npu_status() -> str | None:
    """None where the PyPTO backend can run, else why not."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return "torch_npu is not installed (no Ascend NPU stack)"
    try:
        import pypto  # noqa: F401
    except ImportError as e:
        return f"pypto is not installed ({e}); pip install 'vllm-pypto[ascend]'"
    if not torch.npu.is_available():
        return "torch_npu finds no NPU"
    return None


class PyptoBackend(A8W8Backend):
    name = "pypto"

    def __init__(self, run_mode=None):
        """run_mode: NPU (the default); tests on a CPU pass SIM and run inside verify.interpreter()."""
        import pypto

        self.run_mode = pypto.RunMode.NPU if run_mode is None else run_mode

    def isa(self) -> str:
        return "PyPTO kernels (pypto 0.2.0) on Ascend AICore: per-token quant, int8 cube GEMM, fp32 dequant"

    def prepack(self, weight, weight_scale):
        return {"weight": weight.contiguous(), "weight_scale": weight_scale.float().reshape(1, -1).contiguous()}

    def unpacked(self, packed):
        return packed["weight"], packed["weight_scale"].reshape(-1)

    def linear(self, x, packed):
        from . import kernels

        w, ws = packed["weight"], packed["weight_scale"]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        kernel = kernels.a8w8_linear(x2.shape[0], x2.shape[1], w.shape[0], self.run_mode)
        out = x2.new_empty(x2.shape[0], w.shape[0])
        kernel(x2, w, ws, out)
        return out.reshape(*x.shape[:-1], w.shape[0])

    def gemm_int32(self, x, amax, packed):
        raise NotImplementedError("tensor-parallel int32 partial sums are not implemented for the PyPTO backend")

    def decode_layer(self, x, residual, positions, weights: dict, k_cache, v_cache, slot_mapping, block_tables,
                     seq_lens, eps: float, rope_theta: float):
        """A whole Qwen3 decoder layer for B decode tokens as one kernel (kernels.decode_layer).
        weights: gammas `input_layernorm`, `q_norm`, `k_norm`, `post_attention_layernorm` and
        prepacked `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`. Caches are vLLM's paged
        [num_blocks, block_size, nkv, hd]; block_tables [B, MB],
        seq_lens [B] count the new token, slot_mapping [B]. Returns (out, residual) bf16 [B, H]
        and updates the caches in place."""
        from . import kernels
        from ..layer_ref import rope_cos_sin

        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise ValueError("decode_layer: the caches must be vLLM's [num_blocks, block_size, nkv, hd]")
        B, H = x.shape
        _, bs, nkv, hd = k_cache.shape
        kc, vc = k_cache.view(-1, nkv * hd), v_cache.view(-1, nkv * hd)  # views: the kernel writes the caches
        qkv, o, gu, dn = (weights[k] for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        nq = qkv["weight"].shape[0] // hd - 2 * nkv
        I, MB = gu["weight"].shape[0] // 2, block_tables.shape[1]  # noqa: E741
        cos, sin = rope_cos_sin(positions, hd, rope_theta)
        row = lambda t: t.reshape(1, -1).contiguous()  # noqa: E731
        out, h_out = torch.empty_like(x), torch.empty_like(x)
        kernel = kernels.decode_layer(B, H, nq, nkv, hd, I, kc.shape[0], bs, MB, eps, self.run_mode)
        kernel(x.contiguous(), (torch.zeros_like(x) if residual is None else residual).contiguous(),
               row(weights["input_layernorm"]), qkv["weight"], qkv["weight_scale"], row(weights["q_norm"]),
               row(weights["k_norm"]), cos.repeat_interleave(nq, 0), sin.repeat_interleave(nq, 0),
               cos.repeat_interleave(nkv, 0), sin.repeat_interleave(nkv, 0), slot_mapping.reshape(B, 1).long(),
               block_tables.int().contiguous(), seq_lens.reshape(B, 1).int(),
               torch.arange(MB * bs, dtype=torch.int32, device=x.device)[None], kc, vc, o["weight"], o["weight_scale"],
               row(weights["post_attention_layernorm"]), gu["weight"], gu["weight_scale"], dn["weight"],
               dn["weight_scale"], out, h_out)
        return out, h_out
