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
from dataclasses import dataclass
from functools import lru_cache

from . import import_pypto

pypto = import_pypto()

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
    tn = min(N, 1024)
    pypto.set_vec_tile_shapes(min(tm, _row_tile(tn)), tn)
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


@lru_cache(maxsize=None)
def linear_q(M: int, K: int, N: int, run_mode) -> object:
    """Already-quantized activations (layer_ref.linear_q): int8 GEMM and fp32 dequant -> bf16.
    kernel(q int8 [M, K], scale fp32 [M, 1] (amax/127), w int8 [N, K], w_scale fp32 [1, N], out bf16 [M, N])."""

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(q: pypto.Tensor((M, K), pypto.DT_INT8), scale: pypto.Tensor((M, 1), pypto.DT_FP32),
               w: pypto.Tensor((N, K), pypto.DT_INT8), ws: pypto.Tensor((1, N), pypto.DT_FP32),
               out: pypto.Tensor((M, N), pypto.DT_BF16)):
        _int8_cube_tiles()
        acc = pypto.matmul(q, w, pypto.DT_INT32, b_trans=True)
        pypto.set_vec_tile_shapes(min(M, _row_tile(N)), min(N, 1024))
        out.move(pypto.cast(pypto.mul(pypto.mul(pypto.cast(acc, pypto.DT_FP32), ws), scale), pypto.DT_BF16))

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
    tmi = min(tm, _row_tile(tn))  # rows of the gate/up tiles: [tmi, tn] fp32 operands within on-chip memory
    pypto.set_vec_tile_shapes(tm, H)
    h = _add_bf16(x, residual)
    h_out.move(pypto.cast(h, pypto.DT_BF16))
    q, amax = _quant(_rmsnorm(h, gamma, H, eps))
    _int8_cube_tiles()
    acc = pypto.matmul(q, w_gu, pypto.DT_INT32, b_trans=True)
    pypto.set_vec_tile_shapes(tmi, tn)
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


def _bf16r(t):
    """Round fp32 to bf16 and back: a rounding point of the torch ops a kernel mirrors."""
    return pypto.cast(pypto.cast(t, pypto.DT_BF16), pypto.DT_FP32)


# The two numerics of per-head QK-norm + RoPE a kernel can mirror:
# "vllm": the model class's default path, vLLM's own RMSNorm and RotaryEmbedding in their torch
#   implementations (forward_native, vllm 0.32.0, in bf16): y = bf16(bf16(x / rms) * gamma), then
#   each product and sum of the rotation rounded to bf16, with vLLM's bf16 cos/sin table (passed
#   as fp32). The PyPTO prefill path calls those same implementations (model/pypto_layer.py).
# "fused": flag fused_qk_norm_rope (layer_ref.qk_norm_rope): fp32 throughout, fp32 cos/sin, one
#   rounding to bf16 at the end.
QK_MODES = ("vllm", "fused")


def _head_norm_rope(x, gamma, cos, sin, rows: int, hd: int, eps: float, mode: str):
    """bf16 head rows [rows, hd] -> bf16(RoPE(RMSNorm(x) * gamma)) with the rounding points of `mode`."""
    half = hd // 2
    pypto.set_vec_tile_shapes(min(rows, 64), hd)
    xf = pypto.cast(x, pypto.DT_FP32)
    rinv = pypto.rsqrt(pypto.add(pypto.div(pypto.sum(pypto.mul(xf, xf), -1, True), float(hd)), eps))
    g = pypto.cast(gamma, pypto.DT_FP32)
    vllm = mode == "vllm"
    xn = pypto.mul(_bf16r(pypto.mul(xf, rinv)), g) if vllm else pypto.mul(pypto.mul(xf, rinv), g)
    if vllm:
        xn = _bf16r(xn)
    r = _bf16r if vllm else (lambda t: t)  # noqa: E731
    x1, x2 = pypto.view(xn, [rows, half], [0, 0]), pypto.view(xn, [rows, half], [0, half])
    o1 = r(pypto.sub(r(pypto.mul(x1, cos)), r(pypto.mul(x2, sin))))
    o2 = r(pypto.add(r(pypto.mul(x2, cos)), r(pypto.mul(x1, sin))))
    return pypto.cast(pypto.concat([o1, o2], -1), pypto.DT_BF16)


@lru_cache(maxsize=None)
def qk_norm_rope(rows: int, hd: int, eps: float, run_mode, mode: str = "fused") -> object:
    """Per-head RMSNorm + rotate-half RoPE on [rows, hd] head rows (mode: QK_MODES). cos/sin come
    replicated per row ([rows, hd/2], the corrected upstream form: every head row carries its own
    token's angles). kernel(x bf16 [rows, hd], gamma bf16 [1, hd], cos fp32, sin fp32, out bf16)."""
    half = hd // 2

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((rows, hd), pypto.DT_BF16), gamma: pypto.Tensor((1, hd), pypto.DT_BF16),
               cos: pypto.Tensor((rows, half), pypto.DT_FP32), sin: pypto.Tensor((rows, half), pypto.DT_FP32),
               out: pypto.Tensor((rows, hd), pypto.DT_BF16)):
        out.move(_head_norm_rope(x, gamma, cos, sin, rows, hd, eps, mode))

    return kernel


