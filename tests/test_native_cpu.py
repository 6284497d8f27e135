"""The native AVX512-VNNI backend against the reference backend: equal int32 sums and the same
fp32 epilogue, so outputs must be bit-identical (NaN rows included)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_pypto.kernels import CpuNativeBackend, ReferenceBackend, cpu_isa_flags, native_cpu_status
from vllm_pypto.kernels import reference as ref

# Skip only where the CPU itself cannot run the kernels. On a VNNI CPU a missing or broken
# build must fail here, not hide as skips.
pytestmark = pytest.mark.skipif("avx512_vnni" not in cpu_isa_flags(), reason="this CPU has no AVX512-VNNI")


def test_native_backend_is_available_on_a_vnni_cpu():
    assert native_cpu_status() is None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that NaN payloads may differ (NaN positions may not)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.masked_fill(na, 0).view(torch.int16),
                                               b.masked_fill(nb, 0).view(torch.int16))


def _case(M, K, N, seed, mode="normal"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * 2)
    if mode == "special":
        x[0] = 0                      # all-zero row: amax floor
        if M > 1:
            x[1] *= 1e30              # huge magnitude row (finite in bf16)
        if M > 2:
            x[2, K // 2] = float("nan")
        if M > 3:
            x[3, 0] = float("-inf")
    w, ws = ref.quantize_weight_per_channel(torch.randn(N, K, generator=g))
    return x.to(torch.bfloat16), w, ws


@pytest.fixture(params=["vnni", "amx"])
def path(request):
    """Run the test on one int8 path: VNNI only, or AMX where M >= amx_min_m (if the CPU has it)."""
    from vllm_pypto import _C
    if request.param == "amx" and "amx_int8" not in cpu_isa_flags():
        pytest.skip("this CPU has no AMX-INT8")
    _C.set_amx(request.param == "amx")
    assert _C.isa() == request.param
    yield request.param
    _C.set_amx(True)


@pytest.mark.parametrize("seed", range(40))
def test_random_shapes_bit_identical(seed, path):
    g = torch.Generator().manual_seed(1000 + seed)
    M = int(torch.randint(1, 301, (1,), generator=g))
    K = int(torch.randint(1, 1500, (1,), generator=g))
    N = int(torch.randint(1, 700, (1,), generator=g))
    x, w, ws = _case(M, K, N, seed, "special" if seed % 3 == 0 else "normal")
    be = CpuNativeBackend()
    y = be.linear(x, be.prepack(w, ws))
    r = ReferenceBackend().linear(x, ReferenceBackend().prepack(w, ws))
    assert y.shape == r.shape == (M, N)
    assert _same(y, r), f"M={M} K={K} N={N}: max diff {(y.float() - r.float()).abs().max()}"


@pytest.mark.parametrize("M,K", [(3, 200), (4, 200), (5, 200), (15, 200), (16, 200), (17, 200), (31, 200),
                                 (32, 200), (33, 200), (64, 200), (65, 200), (97, 200),
                                 (1070, 8200)])  # the last: AMX takes rows in chunks of ~8 MiB (1008 + 62 here)
def test_row_block_edges(M, K, path):
    x, w, ws = _case(M, K, 150, M, "special")
    be = CpuNativeBackend()
    assert _same(be.linear(x, be.prepack(w, ws)), ref.a8w8_linear(x, w, ws))
    amax = ref.row_amax(x).clamp_min(ref.AMAX_FLOOR)
    assert torch.equal(be.gemm_int32(x, amax, be.prepack(w, ws)), ref.int8_gemm(ref.quantize_per_token(x)[0], w))


def test_special_rows_follow_the_reference():
    x, w, ws = _case(6, 130, 70, 7, "special")
    be = CpuNativeBackend()
    y = be.linear(x, be.prepack(w, ws))
    assert (y[0] == 0).all()
    assert torch.isnan(y[2]).all() and torch.isnan(y[3]).all()
    assert torch.isfinite(y[[0, 1, 4, 5]]).all()
    assert _same(y, ref.a8w8_linear(x, w, ws))


def test_qwen3_shapes_and_3d_input():
    for K, N in ((1024, 4096), (3072, 1024), (5120, 7168)):
        x, w, ws = _case(3, K, N, K)
        be = CpuNativeBackend()
        p = be.prepack(w, ws)
        y = be.linear(x.reshape(1, 3, K), p)
        assert y.shape == (1, 3, N) and _same(y[0], ref.a8w8_linear(x, w, ws))


def test_prepack_round_trip():
    g = torch.Generator().manual_seed(3)
    N, K = 150, 37
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    packed, comp = torch.ops.pypto_cpu.prepack(w)
    T, G = packed.shape[:2]
    assert (T, G) == (3, 16) and packed.shape[2] == 256  # K padded to 64 (one AMX tile row)
    unpacked = packed.view(T, G, 64, 4).permute(0, 2, 1, 3).reshape(T * 64, G * 4)
    assert torch.equal(unpacked[:N, :K], w)
    assert (unpacked[N:] == 0).all() and (unpacked[:, K:] == 0).all()
    assert torch.equal(comp[:N], 128 * w.int().sum(1))


def test_empty_batch():
    x, w, ws = _case(1, 64, 32, 0)
    be = CpuNativeBackend()
    assert be.linear(x[:0], be.prepack(w, ws)).shape == (0, 32)


def test_traces_under_torch_compile():
    x, w, ws = _case(5, 96, 40, 1)
    be = CpuNativeBackend()
    p = be.prepack(w, ws)
    f = torch.compile(lambda t: be.linear(t, p) * 2, fullgraph=True, backend="eager")
    assert _same(f(x), be.linear(x, p) * 2)


def test_auto_falls_back_to_reference_with_one_warning():
    """Without the native extension, `auto` serves on the reference backend and says why."""
    code = ("import sys, logging; sys.modules['vllm_pypto._C'] = None\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "from vllm_pypto.kernels import get_backend\n"
            "print('BACKEND', get_backend('auto').name, get_backend('auto').name)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "VLLM_PYPTO_BACKEND": "auto"})
    assert "BACKEND reference reference" in r.stdout, r.stderr[-2000:]
    assert r.stderr.count("native CPU kernels unavailable") == 1
    forced = subprocess.run([sys.executable, "-c", code.replace("'auto'", "'cpu'")], capture_output=True,
                            text=True, timeout=120)
    assert forced.returncode != 0 and "VLLM_PYPTO_BACKEND=cpu but the native extension" in forced.stderr


def test_thread_note_when_vllm_leaves_half_the_cpus():
    from vllm_pypto.kernels import thread_note
    assert "1 OpenMP thread(s) of this machine's 2 CPUs" in thread_note(1, 2, 1, None)
    assert thread_note(2, 2, 1, None) is None  # every CPU in use
    assert thread_note(1, 2, 2, None) is None  # TP=2, one CPU per rank
    assert thread_note(31, 32, 1, None) is None  # one CPU kept for the scheduler of a big machine
    assert thread_note(1, 2, 1, "0") is None  # the user chose the reservation
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from vllm_pypto.kernels import get_backend; get_backend('reference')\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_NUM_OF_RESERVED_CPU"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"1 of {os.cpu_count()} CPUs" in r.stderr
    assert (r.stderr.count("VLLM_CPU_NUM_OF_RESERVED_CPU=0") == 1) == (os.cpu_count() >= 2)


@pytest.mark.parametrize("backend", [ReferenceBackend, CpuNativeBackend])
@pytest.mark.parametrize("M, K, N, ranks", [(5, 512, 96, 2), (37, 300, 130, 2), (9, 1024, 64, 4)])
def test_row_parallel_shards_reproduce_the_whole_layer(backend, M, K, N, ranks):
    """What quant/tp.py does across ranks, on one process: each rank's K slice quantized
    with the max of the slices' amax, int32 sums added, one epilogue -> the TP=1 bits."""
    x, w, ws = _case(M, K, N, seed=M, mode="special")
    be = backend()
    whole = be.linear(x, be.prepack(w, ws))
    bounds = [K * i // ranks for i in range(ranks + 1)]
    slices = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    amax = torch.stack([ref.row_amax(x[:, s]) for s in slices]).amax(0).clamp_min(ref.AMAX_FLOOR)
    acc = sum(be.gemm_int32(x[:, s].contiguous(), amax, be.prepack(w[:, s].contiguous(), ws)) for s in slices)
    assert _same(ref.dequant_epilogue(acc, ws, ref.activation_scale(amax)), whole)
    # and per-slice scales (what a plain shard would do) do not: the reason for the all-reduce
    local = sum(be.linear(x[:, s].contiguous(), be.prepack(w[:, s].contiguous(), ws)).float() for s in slices)
    assert not _same(local.to(torch.bfloat16), whole)


def test_amx_can_be_switched_off_by_environment():
    code = ("import torch\nfrom vllm_pypto.kernels import get_backend\nfrom vllm_pypto import _C\n"
            "b = get_backend('cpu')\nprint('ISA', _C.isa(), 'AMX' in b.isa())\n")
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VLLM_PYPTO_CPU_AMX": "0"})
    assert "ISA vnni False" in off.stdout, off.stderr[-2000:]
    if "amx_int8" in cpu_isa_flags():
        on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "VLLM_PYPTO_CPU_AMX"})
        assert "ISA amx True" in on.stdout, on.stderr[-2000:]


def test_int8_peak_probe():
    """The compute limit benchmarks/linear.py divides by: positive, and on an AMX CPU the tile
    unit's peak is far above the VNNI one (16x16x64 multiply-adds per tdpbusd against 16x4 per
    vpdpbusd), which is what makes large-M targets compute questions rather than bandwidth ones."""
    from vllm_pypto import _C

    _C.set_amx(False)
    try:
        vnni = _C.int8_peak_gops(20000)
    finally:
        _C.set_amx(True)
    assert vnni > 0
    if "amx_int8" in cpu_isa_flags():
        assert _C.int8_peak_gops(20000) > 3 * vnni
