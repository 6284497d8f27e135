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


# Cube tiles of the int8 GEMMs: [m], [k], [n] at the L1 and L0 levels. One cube task per n tile
# of output channels, so n sets most of the layer's task count. Cost model, Qwen3-14B decode
# layer at batch 1 (benchmarks/pypto_tasks.py): n 128/k 256 1200 tasks before the attention
# re-tiling; n 256/k 256 fewer simulated cycles; n 512/k 128 fewest tasks (n 512/k 256 is refused).
INT8_CUBE_TILES = ([16, 16], [256, 256], [256, 256])


def _int8_cube_tiles():
    pypto.set_cube_tile_shapes(*INT8_CUBE_TILES)


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


def _a8w8(xf, w, ws, M: int, K: int, N: int):
    """fp32 [M, K] (holding bf16 values) -> per-token quant, int8 GEMM, fp32 dequant -> bf16 [M, N]."""
    tm = min(M, _row_tile(K))
    pypto.set_vec_tile_shapes(tm, K)
    q, amax = _quant(xf)
    _int8_cube_tiles()
    acc = pypto.matmul(q, w, pypto.DT_INT32, b_trans=True)
    pypto.set_vec_tile_shapes(tm, min(N, 1024))
    return pypto.cast(_dequant(acc, ws, amax), pypto.DT_BF16)


@lru_cache(maxsize=None)
def a8w8_linear(M: int, K: int, N: int, run_mode) -> object:
    """kernel(x bf16 [M, K], w int8 [N, K], w_scale fp32 [1, N], out bf16 [M, N])."""

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((M, K), pypto.DT_BF16), w: pypto.Tensor((N, K), pypto.DT_INT8),
               ws: pypto.Tensor((1, N), pypto.DT_FP32), out: pypto.Tensor((M, N), pypto.DT_BF16)):
        pypto.set_vec_tile_shapes(min(M, _row_tile(K)), K)
        out.move(_a8w8(pypto.cast(x, pypto.DT_FP32), w, ws, M, K, N))

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


def _mlp(x, residual, gamma, w_gu, s_gu, w_d, s_d, out, h_out, M: int, H: int, I: int, eps: float):  # noqa: E741
    """residual add + post-norm + quant, gate_up GEMM + dequant, SiLU * up + quant, down GEMM."""
    tm, tn = min(M, _row_tile(H)), min(I, 2048)
    pypto.set_vec_tile_shapes(tm, H)
    h = _add_bf16(x, residual)
    h_out.move(pypto.cast(h, pypto.DT_BF16))
    q, amax = _quant(_rmsnorm(h, gamma, H, eps))
    _int8_cube_tiles()
    acc = pypto.matmul(q, w_gu, pypto.DT_INT32, b_trans=True)
    pypto.set_vec_tile_shapes(tm, tn)
    gu = pypto.cast(pypto.cast(_dequant(acc, s_gu, amax), pypto.DT_BF16), pypto.DT_FP32)
    act = _silu_mul(pypto.view(gu, [M, I], [0, 0]), pypto.view(gu, [M, I], [0, I]))
    q2, amax2 = _quant(act)
    _int8_cube_tiles()
    acc2 = pypto.matmul(q2, w_d, pypto.DT_INT32, b_trans=True)
    pypto.set_vec_tile_shapes(tm, H)
    out.move(pypto.cast(_dequant(acc2, s_d, amax2), pypto.DT_BF16))


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

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((M, H), pypto.DT_BF16), residual: pypto.Tensor((M, H), pypto.DT_BF16),
               gamma: pypto.Tensor((1, H), pypto.DT_BF16), w_gu: pypto.Tensor((2 * I, H), pypto.DT_INT8),
               s_gu: pypto.Tensor((1, 2 * I), pypto.DT_FP32), w_d: pypto.Tensor((H, I), pypto.DT_INT8),
               s_d: pypto.Tensor((1, H), pypto.DT_FP32), out: pypto.Tensor((M, H), pypto.DT_BF16),
               h_out: pypto.Tensor((M, H), pypto.DT_BF16)):
        _mlp(x, residual, gamma, w_gu, s_gu, w_d, s_d, out, h_out, M, H, I, eps)

    return kernel


