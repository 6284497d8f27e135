"""The A8W8 linear method: what vLLM's Linear layers (qkv, o, gate_up, down, in every
tensor-parallel flavour) hold and run under pypto-a8w8.

Parameters use vLLM's own parameter classes, so packed modules (qkv_proj,
gate_up_proj) and tensor parallelism load by vLLM's rules: column-parallel layers
split weight and weight_scale by output channel, row-parallel ones split the weight
by input channel and keep every scale.

A bf16 checkpoint is quantized as its tensors arrive: the layer holds int8 parameters from the
start, and the loader quantizes each checkpoint tensor (one q/k/v or gate/up shard, whole K)
before vLLM slices it for this rank. So loading peaks at the int8 model plus about one bf16
tensor, never the bf16 model, and a row-parallel shard's channel amax still covers all of K.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import Parameter

from vllm.model_executor.layers.linear import (LinearMethodBase, RowParallelLinear,
                                               register_weight_loader_v2_supported_method)
from vllm.model_executor.parameter import ChannelQuantScaleParameter, ModelWeightParameter

from ..checkpoint import FLOAT_DTYPES, SCALE_DTYPES, CheckpointError
from ..kernels import get_backend, logger
from ..kernels.reference import quantize_weight_per_channel
from . import tp


@register_weight_loader_v2_supported_method
class PyptoA8W8LinearMethod(LinearMethodBase):
    """source_int8: the checkpoint stores int8 + weight_scale (else a float weight,
    quantized here at load). run_bf16: keep or dequantize to bf16 and use F.linear
    (the named upstream-comparison option, flag bf16_down_proj)."""

    def __init__(self, prefix: str, source_int8: bool, run_bf16: bool = False):
        self.prefix, self.source_int8, self.run_bf16 = prefix, source_int8, run_bf16
        self.backend = None if run_bf16 else get_backend()
        # int8 parameters whatever the checkpoint holds, unless the layer runs bf16
        self.holds_int8 = source_int8 or not run_bf16

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        loader = self._checked_loader(layer, extra_weight_attrs["weight_loader"])
        rows = sum(output_partition_sizes)
        layer.logical_widths = output_partition_sizes
        layer._pypto_loaded = {"weight": set(), "weight_scale": set()}
        wdtype = torch.int8 if self.holds_int8 else params_dtype
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(rows, input_size_per_partition, dtype=wdtype),
            input_dim=1, output_dim=0, weight_loader=loader))
        if self.holds_int8:
            layer.register_parameter("weight_scale", ChannelQuantScaleParameter(
                data=torch.empty(rows, 1, dtype=torch.float32), output_dim=0, weight_loader=loader))

    def _checked_loader(self, layer, inner):
        """vLLM's loader, plus the dtype check and a message naming the tensor."""
        def load(param, loaded_weight, *args, **kwargs):
            pname = "weight_scale" if param is getattr(layer, "weight_scale", None) else "weight"
            shard = args[0] if args else kwargs.get("loaded_shard_id")
            where = f"{self.prefix}.{pname}" + (f" (shard {shard})" if shard is not None else "")
            allowed = SCALE_DTYPES if pname == "weight_scale" else (
                (torch.int8,) if self.source_int8 else FLOAT_DTYPES)
            if loaded_weight.dtype not in allowed:
                raise CheckpointError(f"{where}: checkpoint tensor has dtype {loaded_weight.dtype}, "
                                      f"expected one of {[str(d) for d in allowed]}")
            if pname == "weight_scale" and loaded_weight.dim() == 1:
                loaded_weight = loaded_weight.unsqueeze(1)  # [out] on disk is fine too
            tensors = [(param, loaded_weight, pname)]
            if pname == "weight" and self.holds_int8 and not self.source_int8:
                try:  # the whole checkpoint tensor, before vLLM narrows it to this rank's slice
                    q, scale = quantize_weight_per_channel(loaded_weight)
                except ValueError as e:
                    raise CheckpointError(f"{where}: {e}") from e
                tensors = [(param, q, "weight"), (layer.weight_scale, scale.unsqueeze(1), "weight_scale")]
                del loaded_weight
            for p, t, name in tensors:
                try:
                    inner(p, t, *args, **kwargs)
                except AssertionError as e:
                    raise CheckpointError(f"{where}: checkpoint tensor of shape {list(t.shape)} does "
                                          f"not fit the parameter of shape {list(p.shape)}") from e
                layer._pypto_loaded[name].add(shard)
        return load

    def _check_loaded(self, layer, pname: str) -> None:
        loaded = layer._pypto_loaded[pname]
        if None in loaded or len(loaded) >= len(layer.logical_widths):
            return
        raise CheckpointError(f"{self.prefix}.{pname}: the checkpoint did not provide it "
                              f"(loaded shards: {sorted(map(str, loaded)) or 'none'})")

    def process_weights_after_loading(self, layer) -> None:
        self._check_loaded(layer, "weight")
        weight = layer.weight.data
        # Row-parallel shards hold a slice of K: scales and sums need all ranks (quant/tp.py).
        tp_row = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
        if self.holds_int8:
            self._check_loaded(layer, "weight_scale")
            scale = layer.weight_scale.data.view(-1)
            bad = ~torch.isfinite(scale) | (scale <= 0)
            if bad.any():
                raise CheckpointError(f"{self.prefix}.weight_scale: {int(bad.sum())} scale(s) are not finite "
                                      f"and positive (first at channel {int(bad.nonzero()[0, 0])})")
            del layer.weight_scale
        if self.run_bf16:
            bf16 = (weight.float() * scale.unsqueeze(1)) if self.source_int8 else weight
            layer.weight = Parameter(bf16.to(torch.bfloat16), requires_grad=False)
            layer._pypto_packed = None
            return
        if getattr(layer, "tp_size", 1) > 1 and ".layers.0." in self.prefix:  # shards, not copies
            logger.info("pypto-a8w8: %s holds weight [%d, %d] and %d scales of [%d, %d] on TP rank %d/%d",
                        self.prefix, *weight.shape, scale.numel(), layer.output_size, layer.input_size,
                        layer.tp_rank, layer.tp_size)
        del layer.weight
        packed = self.backend.prepack(weight, scale)
        for name, tensor in packed.items():
            layer.register_parameter(name, Parameter(tensor, requires_grad=False))
        layer._pypto_packed = tuple(packed)
        layer._pypto_tp_reduce = None
        if tp_row:  # we reduce exact int32 sums ourselves, so vLLM's bf16 all-reduce goes
            layer._pypto_tp_reduce, layer.reduce_results = layer.reduce_results, False

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer._pypto_packed is None:
            out = F.linear(x, layer.weight)
        elif layer._pypto_tp_reduce is not None:
            out = tp.row_parallel_linear(x, {n: getattr(layer, n) for n in layer._pypto_packed},
                                         reduce=layer._pypto_tp_reduce)
            if layer._pypto_tp_reduce and not layer.skip_bias_add:
                bias = layer.bias  # vLLM hands the bias to rank 0 only; every rank holds the sum now
        else:
            out = self.backend.linear(x, {n: getattr(layer, n) for n in layer._pypto_packed})
        return out if bias is None else out + bias
