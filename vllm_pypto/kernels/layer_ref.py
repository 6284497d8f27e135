"""Torch reference for the fused ops the Qwen3 model class runs between its GEMMs.

Rounding points follow the spec (shared seed-notes, "Numerics"): the hidden state is
carried in bf16, residual adds and norms are computed in fp32, and every activation
that feeds an int8 GEMM is rounded to bf16 before it is quantized per token. The native
kernels (csrc/, every ISA path) must give the same int8 values and scales.

Two choices go beyond the spec, so that an implementation can match exactly: the mean
square of a row accumulates in fp64 (exact for bf16 squares in practice, so the sum
order does not matter), and SiLU is evaluated in fp64 before it is rounded to fp32.
"""

from __future__ import annotations

import torch

from .reference import dequant_epilogue, int8_gemm, quantize_per_token

BF16 = torch.bfloat16


def _rinv(h: torch.Tensor, eps: float) -> torch.Tensor:
    """1/rms per row of bf16 h, [M, 1] fp32: fp64 mean square, IEEE sqrt and division."""
    hd = h.double()
    var = hd.square().sum(-1, keepdim=True) / h.shape[-1]
    return (1.0 / torch.sqrt(var + eps)).float()


def rmsnorm_quant(x: torch.Tensor, residual: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                  deferred: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = bf16(x + residual) (or x), y = bf16(h / rms(h) * gamma), (q, scale) = quant(y).
    Returns (q int8 [M,H], scale fp32 [M], h bf16 [M,H]: the next residual).

    deferred (the upstream decode trick, flag `deferred_rms`): quantize bf16(h * gamma) and
    fold 1/rms into the row's scale, which per-token symmetric quantization allows up to
    bf16 rounding of the product and the 1e-4 amax floor."""
    x2 = x.reshape(-1, x.shape[-1])
    h = x2.clone() if residual is None else (x2.float() + residual.reshape(x2.shape).float()).to(BF16)
    hf, g, rinv = h.float(), gamma.float(), _rinv(h, eps)
    if deferred:
        q, scale = quantize_per_token((hf * g).to(BF16))
        return q, scale * rinv[:, 0], h
    q, scale = quantize_per_token((hf * rinv * g).to(BF16))
    return q, scale, h


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(SiLU(gate) * up) from fp32 gate and up; SiLU in fp64, the product in fp32."""
    g = gate.double()
    return ((g / (1.0 + torch.exp(-g))).float() * up.float()).to(BF16)


def silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's merged gate_up output (gate first) -> the down-proj's (q int8, scale)."""
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    g, u = x2.float().chunk(2, dim=-1)
    return quantize_per_token(silu_mul(g, u))


def linear_q(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The A8W8 linear on already-quantized activations -> bf16 [M, N]."""
    return dequant_epilogue(int8_gemm(q, weight), weight_scale, scale)


def gate_up_silu_quant(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flag `fused_gate_up_silu`: the gate_up GEMM's fp32 epilogue feeds SiLU * up directly
    (no bf16 rounding of gate and up), then per-token quantization for the down-proj."""
    y = dequant_epilogue(int8_gemm(q, weight), weight_scale, scale, torch.float32)
    g, u = y.chunk(2, dim=-1)
    return quantize_per_token(silu_mul(g, u))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [T, head_dim/2] of rotate-half (NeoX) RoPE, computed from the positions."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = positions.reshape(-1).float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _head_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * gamma.float()


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_gamma: torch.Tensor,
                 k_gamma: torch.Tensor, eps: float, theta: float, broken_q_rope: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flag `fused_qk_norm_rope`: per-head RMSNorm and RoPE on q [T, nq, hd] and k [T, nkv, hd]
    in fp32 with one rounding to bf16 at the end (the spec's order). The Q heads of each GQA
    group are rotated as one [group*T, hd] tile, head-major, with cos/sin replicated per head.

    broken_q_rope (test-only flag `guardrail_broken_q_rope`): replicates cos/sin token-major
    instead, the kind of non-equivalent batched Q RoPE that made the upstream repeat itself.
    With one token (batch-1 decode) both replications are the same tile, so only prefill and
    batched decode see it."""
    T, nq, hd = q.shape
    nkv = k.shape[1]
    cos, sin = rope_cos_sin(positions, hd, theta)
    kf = _rope(_head_norm(k.float(), k_gamma, eps), cos[:, None], sin[:, None])
    group = nq // nkv
    qf = _head_norm(q.float(), q_gamma, eps).view(T, nkv, group, hd).permute(1, 2, 0, 3)  # [nkv, group, T, hd]
    qf = qf.reshape(nkv, group * T, hd)
    rows = torch.arange(group * T)
    tok = rows // group if broken_q_rope else rows % T  # which token's angle each tile row gets
    qf = _rope(qf, cos[tok][None], sin[tok][None])
    qf = qf.view(nkv, group, T, hd).permute(2, 0, 1, 3).reshape(T, nq, hd)
    return qf.to(BF16), kf.to(BF16)


def rope_table(max_positions: int, head_dim: int, theta: float) -> torch.Tensor:
    """fp32 [max_positions, head_dim]: each position's cos | sin (rope_cos_sin), for qk_norm_rope_cache."""
    return torch.cat(rope_cos_sin(torch.arange(max_positions), head_dim, theta), dim=-1).contiguous()


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       q_gamma: torch.Tensor, k_gamma: torch.Tensor, eps: float, cos_sin: torch.Tensor,
                       kv_cache: torch.Tensor | None, slots: torch.Tensor | None, interior: str) -> torch.Tensor:
    """Flag `native_attn_prologue`: q [T, nq*hd], k and v [T, nkv*hd] (bf16, the QKV GEMM's output) ->
    bf16 q [T, nq*hd] per-head RMS-normed and rotated, with k normed and rotated the same way and v
    written into vLLM-CPU's cache [blocks, nkv, block_size, 2*hd] at `slots` (rows past len(slots)
    and slots < 0 are padding, not written). The numerics of qk_norm_rope, but with the rms from an
    fp64 mean square (as rmsnorm_quant's, so that a native kernel can match exactly) and cos | sin
    read from a rope_table."""
    from .ascend.paging import CacheView

    T, hd = q.shape[0], q_gamma.numel()
    cs = cos_sin.index_select(0, positions.reshape(-1).long())
    cos, sin = cs[:, None, :hd // 2], cs[:, None, hd // 2:]

    def norm_rope(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        h = x.reshape(T, -1, hd)
        return _rope(h.float() * _rinv(h, eps) * gamma.float(), cos, sin).to(BF16)

    if kv_cache is not None and slots is not None:
        n = min(T, slots.numel())
        s = slots.reshape(-1)[:n].long()
        keep = s >= 0
        s = s[keep]
        nb, nkv, bs, _ = kv_cache.shape
        off = CacheView("flat", kv_cache, kv_cache, bs, nkv, hd, interior).offsets(s // bs, s % bs)
        flat = kv_cache.view(-1)
        flat[off[:, :, 0]] = norm_rope(k, k_gamma)[:n][keep]
        flat[off[:, :, 1]] = v.reshape(T, nkv, hd)[:n][keep]
    return norm_rope(q, q_gamma).reshape(T, -1)