def _head_norm_rope(x, gamma, cos, sin, rows: int, hd: int, eps: float):
    """bf16 head rows [rows, hd] -> bf16(RoPE(RMSNorm(x) * gamma)), all in fp32 (layer_ref.qk_norm_rope)."""
    half = hd // 2
    pypto.set_vec_tile_shapes(min(rows, 64), hd)
    xf = pypto.cast(x, pypto.DT_FP32)
    var = pypto.div(pypto.sum(pypto.mul(xf, xf), -1, True), float(hd))
    xn = pypto.mul(pypto.mul(xf, pypto.rsqrt(pypto.add(var, eps))), pypto.cast(gamma, pypto.DT_FP32))
    x1, x2 = pypto.view(xn, [rows, half], [0, 0]), pypto.view(xn, [rows, half], [0, half])
    o1 = pypto.sub(pypto.mul(x1, cos), pypto.mul(x2, sin))
    o2 = pypto.add(pypto.mul(x2, cos), pypto.mul(x1, sin))
    return pypto.cast(pypto.concat([o1, o2], -1), pypto.DT_BF16)


@lru_cache(maxsize=None)
def qk_norm_rope(rows: int, hd: int, eps: float, run_mode) -> object:
    """Per-head RMSNorm + rotate-half RoPE on [rows, hd] head rows in fp32, one bf16 rounding
    (layer_ref.qk_norm_rope). cos/sin come replicated per row ([rows, hd/2], the corrected
    upstream form: every head row carries its own token's angles).
    kernel(x bf16 [rows, hd], gamma bf16 [1, hd], cos fp32, sin fp32, out bf16 [rows, hd])."""
    half = hd // 2

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((rows, hd), pypto.DT_BF16), gamma: pypto.Tensor((1, hd), pypto.DT_BF16),
               cos: pypto.Tensor((rows, half), pypto.DT_FP32), sin: pypto.Tensor((rows, half), pypto.DT_FP32),
               out: pypto.Tensor((rows, hd), pypto.DT_BF16)):
        out.move(_head_norm_rope(x, gamma, cos, sin, rows, hd, eps))

    return kernel


ATTN_GATHER_ROWS = 64  # rows of all kv heads per gather tile


def _write_kv(k_cache, v_cache, slots, k_new, v_new):
    """The new tokens' K and V rows [B, nkv*hd] into the paged caches [blocks*block_size, nkv*hd]
    at their slots [B, 1] (vLLM's slot_mapping: block * block_size + offset)."""
    k_cache[:] = pypto.scatter_update(k_cache, -2, slots, k_new)
    v_cache[:] = pypto.scatter_update(v_cache, -2, slots, v_new)


def _attend_seq(q, k_cache, v_cache, block_tables, seq_lens, pos, b, nkv: int, group: int, hd: int, bs: int,
                MB: int, out):
    """Decode attention of sequence b: gather its S = MB*bs cached positions through its block
    table row, mask those at or past its length, and write its nkv*group head rows of out.
    fp32 scores and softmax, probabilities rounded to bf16 before P.V (the spec)."""
    S, nq, D = MB * bs, nkv * group, nkv * hd
    table = pypto.view(block_tables, [1, MB], [b, 0])
    pypto.set_vec_tile_shapes(1, S)
    live = pypto.lt(pos, pypto.view(seq_lens, [1, 1], [b, 0]))
    pypto.set_vec_tile_shapes(min(S, ATTN_GATHER_ROWS), D)
    all_keys = pypto.experimental.gather_in_ub(k_cache, pos, table, bs, -2)
    all_vals = pypto.experimental.gather_in_ub(v_cache, pos, table, bs, -2)
    for h in range(nkv):
        keys, vals = pypto.view(all_keys, [S, hd], [0, h * hd]), pypto.view(all_vals, [S, hd], [0, h * hd])
        pypto.set_cube_tile_shapes([16, 16], [128, 128], [256, 256])
        pypto.set_vec_tile_shapes(group, S)
        scores = pypto.mul(pypto.matmul(pypto.view(q, [group, hd], [b * nq + h * group, 0]), keys, pypto.DT_FP32,
                                        b_trans=True), hd ** -0.5)
        probs = pypto.cast(pypto.softmax(pypto.where(live, scores, float("-inf")), dim=-1), pypto.DT_BF16)
        pypto.set_vec_tile_shapes(group, hd)
        out[b * nq + h * group:b * nq + (h + 1) * group, :] = pypto.cast(pypto.matmul(probs, vals, pypto.DT_FP32),
                                                                        pypto.DT_BF16)