ATTN_GATHER_ROWS = 64  # rows per gather tile (paired layout)
FLAT_GATHER = 4096  # elements per gather tile (flat layout)


@dataclass(frozen=True)
class PagedCache:
    """A layer's paged KV cache as the kernels see it: written with scatter_update and read with
    pypto.experimental.gather_in_ub (row = table[i // block_size] * block_size + i % block_size),
    through indices the host wrapper (paging.py) computes from vLLM's slot_mapping and block tables.

    "paired", vLLM-Ascend: K and V caches are two tensors [blocks, block_size, nkv, hd]
      (vllm_ascend/attention/attention_v1.py get_kv_cache_shape, allocated as a (k, v) pair in
      worker/model_runner_v1.py; vllm-ascend 0.23.0.post1), seen as rows [blocks * block_size,
      nkv * hd], one per token slot, every head in it. Write rows: the tokens' slots [B, 1];
      pages: the block tables [B, MB], gathered once per sequence for all its heads.
    "flat", vLLM-CPU: one tensor [blocks, nkv, block_size, 2 * hd] whose (block, head) interiors
      vLLM-CPU packs for its attention ISA (paging.py has the formulas), seen as elements [N, 1].
      Write rows: the element offsets of each new token's K and V, in (token, head, K/V, dim)
      order [2 * B * nkv * hd, 1]; pages: per (sequence, head, K/V) the offsets of its first
      MB * block_size positions, position-major [2 * B * nkv, MB * block_size * hd]. V lives in
      the same tensor: the v_cache parameter is a 1-element placeholder the kernel never touches."""

    kind: str
    rows: int  # rows of the K (paired) or whole (flat) cache view
    block_size: int
    nkv: int
    hd: int

    def __post_init__(self):
        if self.kind not in ("paired", "flat"):
            raise ValueError(f"unknown paged cache layout {self.kind!r}")

    @property
    def paired(self) -> bool:
        return self.kind == "paired"

    def k_shape(self) -> tuple[int, int]:
        return (self.rows, self.nkv * self.hd) if self.paired else (self.rows, 1)

    def v_shape(self) -> tuple[int, int]:
        return self.k_shape() if self.paired else (1, 1)

    def write_rows(self, B: int) -> int:
        return B if self.paired else 2 * B * self.nkv * self.hd

    def page_shape(self, B: int, MB: int) -> tuple[int, int]:
        return (B, MB) if self.paired else (2 * B * self.nkv, self.gather_len(MB))

    def gather_len(self, MB: int) -> int:
        """Entries of one gather's index vector (the kernel's gather_pos [1, this])."""
        return MB * self.block_size * (1 if self.paired else self.hd)

    def write(self, k_cache, v_cache, rows, k_new, v_new, B: int):
        """The new tokens' K and V [B, nkv * hd] into their slots."""
        if self.paired:
            pypto.set_vec_tile_shapes(B, self.nkv * self.hd)
            k_cache[:] = pypto.scatter_update(k_cache, -2, rows, k_new)
            v_cache[:] = pypto.scatter_update(v_cache, -2, rows, v_new)
            return
        n, hd = B * self.nkv, self.hd
        pypto.set_vec_tile_shapes(n, hd)
        kv = pypto.concat([pypto.reshape(k_new, [n, hd]), pypto.reshape(v_new, [n, hd])], -1)
        pypto.set_vec_tile_shapes(min(2 * n * hd, FLAT_GATHER), 1)
        k_cache[:] = pypto.scatter_update(k_cache, -2, rows, pypto.reshape(kv, [2 * n * hd, 1]))

    def heads(self, k_cache, v_cache, pages, gather_pos, b, MB: int) -> list:
        """[(keys, values)] of sequence b, [MB * block_size, hd] each, one pair per kv head."""
        S, hd, bs = MB * self.block_size, self.hd, self.block_size
        if self.paired:
            table = pypto.view(pages, [1, MB], [b, 0])
            pypto.set_vec_tile_shapes(min(S, ATTN_GATHER_ROWS), self.nkv * hd)
            keys = pypto.experimental.gather_in_ub(k_cache, gather_pos, table, bs, -2)
            vals = pypto.experimental.gather_in_ub(v_cache, gather_pos, table, bs, -2)
            return [(pypto.view(keys, [S, hd], [0, h * hd]), pypto.view(vals, [S, hd], [0, h * hd]))
                    for h in range(self.nkv)]
        G, out = S * hd, []
        for h in range(self.nkv):
            pair = []
            for j in (0, 1):
                table = pypto.view(pages, [1, G], [b * (2 * self.nkv) + 2 * h + j, 0])
                pypto.set_vec_tile_shapes(min(G, FLAT_GATHER), 1)
                flat = pypto.experimental.gather_in_ub(k_cache, gather_pos, table, 1, -2)
                pypto.set_vec_tile_shapes(min(S, ATTN_GATHER_ROWS), hd)
                pair.append(pypto.reshape(flat, [S, hd]))
            out.append(tuple(pair))
        return out


