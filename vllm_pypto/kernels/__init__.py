"""Kernel backends behind one small interface.

A backend turns a loaded int8 weight and its per-channel scales into whatever layout
its kernel wants (`prepack`, once at load) and runs the A8W8 linear on bf16
activations (`linear`). The numerics contract is `reference.a8w8_linear`.

Backends: `reference` (torch, always there, the golden numerics) and `cpu` (our
AVX512-VNNI / AMX-INT8 kernels, built with the package). `auto` (the default) takes `cpu` where the
CPU has VNNI and the extension is built, else `reference` with one warning. A PyPTO/Ascend
backend plugs in here too, imported lazily, so the serving path never imports what the
machine cannot run (`pypto`: kernels/ascend/, where torch_npu is installed). Choose with
VLLM_PYPTO_BACKEND=auto|reference|cpu|pypto|pypto-interpret (the PyPTO kernels in pypto's
interpreter on a CPU: a correctness tool for the Ascend path); VLLM_PYPTO_CPU_AMX=0
keeps the cpu backend on AVX512-VNNI for every M.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from functools import cache

import torch

# A child of "vllm" so our lines use vLLM's log format and level.
logger = logging.getLogger("vllm.pypto")

from . import ops, reference  # noqa: E402,F401  registers torch.ops.pypto.* and the native ops' fake impls


class A8W8Backend(ABC):
    name: str
    runs_layers = False  # True: the model class hands it whole decoder layers (the PyPTO backend)

    @abstractmethod
    def isa(self) -> str:
        """What actually executes the int8 GEMM, for the once-per-process log line."""

    @abstractmethod
    def prepack(self, weight: torch.Tensor, weight_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """int8 [N,K] + fp32 [N] -> tensors stored on the layer. Must not keep `weight` alive
        if it repacks it (no second resident copy)."""

    @abstractmethod
    def linear(self, x: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
        """bf16 [..., K] -> bf16 [..., N] following the reference numerics."""

    @abstractmethod
    def gemm_int32(self, x: torch.Tensor, amax: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
        """bf16 [M, K] quantized with the given row amax (fp32 [M], floored) -> the exact int32
        sums [M, N], no epilogue. Tensor-parallel row shards all-reduce these."""

    # The model class's fused ops (reference: kernels/layer_ref.py). The defaults run the torch
    # reference as one custom op each; a backend with native kernels overrides them.
    def linear_q(self, q: torch.Tensor, scale: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
        """Already-quantized activations (int8 [M,K], fp32 scale [M]) -> bf16 [M, N]."""
        w, ws = self.unpacked(packed)
        return torch.ops.pypto.a8w8_linear_q_ref(q, scale, w, ws)

    def rmsnorm_quant(self, x, residual, gamma, eps: float, deferred: bool = False):
        """(x [+ residual]) -> (q, scale, h: the next residual)."""
        return tuple(torch.ops.pypto.rmsnorm_quant_ref(x, residual, gamma, eps, deferred))

    def silu_mul_quant(self, gate_up):
        return tuple(torch.ops.pypto.silu_mul_quant_ref(gate_up))

    def silu_mul(self, gate_up):
        """bf16(SiLU(gate) * up) for a bf16 (tensor-parallel) down-proj."""
        return torch.ops.pypto.silu_mul(gate_up)

    def gate_up_silu_quant(self, q, scale, packed):
        w, ws = self.unpacked(packed)
        return tuple(torch.ops.pypto.gate_up_silu_quant_ref(q, scale, w, ws))

    def unpacked(self, packed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 [N,K] and fp32 [N] for the reference ops (a backend that repacks overrides every op)."""
        return packed["weight"], packed["weight_scale"]


class ReferenceBackend(A8W8Backend):
    name = "reference"

    def isa(self) -> str:
        return "torch._int_mm (oneDNN/ATen int8 GEMM), fp32 epilogue in torch"

    def prepack(self, weight, weight_scale):
        return {"weight": weight.contiguous(), "weight_scale": weight_scale.float().contiguous()}

    def linear(self, x, packed):
        return torch.ops.pypto.a8w8_linear_ref(x, packed["weight"], packed["weight_scale"])

    def gemm_int32(self, x, amax, packed):
        q, _ = reference.quantize_per_token(x, amax)
        return reference.int8_gemm(q, packed["weight"])


class CpuNativeBackend(A8W8Backend):
    """Our AVX512-VNNI / AMX-INT8 kernels (csrc/a8w8_cpu.cpp): weights prepacked once into
    64-channel tiles that both paths read, per-token quantization fused in front of the GEMM,
    fp32 epilogue behind it. AMX takes M >= _C.amx_min_m() (4) where the CPU and kernel allow it."""

    name = "cpu"

    def isa(self) -> str:
        from .. import _C
        vnni = "AVX512-VNNI vpdpbusd (u8 x s8 -> s32)"
        if _C.isa() == "amx":
            vnni += f" for M < {_C.amx_min_m()}, AMX-INT8 tdpbusd for M >= {_C.amx_min_m()}"
        return vnni + ", 64-channel weight tiles, fused quant + epilogue"

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

    def unpacked(self, packed):
        raise NotImplementedError("the cpu backend runs every op natively")