@lru_cache(maxsize=None)
def paged_decode_attention(B: int, nkv: int, group: int, hd: int, slots_total: int, bs: int, MB: int,
                           run_mode) -> object:
    """One new token per sequence: write its K/V into the paged caches, then attend over the
    sequence's cached positions through its block table (vLLM's layout: caches of
    [num_blocks * block_size, nkv * hd], block_tables [B, MB] int32, seq_lens [B, 1] int32
    counting the new token, slot_mapping [B, 1] int64). pos is arange(MB * bs) as [1, S] int32.
    kernel(q bf16 [B*nq, hd], k_new, v_new bf16 [B, nkv*hd], slots, block_tables, seq_lens, pos,
           k_cache, v_cache (updated in place), out bf16 [B*nq, hd])."""
    nq, D, S = nkv * group, nkv * hd, MB * bs

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(q: pypto.Tensor((B * nq, hd), pypto.DT_BF16), k_new: pypto.Tensor((B, D), pypto.DT_BF16),
               v_new: pypto.Tensor((B, D), pypto.DT_BF16), slots: pypto.Tensor((B, 1), pypto.DT_INT64),
               block_tables: pypto.Tensor((B, MB), pypto.DT_INT32), seq_lens: pypto.Tensor((B, 1), pypto.DT_INT32),
               pos: pypto.Tensor((1, S), pypto.DT_INT32), k_cache: pypto.Tensor((slots_total, D), pypto.DT_BF16),
               v_cache: pypto.Tensor((slots_total, D), pypto.DT_BF16), out: pypto.Tensor((B * nq, hd), pypto.DT_BF16)):
        pypto.set_vec_tile_shapes(B, D)
        _write_kv(k_cache, v_cache, slots, k_new, v_new)
        for b in pypto.loop(B):
            _attend_seq(q, k_cache, v_cache, block_tables, seq_lens, pos, b, nkv, group, hd, bs, MB, out)

    return kernel