def _attend_seq(q, cache: PagedCache, k_cache, v_cache, pages, gather_pos, seq_lens, pos, b, group: int, MB: int,
                out):
    """Decode attention of sequence b: its cached positions through its pages, those at or past
    its length masked, and its nkv*group head rows of out. fp32 scores and softmax,
    probabilities rounded to bf16 before P.V (the spec)."""
    S, hd, nq = MB * cache.block_size, cache.hd, cache.nkv * group
    pypto.set_vec_tile_shapes(1, S)
    live = pypto.lt(pos, pypto.view(seq_lens, [1, 1], [b, 0]))
    for h, (keys, vals) in enumerate(cache.heads(k_cache, v_cache, pages, gather_pos, b, MB)):
        pypto.set_cube_tile_shapes([16, 16], [128, 128], [256, 256])
        pypto.set_vec_tile_shapes(group, S)
        scores = pypto.mul(pypto.matmul(pypto.view(q, [group, hd], [b * nq + h * group, 0]), keys, pypto.DT_FP32,
                                        b_trans=True), hd ** -0.5)
        probs = pypto.cast(pypto.softmax(pypto.where(live, scores, float("-inf")), dim=-1), pypto.DT_BF16)
        pypto.set_vec_tile_shapes(group, hd)
        out[b * nq + h * group:b * nq + (h + 1) * group, :] = pypto.cast(pypto.matmul(probs, vals, pypto.DT_FP32),
                                                                        pypto.DT_BF16)


@lru_cache(maxsize=None)
def paged_decode_attention(B: int, group: int, cache: PagedCache, MB: int, run_mode) -> object:
    """One new token per sequence: write its K/V into the paged cache, then attend over the
    sequence's cached positions (PagedCache says how rows, pages and caches are laid out).
    seq_lens [B, 1] int32 count the new token; pos is arange(MB * block_size) as [1, S] int32 and
    gather_pos arange(cache.gather_len(MB)) as [1, G] int32 (the same as pos for "paired").
    kernel(q bf16 [B*nq, hd], k_new, v_new bf16 [B, nkv*hd], rows int64 [cache.write_rows(B), 1],
           pages int32 cache.page_shape(B, MB), gather_pos, seq_lens, pos, k_cache, v_cache (updated
           in place), out bf16 [B*nq, hd])."""
    nq, hd, D, S = cache.nkv * group, cache.hd, cache.nkv * cache.hd, MB * cache.block_size
    W, G = cache.write_rows(B), cache.gather_len(MB)

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(q: pypto.Tensor((B * nq, hd), pypto.DT_BF16), k_new: pypto.Tensor((B, D), pypto.DT_BF16),
               v_new: pypto.Tensor((B, D), pypto.DT_BF16), rows: pypto.Tensor((W, 1), pypto.DT_INT64),
               pages: pypto.Tensor(cache.page_shape(B, MB), pypto.DT_INT32),
               gather_pos: pypto.Tensor((1, G), pypto.DT_INT32), seq_lens: pypto.Tensor((B, 1), pypto.DT_INT32),
               pos: pypto.Tensor((1, S), pypto.DT_INT32), k_cache: pypto.Tensor(cache.k_shape(), pypto.DT_BF16),
               v_cache: pypto.Tensor(cache.v_shape(), pypto.DT_BF16), out: pypto.Tensor((B * nq, hd), pypto.DT_BF16)):
        cache.write(k_cache, v_cache, rows, k_new, v_new, B)
        for b in pypto.loop(B):
            _attend_seq(q, cache, k_cache, v_cache, pages, gather_pos, seq_lens, pos, b, group, MB, out)

    return kernel


