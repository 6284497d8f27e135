"""Row-parallel A8W8 layers under tensor parallelism, computed so TP=N gives the same bits
as TP=1.

A row-parallel layer (o_proj, down_proj) sees only its rank's slice of the input
channels. Two things in the spec are defined over the whole row, not a slice:
- the activation scale: per token amax over all K. Each rank takes its slice's amax and
  the ranks all-reduce MAX (a NaN/inf slice counts as +inf, so the whole row is marked);
- the sum: int32 partial sums are all-reduced (exact, order-free), then the fp32 epilogue
  runs once, as at TP=1. Reducing bf16 outputs instead, as vLLM does for float layers,
  would round twice and, with per-slice scales, changed 15 of 16 greedy test outputs.
For bf16 checkpoints quantized at load, the per-channel weight scale is also a max over
all K: quant/linear.py quantizes each checkpoint tensor whole, before vLLM slices it.

The collectives run inside one opaque custom op so vLLM's torch.compile does not trace them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm.distributed import get_tp_group
from vllm.utils.torch_utils import direct_register_custom_op

from ..kernels import get_backend
from ..kernels.ops import pypto_lib
from ..kernels.reference import AMAX_FLOOR, activation_scale, dequant_epilogue, row_amax


def _group(t: torch.Tensor):
    tp = get_tp_group()
    return tp.cpu_group if t.device.type == "cpu" else tp.device_group


def _row_parallel(x: torch.Tensor, packed: list[torch.Tensor], names: str, n: int,
                  reduce: bool) -> torch.Tensor:
    group = _group(x)
    x2 = x.reshape(-1, x.shape[-1])
    amax = row_amax(x2)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    amax = amax.clamp_min(AMAX_FLOOR)
    tensors = dict(zip(names.split(","), packed))
    acc = get_backend().gemm_int32(x2.contiguous(), amax, tensors)
    if reduce:
        dist.all_reduce(acc, group=group)
    return dequant_epilogue(acc, tensors["weight_scale"], activation_scale(amax), x.dtype).reshape(*x.shape[:-1], n)


def _row_parallel_fake(x, packed, names, n, reduce):
    return x.new_empty(*x.shape[:-1], n)


direct_register_custom_op("a8w8_row_parallel", _row_parallel, fake_impl=_row_parallel_fake,
                          target_lib=pypto_lib)


def row_parallel_linear(x: torch.Tensor, packed: dict[str, torch.Tensor], reduce: bool) -> torch.Tensor:
    """reduce: return the full output on every rank (the layer's own all-reduce is turned
    off); else this rank's partial output, for callers that reduce themselves."""
    return torch.ops.pypto.a8w8_row_parallel(x, list(packed.values()), ",".join(packed), packed["weight_scale"].numel(),
                                             reduce)
