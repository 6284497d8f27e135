"""Our A8W8 kernels for Ascend, written for the PyPI `pypto` 0.2.0 API.

Same contract and numerics as kernels/reference.py and kernels/layer_ref.py: per-token
symmetric int8 (amax floor 1e-4, x * (127/amax), round half to even, clamp 127), int8 x
int8 -> int32, fp32 epilogue `acc * w_scale[n] * a_scale[r]`, bf16 out. Each builder returns
a `pypto.frontend.jit` kernel for static shapes, called with its output tensor last (0.2.0
kernels write an `out` parameter); `run_mode` is NPU on an Ascend machine and
SIM (cost model, plus the interpreter when verify.py turns it on) elsewhere.

Tile shapes follow the hardware limits the interpreter enforces: all operands of one vector
op within 192 KB of on-chip memory, cube tiles of [m, k, n] with L1/L0 levels.

pypto is under the CANN Open Software License 2.0 (use with Huawei AI processors): nothing
on the CPU serving path imports this module.
"""

# No `from __future__ import annotations`: pypto reads the kernels' annotations as objects.
from functools import lru_cache

import pypto

AMAX_FLOOR = 1e-4
UB_BYTES = 192 * 1024


def _row_tile(K: int, live_fp32_rows: int = 2) -> int:
    """Rows per vector tile (a power of two) so that live_fp32_rows fp32 rows of K fit on chip.
    Measured at K=5120, M=16 (cost model): 2 -> 4-row tiles, 68 tasks for the O linear against
    96 with 2-row tiles; 8-row tiles exceed the on-chip limit (pypto refuses them)."""
    rows = max(1, UB_BYTES // (K * 4 * live_fp32_rows))
    return 1 << (rows.bit_length() - 1)


def _quant(xf):
    """fp32 [m, K] -> (q int8 [m, K], amax fp32 [m, 1]) per the spec."""
    amax = pypto.maximum(pypto.amax(pypto.abs(xf), -1, True), AMAX_FLOOR)
    inv = pypto.div(pypto.full(amax.shape, 127.0, pypto.DT_FP32), amax)  # a true division
    q = pypto.cast(pypto.mul(xf, inv), pypto.DT_INT32, pypto.CastMode.CAST_RINT)
    q = pypto.clip(pypto.cast(q, pypto.DT_FP16), -127.0, 127.0)
    return pypto.cast(q, pypto.DT_INT8, pypto.CastMode.CAST_TRUNC), amax


def _dequant(acc, ws, amax):
    y = pypto.mul(pypto.cast(acc, pypto.DT_FP32), ws)
    return pypto.mul(y, pypto.div(amax, 127.0))


@lru_cache(maxsize=None)
def a8w8_linear(M: int, K: int, N: int, run_mode) -> object:
    """kernel(x bf16 [M, K], w int8 [N, K], w_scale fp32 [1, N], out bf16 [M, N])."""
    tm = min(M, _row_tile(K))

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((M, K), pypto.DT_BF16), w: pypto.Tensor((N, K), pypto.DT_INT8),
               ws: pypto.Tensor((1, N), pypto.DT_FP32), out: pypto.Tensor((M, N), pypto.DT_BF16)):
        pypto.set_vec_tile_shapes(tm, K)
        q, amax = _quant(pypto.cast(x, pypto.DT_FP32))
        pypto.set_cube_tile_shapes([16, 16], [256, 256], [128, 128])
        acc = pypto.matmul(q, w, pypto.DT_INT32, b_trans=True)
        pypto.set_vec_tile_shapes(tm, min(N, 1024))
        out.move(pypto.cast(_dequant(acc, ws, amax), pypto.DT_BF16))

    return kernel