def native_cpu_status() -> str | None:
    """None when the native CPU kernels can run here, else the reason they cannot."""
    try:
        from .. import _C
    except ImportError as e:
        return f"the native extension vllm_pypto._C is not built ({e})"
    if not _C.cpu_has_vnni():
        return "this CPU lacks AVX512-VNNI (or the F/BW/VL/DQ extensions the kernels are built for)"
    return None


BACKENDS = ("auto", "reference", "cpu", "pypto", "pypto-interpret")


def ascend_present() -> bool:
    """torch_npu is installed: an Ascend stack, where the PyPTO backend runs. Checked without
    importing anything, so CPU serving never loads torch_npu or pypto."""
    import importlib.util

    return importlib.util.find_spec("torch_npu") is not None


def _pypto_backend(interpret: bool) -> A8W8Backend:
    from .ascend.backend import PyptoBackend, npu_status, pypto_status

    why_not = pypto_status() if interpret else npu_status()
    if why_not is not None:
        raise RuntimeError(f"VLLM_PYPTO_BACKEND={'pypto-interpret' if interpret else 'pypto'} but {why_not}")
    if interpret:
        logger.warning("pypto-a8w8: VLLM_PYPTO_BACKEND=pypto-interpret runs the Ascend path's PyPTO kernels in "
                       "pypto's interpreter on this CPU: a correctness tool for that path, seconds per kernel call, "
                       "not a CPU serving mode (pypto's licence covers use with Huawei AI processors; CPU serving "
                       "uses the native kernels)")
    return PyptoBackend(interpret=interpret)


def cpu_isa_flags() -> list[str]:
    """The int8-relevant ISA extensions this CPU reports (Linux /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ("avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8") if f in flags]


def thread_note(threads: int, cpus: int, ranks: int, reserved_env: str | None) -> str | None:
    """A warning when vLLM-CPU left the kernels half the machine or less.

    vLLM-CPU binds each worker rank to the CPUs of its NUMA node minus one per rank, kept for
    its scheduler process; on a small machine that halves the threads the GEMMs stream weights
    with (a 2-CPU VM, 0.6B W8A8 served: batch-1 TPOT 154 -> 105 ms; README "CPU threads")."""
    if reserved_env is not None or threads * ranks * 2 > cpus:
        return None
    return (f"the A8W8 kernels run on {threads} OpenMP thread(s) of this machine's {cpus} CPUs "
            f"({ranks} rank(s)): vLLM-CPU keeps CPUs back for its scheduler process. On a machine "
            f"this small, VLLM_CPU_NUM_OF_RESERVED_CPU=0 lets the workers use every CPU "
            f"(the scheduler then shares them; measure with benchmarks/serving.py +allcores)")


def _ranks() -> int:
    try:
        from vllm.distributed import parallel_state as ps
        return ps.get_tensor_model_parallel_world_size() * ps.get_pp_group().world_size
    except Exception:  # noqa: BLE001 - outside an initialised vLLM worker: one rank
        return 1


@cache
def get_backend(name: str | None = None) -> A8W8Backend:
    name = (name or os.environ.get("VLLM_PYPTO_BACKEND", "auto")).strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"VLLM_PYPTO_BACKEND={name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    backend: A8W8Backend = ReferenceBackend()
    if name in ("pypto", "pypto-interpret") or (name == "auto" and ascend_present()):
        backend = _pypto_backend(interpret=name == "pypto-interpret")
    elif name in ("auto", "cpu"):
        why_not = native_cpu_status()
        if why_not is None:
            backend = CpuNativeBackend()
            from .. import _C
            _C.set_amx(os.environ.get("VLLM_PYPTO_CPU_AMX", "1").strip() != "0")
        elif name == "cpu":
            raise RuntimeError(f"VLLM_PYPTO_BACKEND=cpu but {why_not}")
        else:
            logger.warning("pypto-a8w8: native CPU kernels unavailable (%s); using the reference backend", why_not)
    threads, cpus = torch.get_num_threads(), os.cpu_count() or 1
    logger.info("pypto-a8w8: linear layers run on backend=%s (%s); CPU ISA: %s; %d of %d CPUs",
                backend.name, backend.isa(), " ".join(cpu_isa_flags()) or "unknown", threads, cpus)
    if not backend.runs_layers:
        note = thread_note(threads, cpus, _ranks(), os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"))
        if note:
            logger.warning("pypto-a8w8: %s", note)
    return backend