@lru_cache(maxsize=None)
def decode_layer(B: int, H: int, nq: int, nkv: int, hd: int, I: int, slots_total: int, bs: int, MB: int,  # noqa: E741
                 eps: float, run_mode) -> object:
    """A whole Qwen3 decoder layer for B decode tokens as one kernel: residual add + input norm
    + quant, QKV GEMM, per-head QK-norm + RoPE, paged K/V write, decode attention through the
    block tables, quant + O GEMM, then _mlp. Rounding points are the model class's
    (layer_ref): the QKV output, the rotated q/k, the attention output and each GEMM output
    are bf16. cos/sin come per head row ([B*nq, hd/2] for q, [B*nkv, hd/2] for k).
    kernel(x, residual bf16 [B, H], in_gamma [1, H], w_qkv int8 [(nq+2nkv)*hd, H], s_qkv [1, Nqkv],
           q_gamma, k_gamma bf16 [1, hd], cos_q, sin_q, cos_k, sin_k, slots, block_tables, seq_lens,
           pos, k_cache, v_cache, w_o int8 [H, nq*hd], s_o [1, H], post_gamma [1, H], w_gu, s_gu,
           w_d, s_d, out bf16 [B, H], h_out bf16 [B, H] (the residual for the next layer))."""
    group, half, Q, D = nq // nkv, hd // 2, nq * hd, nkv * hd
    N = Q + 2 * D
    tm = min(B, _row_tile(H))

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((B, H), pypto.DT_BF16), residual: pypto.Tensor((B, H), pypto.DT_BF16),
               in_gamma: pypto.Tensor((1, H), pypto.DT_BF16), w_qkv: pypto.Tensor((N, H), pypto.DT_INT8),
               s_qkv: pypto.Tensor((1, N), pypto.DT_FP32), q_gamma: pypto.Tensor((1, hd), pypto.DT_BF16),
               k_gamma: pypto.Tensor((1, hd), pypto.DT_BF16), cos_q: pypto.Tensor((B * nq, half), pypto.DT_FP32),
               sin_q: pypto.Tensor((B * nq, half), pypto.DT_FP32), cos_k: pypto.Tensor((B * nkv, half), pypto.DT_FP32),
               sin_k: pypto.Tensor((B * nkv, half), pypto.DT_FP32), slots: pypto.Tensor((B, 1), pypto.DT_INT64),
               block_tables: pypto.Tensor((B, MB), pypto.DT_INT32), seq_lens: pypto.Tensor((B, 1), pypto.DT_INT32),
               pos: pypto.Tensor((1, MB * bs), pypto.DT_INT32), k_cache: pypto.Tensor((slots_total, D), pypto.DT_BF16),
               v_cache: pypto.Tensor((slots_total, D), pypto.DT_BF16), w_o: pypto.Tensor((H, Q), pypto.DT_INT8),
               s_o: pypto.Tensor((1, H), pypto.DT_FP32), post_gamma: pypto.Tensor((1, H), pypto.DT_BF16),
               w_gu: pypto.Tensor((2 * I, H), pypto.DT_INT8), s_gu: pypto.Tensor((1, 2 * I), pypto.DT_FP32),
               w_d: pypto.Tensor((H, I), pypto.DT_INT8), s_d: pypto.Tensor((1, H), pypto.DT_FP32),
               out: pypto.Tensor((B, H), pypto.DT_BF16), h_out: pypto.Tensor((B, H), pypto.DT_BF16)):
        pypto.set_vec_tile_shapes(tm, H)
        h = _add_bf16(x, residual)
        qkv = _a8w8(_rmsnorm(h, in_gamma, H, eps), w_qkv, s_qkv, B, H, N)
        qr = _head_norm_rope(pypto.reshape(pypto.view(qkv, [B, Q], [0, 0]), [B * nq, hd]), q_gamma, cos_q, sin_q,
                             B * nq, hd, eps)
        kr = _head_norm_rope(pypto.reshape(pypto.view(qkv, [B, D], [0, Q]), [B * nkv, hd]), k_gamma, cos_k, sin_k,
                             B * nkv, hd, eps)
        pypto.set_vec_tile_shapes(B, D)
        _write_kv(k_cache, v_cache, slots, pypto.reshape(kr, [B, D]), pypto.view(qkv, [B, D], [0, Q + D]))
        attn = pypto.zeros([B * nq, hd], dtype=pypto.DT_BF16)
        for b in pypto.loop(B):
            _attend_seq(qr, k_cache, v_cache, block_tables, seq_lens, pos, b, nkv, group, hd, bs, MB, attn)
        pypto.set_vec_tile_shapes(min(B, _row_tile(Q)), Q)
        o = _a8w8(pypto.cast(pypto.reshape(attn, [B, Q]), pypto.DT_FP32), w_o, s_o, B, Q, H)
        _mlp(o, h, post_gamma, w_gu, s_gu, w_d, s_d, out, h_out, B, H, I, eps)

    return kernel
