"""The PyPTO backend: our kernels (kernels.py) behind the A8W8Backend interface, run on an
Ascend NPU (torch_npu importable). Selected with VLLM_PYPTO_BACKEND=pypto; `auto` takes it
only where torch_npu imports. Never imported on a CPU serving path.
"""

from __future__ import annotations

import torch

from .. import A8W8Backend


def npu_status() -> str | None:
    """None where the PyPTO backend can run, else why not."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return "torch_npu is not installed (no Ascend NPU stack)"
    try:
        import pypto  # noqa: F401
    except ImportError as e:
        return f"pypto is not installed ({e}); pip install 'vllm-pypto[ascend]'"
    if not torch.npu.is_available():
        return "torch_npu finds no NPU"
    return None


class PyptoBackend(A8W8Backend):
    name = "pypto"

    def __init__(self):
        import pypto

        self.run_mode = pypto.RunMode.NPU

    def isa(self) -> str:
        return "PyPTO kernels (pypto 0.2.0) on Ascend AICore: per-token quant, int8 cube GEMM, fp32 dequant"

    def prepack(self, weight, weight_scale):
        return {"weight": weight.contiguous(), "weight_scale": weight_scale.float().reshape(1, -1).contiguous()}

    def unpacked(self, packed):
        return packed["weight"], packed["weight_scale"].reshape(-1)

    def linear(self, x, packed):
        from . import kernels

        w, ws = packed["weight"], packed["weight_scale"]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        kernel = kernels.a8w8_linear(x2.shape[0], x2.shape[1], w.shape[0], self.run_mode)
        out = x2.new_empty(x2.shape[0], w.shape[0])
        kernel(x2, w, ws, out)
        return out.reshape(*x.shape[:-1], w.shape[0])

    def gemm_int32(self, x, amax, packed):
        raise NotImplementedError("tensor-parallel int32 partial sums are not implemented for the PyPTO backend")
