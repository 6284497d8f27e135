"""The torch reference backend: the golden numerics (reference.py), always available."""

from __future__ import annotations

import torch

from . import reference
from .backend import A8W8Backend


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
