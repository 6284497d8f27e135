"""Our native x86-64 kernels (csrc/), built with the package: weights prepacked once into
64-channel tiles that every ISA path reads, per-token quantization fused in front of the GEMM,
the fp32 epilogue behind it, and the model class's fused row ops.

The ISA path is chosen by CPU feature, best first: AMX-INT8 (tiles from M = 4, AVX512-VNNI
below), AVX512-VNNI, AVX-VNNI, AVX2. VLLM_PYPTO_CPU_ISA=amx|avx512|avx_vnni|avx2 forces one
(a lower one, for tests and benchmarks; one the CPU lacks is an error). All paths are
bit-identical to the reference, so the choice changes speed only.
"""

from __future__ import annotations

import os

import torch

from .backend import A8W8Backend

ISA_ENV = "VLLM_PYPTO_CPU_ISA"

# what each path runs, for the once-per-process log line
ISA_TEXT = {
    "amx": "AMX-INT8 tdpbusd for M >= {amx_min_m}, AVX512-VNNI vpdpbusd below",
    "avx512": "AVX512-VNNI vpdpbusd (u8 x s8 -> s32, 16 channels a register)",
    "avx_vnni": "AVX-VNNI vpdpbusd (u8 x s8 -> s32, 8 channels a register)",
    "avx2": "AVX2 vpmaddubsw on |w| x sign(a, w) (exact int16 pairs), vpmaddwd to s32",
}


def native_cpu_status() -> str | None:
    """None when the native CPU kernels can run here, else the reason they cannot."""
    try:
        from .. import _C
    except ImportError as e:
        return f"the native extension vllm_pypto._C is not built ({e})"
    if not _C.isa_paths():
        return "this CPU has no AVX2+FMA, the least the native kernels need"
    return None


def choose_isa() -> str:
    """Apply VLLM_PYPTO_CPU_ISA (default auto: the best path) and return the path in use."""
    from .. import _C

    want = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    try:
        _C.set_isa(want)
    except RuntimeError as e:
        raise RuntimeError(f"{ISA_ENV}={want!r}: {str(e).splitlines()[0]}") from None
    return _C.isa()


class CpuNativeBackend(A8W8Backend):
    name = "cpu"
    fused_decoder_layer = True

    def isa(self) -> str:
        from .. import _C

        path = _C.isa()
        return f"ISA path {path}: " + ISA_TEXT[path].format(amx_min_m=_C.amx_min_m()) + \
            ", 64-channel weight tiles, fused quant + epilogue"

    def prepack(self, weight, weight_scale):
        packed, comp = torch.ops.pypto_cpu.prepack(weight)
        return {"weight_packed": packed, "weight_comp": comp, "weight_scale": weight_scale.float().contiguous()}

    def linear(self, x, packed):
        return torch.ops.pypto_cpu.a8w8_linear(x, packed["weight_packed"], packed["weight_comp"],
                                               packed["weight_scale"])

    def gemm_int32(self, x, amax, packed):
        return torch.ops.pypto_cpu.a8w8_gemm_s32(x, packed["weight_packed"], packed["weight_comp"], amax,
                                                 packed["weight_scale"].numel())

    def linear_q(self, q, scale, packed):
        return torch.ops.pypto_cpu.a8w8_linear_q(q, scale, packed["weight_packed"], packed["weight_comp"],
                                                 packed["weight_scale"])

    def rmsnorm_quant(self, x, residual, gamma, eps, deferred=False):
        return tuple(torch.ops.pypto_cpu.rmsnorm_quant(x, residual, gamma, eps, deferred))

    def silu_mul_quant(self, gate_up):
        return tuple(torch.ops.pypto_cpu.silu_mul_quant(gate_up))

    def silu_mul(self, gate_up):
        return torch.ops.pypto_cpu.silu_mul(gate_up)

    def gate_up_silu_quant(self, q, scale, packed):
        return tuple(torch.ops.pypto_cpu.gate_up_silu_quant(q, scale, packed["weight_packed"], packed["weight_comp"],
                                                            packed["weight_scale"]))

    def qk_norm_rope_cache(self, q, k, v, positions, q_gamma, k_gamma, eps, cos_sin, kv_cache, slots, interior):
        return torch.ops.pypto_cpu.qk_norm_rope_cache(q, k, v, positions, q_gamma, k_gamma, eps, cos_sin, kv_cache,
                                                      slots, interior)

    def unpacked(self, packed):
        raise NotImplementedError("the cpu backend runs every op natively")