def _rmsnorm(h, gamma, H: int, eps: float):
    """bf16(h / rms(h) * gamma) in fp32, h fp32 [m, H] holding bf16 values."""
    var = pypto.div(pypto.sum(pypto.mul(h, h), -1, True), float(H))
    rinv = pypto.rsqrt(pypto.add(var, eps))
    y = pypto.mul(pypto.mul(h, rinv), pypto.cast(gamma, pypto.DT_FP32))
    return pypto.cast(pypto.cast(y, pypto.DT_BF16), pypto.DT_FP32)


def _add_bf16(a, b):
    """bf16(a + b) from bf16 operands, as fp32 holding bf16 values."""
    s = pypto.add(pypto.cast(a, pypto.DT_FP32), pypto.cast(b, pypto.DT_FP32))
    return pypto.cast(pypto.cast(s, pypto.DT_BF16), pypto.DT_FP32)


def _silu_mul(g, u):
    """bf16(SiLU(g) * u) from fp32 g, u, as fp32 holding bf16 values."""
    s = pypto.div(g, pypto.add(pypto.exp(pypto.mul(g, -1.0)), 1.0))
    return pypto.cast(pypto.cast(pypto.mul(s, u), pypto.DT_BF16), pypto.DT_FP32)


@lru_cache(maxsize=None)
def rmsnorm_quant(M: int, H: int, eps: float, run_mode) -> object:
    """kernel(x, residual, gamma [1, H], q_out int8, scale_out fp32 [M, 1], h_out bf16): residual
    add, RMSNorm, per-token int8 (layer_ref.rmsnorm_quant; its mean square is fp64, this one fp32)."""
    tm = min(M, _row_tile(H))

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((M, H), pypto.DT_BF16), residual: pypto.Tensor((M, H), pypto.DT_BF16),
               gamma: pypto.Tensor((1, H), pypto.DT_BF16), q_out: pypto.Tensor((M, H), pypto.DT_INT8),
               scale_out: pypto.Tensor((M, 1), pypto.DT_FP32), h_out: pypto.Tensor((M, H), pypto.DT_BF16)):
        pypto.set_vec_tile_shapes(tm, H)
        h = _add_bf16(x, residual)
        h_out.move(pypto.cast(h, pypto.DT_BF16))
        q, amax = _quant(_rmsnorm(h, gamma, H, eps))
        q_out.move(q)
        scale_out.move(pypto.div(amax, 127.0))

    return kernel


@lru_cache(maxsize=None)
def mlp_block(M: int, H: int, I: int, eps: float, run_mode) -> object:  # noqa: E741
    """The decoder layer after attention as one kernel: residual add + post-norm + quant,
    gate_up GEMM + dequant, SiLU * up + quant, down GEMM + dequant.
    kernel(attn_out, residual, gamma [1, H], w_gate_up int8 [2I, H], s_gate_up [1, 2I],
           w_down int8 [H, I], s_down [1, H], out bf16 [M, H], h_out bf16 [M, H])."""
    tm, tn = min(M, _row_tile(H)), min(I, 2048)

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((M, H), pypto.DT_BF16), residual: pypto.Tensor((M, H), pypto.DT_BF16),
               gamma: pypto.Tensor((1, H), pypto.DT_BF16), w_gu: pypto.Tensor((2 * I, H), pypto.DT_INT8),
               s_gu: pypto.Tensor((1, 2 * I), pypto.DT_FP32), w_d: pypto.Tensor((H, I), pypto.DT_INT8),
               s_d: pypto.Tensor((1, H), pypto.DT_FP32), out: pypto.Tensor((M, H), pypto.DT_BF16),
               h_out: pypto.Tensor((M, H), pypto.DT_BF16)):
        pypto.set_vec_tile_shapes(tm, H)
        h = _add_bf16(x, residual)
        h_out.move(pypto.cast(h, pypto.DT_BF16))
        q, amax = _quant(_rmsnorm(h, gamma, H, eps))
        pypto.set_cube_tile_shapes([16, 16], [256, 256], [128, 128])
        acc = pypto.matmul(q, w_gu, pypto.DT_INT32, b_trans=True)
        pypto.set_vec_tile_shapes(tm, tn)
        gu = pypto.cast(pypto.cast(_dequant(acc, s_gu, amax), pypto.DT_BF16), pypto.DT_FP32)
        act = _silu_mul(pypto.view(gu, [M, I], [0, 0]), pypto.view(gu, [M, I], [0, I]))
        q2, amax2 = _quant(act)
        pypto.set_cube_tile_shapes([16, 16], [256, 256], [128, 128])
        acc2 = pypto.matmul(q2, w_d, pypto.DT_INT32, b_trans=True)
        pypto.set_vec_tile_shapes(tm, H)
        out.move(pypto.cast(_dequant(acc2, s_d, amax2), pypto.DT_BF16))

    return kernel


