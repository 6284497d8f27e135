"""The PyPTO (Ascend) backend's kernels, checked on this CPU through pypto's interpreter
(vllm_pypto/kernels/ascend/verify.py) against the reference backend, and the guarantee that
CPU serving never imports pypto. Interpreter calls take seconds each: shapes stay small."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pypto = pytest.importorskip("pypto", reason="the ascend extra (pypto==0.2.0) is not installed")

from vllm_pypto.kernels import layer_ref as L  # noqa: E402
from vllm_pypto.kernels import reference as R  # noqa: E402
from vllm_pypto.kernels.ascend import kernels as K  # noqa: E402
from vllm_pypto.kernels.ascend.backend import PyptoBackend  # noqa: E402
from vllm_pypto.kernels.ascend.verify import cost_model, hook, interpreter, run_on_cpu  # noqa: E402

SIM = pypto.RunMode.SIM


def test_hook_replaces_exactly_the_method_it_was_written_for():
    h = hook()
    assert h.original_sha256() == h.ORIGINAL_SHA256, "pypto changed the private method patches/ replaces"
    assert h.calculator_sha256() == h.CALCULATOR_SHA256, "pypto changed the calculator build patches/ caches"
    h.install()
    h.install()  # idempotent
    from pypto.frontend.parser import entry

    assert entry.JitCallableWrapper.__dict__["_setup_verify_data"].__func__._pypto_patched


def _linear_case(M, Kd, N, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, Kd, generator=g) * 3).to(torch.bfloat16)
    if M > 1:
        x[0] = 0  # all-zero row: the amax floor (a batch of one keeps a non-zero row to compare)
    w = torch.randint(-127, 128, (N, Kd), generator=g, dtype=torch.int8)
    ws = torch.rand(N, generator=g) * 0.01 + 1e-4
    return x, w, ws


@pytest.mark.parametrize("M,Kd,N", [(1, 64, 32), (5, 128, 96)])
def test_a8w8_linear_kernel_equals_reference(M, Kd, N):
    x, w, ws = _linear_case(M, Kd, N, M * N)
    y = torch.zeros(M, N, dtype=torch.bfloat16)
    run_on_cpu(K.a8w8_linear(M, Kd, N, SIM), x, w, ws.reshape(1, N), y)
    ref = R.a8w8_linear(x, w, ws)
    assert y.abs().sum() > 0, "the interpreter returned zeros: the verify hook did not take"
    diff = (y.float() - ref.float()).abs()
    print(f"\nmax |pypto - reference| {diff.max().item():.3g} (values up to {ref.float().abs().max().item():.3g})")
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3)


def _block_case(M, H, I, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, H, generator=g) * 2).to(torch.bfloat16)
    r = (torch.randn(M, H, generator=g) * 3).to(torch.bfloat16)
    gamma = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16)
    wgu = torch.randint(-127, 128, (2 * I, H), generator=g, dtype=torch.int8)
    wd = torch.randint(-127, 128, (H, I), generator=g, dtype=torch.int8)
    return x, r, gamma, wgu, torch.rand(2 * I, generator=g) * 0.02 + 1e-4, wd, torch.rand(H, generator=g) * 0.01 + 1e-4


@pytest.mark.parametrize("M", [1, 3])  # ragged batch sizes
def test_rmsnorm_quant_kernel_equals_reference(M):
    H = 128
    x, r, gamma, *_ = _block_case(M, H, 64, M)
    q, s, h = torch.zeros(M, H, dtype=torch.int8), torch.zeros(M, 1), torch.zeros(M, H, dtype=torch.bfloat16)
    run_on_cpu(K.rmsnorm_quant(M, H, 1e-6, SIM), x, r, gamma.reshape(1, H), q, s, h)
    qr, sr, hr = L.rmsnorm_quant(x, r, gamma, 1e-6)
    assert torch.equal(h, hr)
    # fp32 mean square here, fp64 in the reference: at most a rare one-step flip
    assert (q.int() - qr.int()).abs().max() <= 1 and (q != qr).float().mean() < 1e-2
    torch.testing.assert_close(s[:, 0], sr, rtol=1e-6, atol=0)


@pytest.mark.parametrize("M", [1, 5])
def test_mlp_block_kernel_equals_reference(M):
    """residual + post-norm + quant, gate_up, SiLU*up + quant, down: one PyPTO kernel."""
    H, I = 128, 256  # noqa: E741
    x, r, gamma, wgu, sgu, wd, sd = _block_case(M, H, I, 10 + M)
    out, h = torch.zeros(M, H, dtype=torch.bfloat16), torch.zeros(M, H, dtype=torch.bfloat16)
    run_on_cpu(K.mlp_block(M, H, I, 1e-6, SIM), x, r, gamma.reshape(1, H), wgu, sgu.reshape(1, -1), wd,
               sd.reshape(1, -1), out, h)
    q, s, hr = L.rmsnorm_quant(x, r, gamma, 1e-6)
    q2, s2 = L.silu_mul_quant(L.linear_q(q, s, wgu, sgu))
    ref = L.linear_q(q2, s2, wd, sd)
    assert torch.equal(h, hr)
    # one int8 step of the down-proj input may flip (fp32 vs fp64 norm and SiLU), nothing more
    err = (out.float() - ref.float()).abs().max().item()
    print(f"\nmlp block: max |pypto - reference| {err:.3g} of {ref.float().abs().max().item():.3g}")
    assert err <= 0.02 * ref.float().abs().max().item()


def test_qk_norm_rope_kernel_equals_reference():
    """Head rows token-major with cos/sin replicated per row (the corrected upstream form)."""
    T, nq, nkv, hd = 3, 4, 2, 128
    g = torch.Generator().manual_seed(7)
    q = torch.randn(T, nq, hd, generator=g).to(torch.bfloat16)
    k = torch.randn(T, nkv, hd, generator=g).to(torch.bfloat16)
    qg, kg = ((torch.rand(hd, generator=g) + 0.5).to(torch.bfloat16) for _ in range(2))
    pos = torch.tensor([0, 5, 4000])
    qr, _ = L.qk_norm_rope(q, k, pos, qg, kg, 1e-6, 1e6)
    cos, sin = L.rope_cos_sin(pos, hd, 1e6)
    out = torch.zeros(T * nq, hd, dtype=torch.bfloat16)
    run_on_cpu(K.qk_norm_rope(T * nq, hd, 1e-6, SIM), q.reshape(T * nq, hd), qg.reshape(1, hd),
               cos.repeat_interleave(nq, 0).contiguous(), sin.repeat_interleave(nq, 0).contiguous(), out)
    ref = qr.reshape(T * nq, hd).float()
    assert out.abs().sum() > 0
    # fp32 rsqrt and sum order may move a value by one bf16 rounding step, no more
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-3)


def paged_caches(B, nkv, hd, bs, MB, lens, g):
    """Random paged K/V caches as slot rows [blocks * bs, nkv * hd], a scrambled block table per
    sequence (padded with block 0, as vLLM pads) and each new token's slot at position len-1."""
    nb = B * MB + 1
    perm = torch.randperm(nb - 1, generator=g)[: B * MB].view(B, MB) + 1
    tables = torch.zeros(B, MB, dtype=torch.int32)
    for b, n in enumerate(lens):
        tables[b, :-(-n // bs)] = perm[b, :-(-n // bs)].int()
    kc, vc = (torch.randn(nb * bs, nkv * hd, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([[int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs] for b, n in enumerate(lens)])
    return kc, vc, tables, slots


def platform_cache(layout, kc, vc, nkv, hd, bs):
    """The slot-row caches in a platform's own tensors: vLLM-Ascend's (k, v) pair, or vLLM-CPU's
    one tensor written by vLLM-CPU's own cache op for the ISA its attention takes here.
    Returns (kv_cache, isa, read) where read(kv_cache) gives the slot rows back."""
    nb = kc.shape[0] // bs
    if layout == "paired":
        pair = (kc.view(nb, bs, nkv, hd), vc.view(nb, bs, nkv, hd))
        return pair, None, lambda c: (c[0].reshape(-1, nkv * hd), c[1].reshape(-1, nkv * hd))
    from test_paging import HAS_AMX, vllm_cpu_write
    from vllm_pypto.kernels.ascend import paging as P

    isa = "amx" if HAS_AMX else "vec"
    slots = torch.arange(nb * bs)
    kv, _, _ = vllm_cpu_write(isa, nb, nkv, bs, hd, slots, torch.Generator().manual_seed(0))
    view = P.cache_view(kv, nkv, hd, isa)
    off = view.offsets(slots // bs, slots % bs)  # every slot: overwrite with the rows above
    view.k_rows[off[:, :, 0].reshape(-1), 0] = kc.view(-1, nkv, hd).reshape(-1)
    view.k_rows[off[:, :, 1].reshape(-1), 0] = vc.view(-1, nkv, hd).reshape(-1)

    def read(c):
        flat = P.cache_view(c, nkv, hd, isa).k_rows[:, 0]
        return flat[off[:, :, 0]].reshape(-1, nkv * hd), flat[off[:, :, 1]].reshape(-1, nkv * hd)
    return kv, isa, read


def spec_attention(q, kn, vn, slots, tables, lens, kc, vc, nkv, bs):
    """The spec in torch: write the new rows, attend over positions < len with fp32 scores and
    softmax and bf16 probabilities. Returns (k_cache, v_cache, out bf16 [B*nq, hd])."""
    hd = q.shape[1]
    group = q.shape[0] // (len(lens) * nkv)
    rk, rv = kc.clone(), vc.clone()
    rk[slots[:, 0]], rv[slots[:, 0]] = kn, vn
    out = torch.empty(q.shape)
    for b, n in enumerate(lens):
        rows = (tables[b].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
        for h in range(nkv):
            k, v = (c[rows, h * hd:(h + 1) * hd].float() for c in (rk, rv))
            r = slice((b * nkv + h) * group, (b * nkv + h + 1) * group)
            p = torch.softmax(q[r].float() @ k.T * hd ** -0.5, dim=-1).to(torch.bfloat16)
            out[r] = p.float() @ v
    return rk, rv, out.to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["paired", "flat"])
@pytest.mark.parametrize("lens", [[16], [5, 16, 1]])  # one full table; ragged lengths and batch
def test_paged_decode_attention_kernel_equals_spec(layout, lens):
    """On vLLM-Ascend's cache pair and on vLLM-CPU's own cache (its ISA's packing), through the
    host wrapper's indices: the new rows land in their slots and attention matches the spec."""
    from vllm_pypto.kernels.ascend import paging as P

    B, nkv, group, hd, bs, MB = len(lens), 2, 2, 64, 32, 2
    g = torch.Generator().manual_seed(20 + B)
    kc, vc, tables, slots = paged_caches(B, nkv, hd, bs, MB, lens, g)
    q, kn, vn = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((B * nkv * group, hd), (B, nkv * hd),
                                                                           (B, nkv * hd)))
    rk, rv, ref = spec_attention(q, kn, vn, slots, tables, lens, kc, vc, nkv, bs)
    kv, isa, read = platform_cache(layout, kc, vc, nkv, hd, bs)
    view = P.cache_view(kv, nkv, hd, isa)
    rows, pages, gpos = P.kernel_indices(view, slots[:, 0], tables)
    cache = K.PagedCache(view.kind, view.k_rows.shape[0], bs, nkv, hd)
    out = torch.zeros(B * nkv * group, hd, dtype=torch.bfloat16)
    run_on_cpu(K.paged_decode_attention(B, group, cache, MB, SIM), q, kn, vn, rows, pages, gpos,
               torch.tensor(lens, dtype=torch.int32)[:, None], torch.arange(MB * bs, dtype=torch.int32)[None],
               view.k_rows, view.v_rows, out)
    k_now, v_now = read(kv)
    assert torch.equal(k_now, rk) and torch.equal(v_now, rv), "the new K/V rows were not written to their slots"
    assert out.abs().sum() > 0
    print(f"\npaged attention ({layout}): max |pypto - spec| {(out.float() - ref.float()).abs().max().item():.3g}")
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2e-3)


@pytest.mark.parametrize("layout,qk_mode", [("paired", "fused"), ("flat", "vllm")])
def test_decode_layer_kernel_equals_reference(layout, qk_mode):
    """The whole decoder layer as one kernel, called through PyptoBackend.decode_layer, against
    the reference chain the model class runs (layer_ref ops + the spec attention above), ragged
    lengths over scrambled block tables, batch 2 padded to 2 and 3 padded to 4. qk_mode "vllm" is
    vLLM's own q/k RMSNorm and RoPE (forward_native, bf16 table), "fused" the flag's fp32 op."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm_pypto.kernels.ascend import paging as P

    lens = [7, 13] if layout == "paired" else [7, 40, 2]
    H, nq, nkv, hd, I, bs, MB, eps, theta = 128, 4, 2, 64, 256, 32, 2, 1e-6, 1e6  # noqa: E741
    B, Q, D = len(lens), nq * hd, nkv * hd
    g = torch.Generator().manual_seed(30)
    bf = lambda *s, k=1.0: (torch.randn(*s, generator=g) * k).to(torch.bfloat16)  # noqa: E731
    gam = lambda n: (torch.rand(n, generator=g) + 0.5).to(torch.bfloat16)  # noqa: E731
    w8 = lambda n, k: torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)  # noqa: E731
    sc = lambda n, k: torch.rand(n, generator=g) * k + 1e-4  # noqa: E731
    x, r = bf(B, H, k=2), bf(B, H, k=3)
    g_in, g_q, g_k, g_post = gam(H), gam(hd), gam(hd), gam(H)
    w_qkv, s_qkv, w_o, s_o = w8(Q + 2 * D, H), sc(Q + 2 * D, 0.01), w8(H, Q), sc(H, 0.01)
    w_gu, s_gu, w_d, s_d = w8(2 * I, H), sc(2 * I, 0.02), w8(H, I), sc(H, 0.01)
    kc, vc, tables, slots = paged_caches(B, nkv, hd, bs, MB, lens, g)
    positions = torch.tensor(lens) - 1

    q1, s1, h = L.rmsnorm_quant(x, r, g_in, eps)
    qkv = L.linear_q(q1, s1, w_qkv, s_qkv)
    q3, k3 = qkv[:, :Q].reshape(B, nq, hd), qkv[:, Q:Q + D].reshape(B, nkv, hd)
    if qk_mode == "fused":
        qr, kr = L.qk_norm_rope(q3, k3, positions, g_q, g_k, eps, theta)
        cos_sin = L.rope_cos_sin(positions, hd, theta)
    else:
        with set_current_vllm_config(VllmConfig()):
            qn, kn = RMSNorm(hd, eps=eps), RMSNorm(hd, eps=eps)
            rope = get_rope(hd, max_position=4096, is_neox_style=True, dtype=torch.bfloat16,
                            rope_parameters={"rope_theta": theta, "rope_type": "default"})
        qn.weight.data, kn.weight.data = g_q, g_k
        qr, kr = rope.forward_native(positions, qn.forward_native(q3).reshape(B, -1),
                                     kn.forward_native(k3).reshape(B, -1))
        cos_sin = rope.cos_sin_cache[positions].float().chunk(2, -1)
    rk, rv, attn = spec_attention(qr.reshape(B * nq, hd), kr.reshape(B, D), qkv[:, Q + D:], slots, tables, lens, kc,
                                  vc, nkv, bs)
    q2, s2, h2 = L.rmsnorm_quant(R.a8w8_linear(attn.reshape(B, Q), w_o, s_o), h, g_post, eps)
    ref = L.linear_q(*L.silu_mul_quant(L.linear_q(q2, s2, w_gu, s_gu)), w_d, s_d).float()

    backend = PyptoBackend(run_mode=SIM)
    weights = {"input_layernorm": g_in, "q_norm": g_q, "k_norm": g_k, "post_attention_layernorm": g_post,
               **{name: backend.prepack(w, s) for name, (w, s) in {
                   "qkv_proj": (w_qkv, s_qkv), "o_proj": (w_o, s_o), "gate_up_proj": (w_gu, s_gu),
                   "down_proj": (w_d, s_d)}.items()}}
    kv, isa, read = platform_cache(layout, kc, vc, nkv, hd, bs)
    batch = P.DecodeBatch(slots[:, 0], tables, torch.tensor(lens, dtype=torch.int32))
    with interpreter():
        out, h_out = backend.decode_layer(x, r, weights, kv, batch, cos_sin, eps, qk_mode, isa)
    k_now, v_now = read(kv)
    # fp32 norms here, fp64 in the reference: a bf16 step in q/k or one int8 step may move, nothing more
    torch.testing.assert_close(k_now.float(), rk.float(), rtol=2 ** -7, atol=1e-2)
    assert torch.equal(v_now, rv)
    torch.testing.assert_close(h_out, h2, rtol=2 ** -7, atol=1e-2)
    err = (out.float() - ref).abs().max().item()
    print(f"\ndecode layer ({layout}, {qk_mode}): max |pypto - reference| {err:.3g} of {ref.abs().max().item():.3g}")
    assert out.shape == (B, H) and out.abs().sum() > 0 and err <= 0.02 * ref.abs().max().item()


def test_prefill_kernels_equal_reference():
    """The prefill path's kernels through the backend: token rows padded to a power of two."""
    M, H, N = 13, 128, 192
    g = torch.Generator().manual_seed(40)
    x, r, gamma, *_ = _block_case(M, H, 64, 40)
    w = torch.randint(-127, 128, (N, H), generator=g, dtype=torch.int8)
    ws = torch.rand(N, generator=g) * 0.01 + 1e-4
    backend = PyptoBackend(run_mode=SIM)
    packed = backend.prepack(w, ws)
    with interpreter():
        q, s, h = backend.rmsnorm_quant(x, r, gamma, 1e-6)
        y = backend.linear_q(q, s, packed)
    qr, sr, hr = L.rmsnorm_quant(x, r, gamma, 1e-6)
    assert q.shape == (M, H) and s.shape == (M,) and torch.equal(h, hr)
    assert (q.int() - qr.int()).abs().max() <= 1
    assert torch.equal(y, L.linear_q(q, s, w, ws))
    assert backend.stats.calls == 2


@pytest.mark.heavy
def test_mlp_block_kernel_at_the_14b_decode_shape():
    """Opt-in (`make test-heavy`): the MLP block at Qwen3-14B width, batch 4, through the interpreter."""
    M, H, I = 4, 5120, 17408  # noqa: E741
    x, r, gamma, wgu, sgu, wd, sd = _block_case(M, H, I, 14)
    out, h = torch.zeros(M, H, dtype=torch.bfloat16), torch.zeros(M, H, dtype=torch.bfloat16)
    run_on_cpu(K.mlp_block(M, H, I, 1e-6, SIM), x, r, gamma.reshape(1, H), wgu, sgu.reshape(1, -1), wd,
               sd.reshape(1, -1), out, h)
    q, s, _ = L.rmsnorm_quant(x, r, gamma, 1e-6)
    q2, s2 = L.silu_mul_quant(L.linear_q(q, s, wgu, sgu))
    ref = L.linear_q(q2, s2, wd, sd).float()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    print(f"\n14B MLP block: cosine {cos:.7f}, max |diff| {(out.float() - ref).abs().max().item():.3g}")
    assert cos > 0.9999


def test_cost_model_counts_tasks():
    M, Kd, N = 4, 64, 32
    x, w, ws = _linear_case(M, Kd, N, 0)
    rep = cost_model(K.a8w8_linear(M, Kd, N, SIM), x, w, ws.reshape(1, N), torch.zeros(M, N, dtype=torch.bfloat16))
    assert rep["tasks"] >= 2 and rep["cube_tasks"] >= 1 and rep["vector_tasks"] >= 1 and rep["cycles"] > 0, rep


def test_cpu_serving_never_imports_pypto(tiny_w8a8):
    code = ("import sys\nfrom vllm_pypto import register\nregister()\n"
            "from vllm_pypto.kernels import get_backend\nget_backend()\n"
            "import vllm_pypto.model.qwen3, vllm_pypto.quant.linear\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('pypto', 'torch_npu')]\n"
            "assert not bad, bad\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