@lru_cache(maxsize=None)
def decode_layer(B: int, H: int, nq: int, I: int, cache: PagedCache, MB: int, eps: float,  # noqa: E741
                 qk_mode: str, run_mode) -> object:
    """A whole Qwen3 decoder layer for B decode tokens as one kernel: residual add + input norm
    + quant, QKV GEMM, per-head QK-norm + RoPE (qk_mode), paged K/V write, decode attention
    through the pages, quant + O GEMM, then _mlp. Rounding points are the model class's
    (layer_ref): the QKV output, the rotated q/k, the attention output and each GEMM output
    are bf16. cos/sin come per head row ([B*nq, hd/2] for q, [B*nkv, hd/2] for k).
    kernel(x, residual bf16 [B, H], in_gamma [1, H], w_qkv int8 [(nq+2nkv)*hd, H], s_qkv [1, Nqkv],
           q_gamma, k_gamma bf16 [1, hd], cos_q, sin_q, cos_k, sin_k, rows, pages, gather_pos, seq_lens,
           pos (as paged_decode_attention), k_cache, v_cache, w_o int8 [H, nq*hd], s_o [1, H], post_gamma [1, H], w_gu, s_gu,
           w_d, s_d, out bf16 [B, H], h_out bf16 [B, H] (the residual for the next layer))."""
    if qk_mode not in QK_MODES:
        raise ValueError(f"qk_mode {qk_mode!r}: one of {QK_MODES}")
    nkv, hd, bs = cache.nkv, cache.hd, cache.block_size
    group, half, Q, D = nq // nkv, hd // 2, nq * hd, nkv * hd
    N, W, G = Q + 2 * D, cache.write_rows(B), cache.gather_len(MB)
    tm = min(B, _row_tile(H))

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def kernel(x: pypto.Tensor((B, H), pypto.DT_BF16), residual: pypto.Tensor((B, H), pypto.DT_BF16),
               in_gamma: pypto.Tensor((1, H), pypto.DT_BF16), w_qkv: pypto.Tensor((N, H), pypto.DT_INT8),
               s_qkv: pypto.Tensor((1, N), pypto.DT_FP32), q_gamma: pypto.Tensor((1, hd), pypto.DT_BF16),
               k_gamma: pypto.Tensor((1, hd), pypto.DT_BF16), cos_q: pypto.Tensor((B * nq, half), pypto.DT_FP32),
               sin_q: pypto.Tensor((B * nq, half), pypto.DT_FP32), cos_k: pypto.Tensor((B * nkv, half), pypto.DT_FP32),
               sin_k: pypto.Tensor((B * nkv, half), pypto.DT_FP32), rows: pypto.Tensor((W, 1), pypto.DT_INT64),
               pages: pypto.Tensor(cache.page_shape(B, MB), pypto.DT_INT32),
               gather_pos: pypto.Tensor((1, G), pypto.DT_INT32), seq_lens: pypto.Tensor((B, 1), pypto.DT_INT32),
               pos: pypto.Tensor((1, MB * bs), pypto.DT_INT32), k_cache: pypto.Tensor(cache.k_shape(), pypto.DT_BF16),
               v_cache: pypto.Tensor(cache.v_shape(), pypto.DT_BF16), w_o: pypto.Tensor((H, Q), pypto.DT_INT8),
               s_o: pypto.Tensor((1, H), pypto.DT_FP32), post_gamma: pypto.Tensor((1, H), pypto.DT_BF16),
               w_gu: pypto.Tensor((2 * I, H), pypto.DT_INT8), s_gu: pypto.Tensor((1, 2 * I), pypto.DT_FP32),
               w_d: pypto.Tensor((H, I), pypto.DT_INT8), s_d: pypto.Tensor((1, H), pypto.DT_FP32),
               out: pypto.Tensor((B, H), pypto.DT_BF16), h_out: pypto.Tensor((B, H), pypto.DT_BF16)):
        pypto.set_vec_tile_shapes(tm, H)
        h = _add_bf16(x, residual)
        qkv = _a8w8(_rmsnorm(h, in_gamma, H, eps), w_qkv, s_qkv, B, H, N)
        qr = _head_norm_rope(pypto.reshape(pypto.view(qkv, [B, Q], [0, 0]), [B * nq, hd]), q_gamma, cos_q, sin_q,
                             B * nq, hd, eps, qk_mode)
        kr = _head_norm_rope(pypto.reshape(pypto.view(qkv, [B, D], [0, Q]), [B * nkv, hd]), k_gamma, cos_k, sin_k,
                             B * nkv, hd, eps, qk_mode)
        cache.write(k_cache, v_cache, rows, pypto.reshape(kr, [B, D]), pypto.view(qkv, [B, D], [0, Q + D]), B)
        attn = pypto.zeros([B * nq, hd], dtype=pypto.DT_BF16)
        for b in pypto.loop(B):
            _attend_seq(qr, cache, k_cache, v_cache, pages, gather_pos, seq_lens, pos, b, group, MB, attn)
        pypto.set_vec_tile_shapes(min(B, _row_tile(Q)), Q)
        o = _a8w8(pypto.cast(pypto.reshape(attn, [B, Q]), pypto.DT_FP32), w_o, s_o, B, Q, H)
        _mlp(o, h, post_gamma, w_gu, s_gu, w_d, s_d, out, h_out, B, H, I, eps)

    return kernel
