"""Torch reference backend: the golden A8W8 numerics (see shared seed-notes, "Numerics").

Every other backend is judged against these functions, so they are written for
clarity and exactness, not speed. The spec, per token row r and output channel n:

    amax[r]   = max(1e-4, max_k |x[r,k]|)           (fp32)
    q[r,k]    = clamp(rint(x[r,k] * (127/amax[r])), -127, 127)   (half to even)
    acc[r,n]  = sum_k q[r,k] * w[n,k]                 (int32)
    y[r,n]    = bf16(acc[r,n] * w_scale[n] * (amax[r]/127))     (fp32, left to right)

Non-finite rows: a row holding NaN or +-inf has no meaningful scale. Such a row is
quantized to zeros with a NaN scale, so its output row is all NaN while every other
row of the batch is untouched. Native backends must do the same.
"""

from __future__ import annotations

import torch

AMAX_FLOOR = 1e-4
QMAX = 127


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """max_k |x[r,k]| in fp32, +inf for a row holding NaN/inf (so a max over tensor-parallel
    shards still marks the whole row), without the floor."""
    amax = x.float().abs().amax(dim=-1)
    return torch.where(torch.isnan(amax), float("inf"), amax)


def activation_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-row dequant scale amax/127 from a floored amax; NaN for a non-finite row."""
    return torch.where(torch.isfinite(amax), amax / QMAX, float("nan"))


def quantize_per_token(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-row int8 quantization. Returns (q int8 [M,K], scale fp32 [M]).

    amax: the rows' amax when it is taken over more than x (tensor-parallel row shards:
    the max of `row_amax` over all ranks); by default it is x's own.
    """
    xf = x.float()
    amax = (row_amax(xf) if amax is None else amax.float()).clamp_min(AMAX_FLOOR).unsqueeze(-1)
    finite = torch.isfinite(amax)
    # A true fp32 division: `QMAX / amax` in torch is reciprocal-then-multiply, which
    # differs from 127/amax in the last bit for about a quarter of all amax values.
    q = torch.round(xf * (torch.full_like(amax, QMAX) / amax)).clamp_(-QMAX, QMAX)
    q = torch.where(finite, q, 0.0).to(torch.int8)
    return q, activation_scale(amax.squeeze(-1))


def quantize_weight_per_channel(w: torch.Tensor, amax: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 for a [N,K] weight: scale = max(amax,eps)/127.

    Used to quantize bf16 checkpoints at load. amax: the channels' amax over the whole
    input dimension when w is a tensor-parallel shard of it (else w's own). Refuses
    non-finite weights rather than producing a NaN channel that would only show up as
    garbage text later.
    """
    wf = w.float()
    amax = (row_amax(wf) if amax is None else amax.float()).unsqueeze(-1)
    if not torch.isfinite(amax).all():
        bad = (~torch.isfinite(amax)).nonzero()[0, 0].item()
        raise ValueError(f"weight has non-finite values in output channel {bad}")
    scale = amax.clamp_min(AMAX_FLOOR) / QMAX
    q = torch.round(wf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.squeeze(-1)


def int8_gemm(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int8 x int8 -> int32: q [M,K], w [N,K] -> [M,N]."""
    return torch._int_mm(q, w.t())


def dequant_epilogue(acc: torch.Tensor, w_scale: torch.Tensor, a_scale: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = acc * w_scale[n] * a_scale[r] in fp32, in that order, then cast."""
    y = acc.float() * w_scale.float().unsqueeze(0)
    y = y * a_scale.float().unsqueeze(1)
    return y.to(out_dtype)


def a8w8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """bf16 [..., K] x (int8 [N,K], fp32 [N]) -> bf16 [..., N] with the full spec."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty(*lead, weight.shape[0])
    q, a_scale = quantize_per_token(x2)
    acc = int8_gemm(q, weight)
    return dequant_epilogue(acc, weight_scale, a_scale, x.dtype).reshape(*lead, weight.shape[0])