@lru_cache(maxsize=None)
def qk_norm_rope(rows: int, hd: int, eps: float, run_mode) -> object:
    """Per-head RMSNorm + rotate-half RoPE on [rows, hd] head rows in fp32, one bf16 rounding
    (layer_ref.qk_norm_rope). cos/sin come replicated per row ([rows, hd/2], the corrected
    upstream form: every head row carries its own token's angles).
    kernel(x bf16 [rows, hd], gamma bf16 [1, hd], cos fp32, sin fp32, out bf16 [rows, hd])."""
    half = hd // 2
    tr = min(rows, 64)

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((rows, hd), pypto.DT_BF16), gamma: pypto.Tensor((1, hd), pypto.DT_BF16),
               cos: pypto.Tensor((rows, half), pypto.DT_FP32), sin: pypto.Tensor((rows, half), pypto.DT_FP32),
               out: pypto.Tensor((rows, hd), pypto.DT_BF16)):
        pypto.set_vec_tile_shapes(tr, hd)
        xf = pypto.cast(x, pypto.DT_FP32)
        var = pypto.div(pypto.sum(pypto.mul(xf, xf), -1, True), float(hd))
        xn = pypto.mul(pypto.mul(xf, pypto.rsqrt(pypto.add(var, eps))), pypto.cast(gamma, pypto.DT_FP32))
        x1, x2 = pypto.view(xn, [rows, half], [0, 0]), pypto.view(xn, [rows, half], [0, half])
        o1 = pypto.sub(pypto.mul(x1, cos), pypto.mul(x2, sin))
        o2 = pypto.add(pypto.mul(x2, cos), pypto.mul(x1, sin))
        out.move(pypto.cast(pypto.concat([o1, o2], -1), pypto.DT_BF16))

    return kernel


@lru_cache(maxsize=None)
def decode_attention(B: int, nkv: int, group: int, S: int, hd: int, run_mode) -> object:
    """One new token per sequence against S cached positions (contiguous per sequence; the
    paged gather is not written yet): bf16 operands, fp32 scores and softmax, probabilities
    rounded to bf16 before P.V (the spec).
    kernel(q bf16 [B, nkv, group, hd], k, v bf16 [B, nkv, S, hd], out bf16 [B, nkv, group, hd])."""
    scale = hd ** -0.5

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(q: pypto.Tensor((B, nkv, group, hd), pypto.DT_BF16), k: pypto.Tensor((B, nkv, S, hd), pypto.DT_BF16),
               v: pypto.Tensor((B, nkv, S, hd), pypto.DT_BF16), out: pypto.Tensor((B, nkv, group, hd), pypto.DT_BF16)):
        pypto.set_cube_tile_shapes([16, 16], [64, 64], [64, 64])
        pypto.set_vec_tile_shapes(1, 1, group, S)
        scores = pypto.mul(pypto.matmul(q, k, pypto.DT_FP32, b_trans=True), scale)
        probs = pypto.cast(pypto.softmax(scores, dim=-1), pypto.DT_BF16)
        pypto.set_vec_tile_shapes(1, 1, group, hd)
        out.move(pypto.cast(pypto.matmul(probs, v, pypto.DT_FP32), pypto.DT_BF16))

    return kernel
