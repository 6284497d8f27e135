"""The native backend against the reference backend, on every ISA path this CPU runs (the `isa`
fixture): equal int32 sums and the same fp32 epilogue, so outputs must be bit-identical (NaN
rows included)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_pypto.kernels import CpuNativeBackend, ReferenceBackend, cpu_isa_flags, native_cpu_status
from vllm_pypto.kernels import reference as ref

# Skip only where the CPU itself cannot run the kernels (no AVX2+FMA). On any other x86-64 CPU
# a missing or broken build must fail here, not hide as skips.
pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= set(cpu_isa_flags()), reason="this CPU has no AVX2+FMA")


def test_native_backend_is_available_on_an_avx2_cpu():
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


@pytest.mark.parametrize("seed", range(40))
def test_random_shapes_bit_identical(seed, isa):
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


@pytest.mark.parametrize("M,K", [(1, 200), (2, 200), (3, 200), (4, 200), (5, 200), (15, 200), (16, 200), (17, 200), (31, 200),
                                 (32, 200), (33, 200), (64, 200), (65, 200), (97, 200),
                                 (113, 200), (130, 200), (160, 520),  # AMX: pairs of 16-row blocks, + one
                                 (1070, 8200)])  # the last: AMX takes rows in chunks of ~8 MiB (1008 + 62 here)
def test_row_block_edges(M, K, isa):
    x, w, ws = _case(M, K, 150, M, "special")
    be = CpuNativeBackend()
    assert _same(be.linear(x, be.prepack(w, ws)), ref.a8w8_linear(x, w, ws))
    amax = ref.row_amax(x).clamp_min(ref.AMAX_FLOOR)
    assert torch.equal(be.gemm_int32(x, amax, be.prepack(w, ws)), ref.int8_gemm(ref.quantize_per_token(x)[0], w))


def test_special_rows_follow_the_reference(isa):
    x, w, ws = _case(6, 130, 70, 7, "special")
    be = CpuNativeBackend()
    y = be.linear(x, be.prepack(w, ws))
    assert (y[0] == 0).all()
    assert torch.isnan(y[2]).all() and torch.isnan(y[3]).all()
    assert torch.isfinite(y[[0, 1, 4, 5]]).all()
    assert _same(y, ref.a8w8_linear(x, w, ws))


def test_qwen3_shapes_and_3d_input(isa):
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
def test_row_parallel_shards_reproduce_the_whole_layer(backend, M, K, N, ranks, isa):
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


def test_weights_of_minus_128_stay_exact(isa):
    """Our quantizer clamps weights to +-127, but a foreign W8A8 checkpoint may hold -128; the AVX2
    path's |w| x sign(a, w) must still give the exact sums (|-128| is 128 as u8)."""
    for M in (1, 2, 5):
        x, w, ws = _case(M, 300, 70, M)
        w[::3, ::2] = -128
        x[0, :5] = torch.tensor([-127, 127, -1, 0, 1]).to(x.dtype) * x[0].abs().max()
        be = CpuNativeBackend()
        assert _same(be.linear(x, be.prepack(w, ws)), ref.a8w8_linear(x, w, ws))


def test_isa_path_chosen_by_environment(monkeypatch):
    """VLLM_PYPTO_CPU_ISA forces any path the CPU runs, refuses the others by name, and the log
    line names the path in use."""
    from vllm_pypto import _C
    from vllm_pypto.kernels.cpu_backend import ISA_ENV, choose_isa

    paths = _C.isa_paths()
    assert paths and paths[-1] == "avx2"  # every x86-64 CPU with AVX2+FMA has the AVX2 path
    assert ("amx" in paths) == ("amx_int8" in cpu_isa_flags())
    assert ("avx512" in paths) == ("avx512_vnni" in cpu_isa_flags())
    assert ("avx_vnni" in paths) == ("avx_vnni" in cpu_isa_flags())
    try:
        for p in paths:
            monkeypatch.setenv(ISA_ENV, p)
            assert choose_isa() == p
        monkeypatch.delenv(ISA_ENV)
        assert choose_isa() == paths[0]
        for bad in ({"amx", "avx512", "avx_vnni"} - set(paths)) | {"sse4"}:
            monkeypatch.setenv(ISA_ENV, bad)
            with pytest.raises(RuntimeError, match=f"{ISA_ENV}='{bad}'"):
                choose_isa()
    finally:
        _C.set_isa("auto")
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from vllm_pypto.kernels import get_backend; get_backend('cpu')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, ISA_ENV: "avx2"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "backend=cpu (ISA path avx2: AVX2 vpmaddubsw" in r.stderr


def test_no_avx512_outside_the_avx512_and_amx_paths():
    """One build must load and run on an AVX2-only CPU (an AMD EPYC Zen 3), where one AVX-512
    instruction is a SIGILL. Read from the built library itself: the AVX2 and AVX-VNNI functions
    (a8w8::avx2, which also holds the AVX2 kernels every path shares: decode attention and the
    attention prologue's per-head norm and RoPE) hold no zmm or mask register, the shared code
    (ops, selection) not even a ymm one, and the AVX-VNNI GEMM really uses vpdpbusd."""
    import shutil

    from vllm_pypto import _C

    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", _C.__file__], capture_output=True, text=True,
                         check=True).stdout
    bad, vnni, fn = set(), 0, ""
    for line in asm.splitlines():
        if line.endswith(">:"):
            fn = line
        elif "avx512::" in fn or "amx::" in fn or "a8w8::" not in fn:
            continue
        elif "zmm" in line or "%k" in line or ("avx2::" not in fn and "ymm" in line):
            bad.add(fn)
        elif "avx2::vnni::" in fn and "vpdpbusd" in line:
            vnni += 1
    assert not bad, sorted(bad)[:5]
    assert vnni > 0 and asm.count("avx2::plain::block") > 0


def test_int8_peak_probe(isa):
    """The compute limit benchmarks/linear.py divides by: positive on every path, and on an AMX
    CPU the tile unit's peak is far above the VNNI one (16x16x64 multiply-adds per tdpbusd
    against 16x4 per vpdpbusd), which is what makes large-M targets compute questions rather
    than bandwidth ones."""
    from vllm_pypto import _C

    peak = _C.int8_peak_gops(20000)
    assert peak > 0
    if isa == "amx":
        _C.set_isa("avx512")
        assert peak > 3 * _C.int8_peak_gops(20000)
