"""Which backend serves: VLLM_PYPTO_BACKEND=auto|reference|cpu|pypto|pypto-interpret, once per
process, with one log line that names the backend and the ISA path that runs.

`auto` takes `pypto` where torch_npu is installed (an Ascend stack), else `cpu` where the native
extension is built and the CPU has at least AVX2+FMA, else `reference` with one warning.
`pypto-interpret` runs the PyPTO kernels in pypto's interpreter on a CPU: a correctness tool for
the Ascend path. Backends are imported lazily, so CPU serving never imports pypto or torch_npu.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from . import logger
from .backend import A8W8Backend
from .cpu_backend import CpuNativeBackend, choose_isa, native_cpu_status
from .ref_backend import ReferenceBackend

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
    return [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8") if f in flags]


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), for reports and results files."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def thread_note(threads: int, cpus: int, ranks: int, reserved_env: str | None) -> str | None:
    """A warning when vLLM-CPU left the kernels half the machine or less.

    vLLM-CPU binds each worker rank to the CPUs of its NUMA node minus one per rank, kept for
    its scheduler process; on a small machine that halves the threads the GEMMs stream weights
    with (measured on a 2-CPU VM: docs/performance.md, "CPU threads")."""
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
            choose_isa()
            backend = CpuNativeBackend()
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
