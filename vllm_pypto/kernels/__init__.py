"""Kernel backends behind one small interface (backend.py); the numerics contract is
reference.py (layer_ref.py for the fused ops).

- ref_backend.py: `reference`, torch, always there, the golden numerics;
- cpu_backend.py: `cpu`, our native x86-64 kernels (csrc/), one ISA path chosen by CPU feature;
- ascend/: `pypto` (Ascend NPUs) and `pypto-interpret` (the same kernels in pypto's interpreter);
- select.py: which one serves (VLLM_PYPTO_BACKEND, default auto) and the log line saying so.
"""

from __future__ import annotations

import logging

# A child of "vllm" so our lines use vLLM's log format and level.
logger = logging.getLogger("vllm.pypto")

from . import ops, reference  # noqa: E402,F401  registers torch.ops.pypto.* and the native ops' fake impls
from .backend import A8W8Backend  # noqa: E402
from .cpu_backend import CpuNativeBackend, native_cpu_status  # noqa: E402
from .ref_backend import ReferenceBackend  # noqa: E402
from .select import BACKENDS, cpu_isa_flags, get_backend, thread_note  # noqa: E402

__all__ = ["A8W8Backend", "BACKENDS", "CpuNativeBackend", "ReferenceBackend", "cpu_isa_flags", "get_backend",
           "logger", "native_cpu_status", "thread_note"]
