"""Checkpoint preflight: read safetensors headers (and the small scale tensors) and
check every Qwen3 linear against what pypto-a8w8 will load, before vLLM allocates
anything. Errors name the tensor and say what was expected.

vLLM's own loader skips its missing-weight check whenever a quantization method is
set, and `copy_` would silently cast a float weight into an int8 parameter; this
check is what turns those cases into clear messages.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from safetensors import safe_open

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Tensors that mean "a scheme we do not implement" when present beside a weight.
FOREIGN_SUFFIXES = {"weight_zero_point": "a weight zero point (asymmetric weights)",
                    "input_scale": "a static activation scale",
                    "input_zero_point": "an activation zero point",
                    "weight_packed": "packed int4 weights",
                    "weight_g_idx": "group-wise weights with activation order"}


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64,
           "F8_E4M3": torch.float8_e4m3fn, "BOOL": torch.bool}


class CheckpointError(ValueError):
    pass


def check_architecture(hf_config: Any) -> None:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise CheckpointError(
            f"pypto-a8w8 serves dense Qwen3 checkpoints ({', '.join(SUPPORTED_ARCHITECTURES)}); "
            f"this checkpoint's config.json has architectures={archs} "
            f"(model_type={getattr(hf_config, 'model_type', None)!r}).")


def linear_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Checkpoint module name -> [out, in] for every linear of a Qwen3 decoder."""
    h = hf_config.hidden_size
    hd = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * hd, hf_config.num_key_value_heads * hd
    inter = hf_config.intermediate_size
    per_layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                 "mlp.down_proj": (h, inter)}
    return {f"model.layers.{i}.{name}": shape
            for i in range(hf_config.num_hidden_layers) for name, shape in per_layer.items()}


def tensor_files(folder: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index when sharded."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        missing = sorted({v for v in weight_map.values() if not os.path.exists(os.path.join(folder, v))})
        if missing:
            raise CheckpointError(f"{index} names shard files that are not in {folder}: {missing}")
        return {k: os.path.join(folder, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    out: dict[str, str] = {}
    for fn in files:
        with safe_open(os.path.join(folder, fn), framework="pt") as f:
            out.update({k: os.path.join(folder, fn) for k in f.keys()})
    return out


class _Reader:
    """Lazy header access over many shard files, keeping each file open once."""

    def __init__(self, files: dict[str, str]):
        self.files, self._open = files, {}

    def _f(self, name):
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        sl = self._f(name).get_slice(name)
        # Unknown safetensors dtypes (F8_E5M2, U16, ...) are reported by their raw name.
        return _DTYPES.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self._f(name).get_tensor(name)


def check_checkpoint(folder: str, hf_config: Any, is_int8: Callable[[str], bool]) -> dict[str, int]:
    """Validate every Qwen3 linear (and the bf16 embeddings / lm_head) of `folder`.

    `is_int8(module_name)` says whether the module must be stored as int8 + weight_scale
    (compressed-tensors W8A8) or as a float weight (quantized at load, or kept bf16).
    Returns counts of int8 and float linears for the log line.
    """
    check_architecture(hf_config)
    reader = _Reader(tensor_files(folder))
    names = reader.files
    counts = {"int8": 0, "float": 0}

    def need(name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if name not in names:
            raise CheckpointError(f"{folder}: tensor '{name}' is missing from the checkpoint")
        return reader.meta(name)

    for module, (out, inp) in linear_shapes(hf_config).items():
        for suffix, what in FOREIGN_SUFFIXES.items():
            if f"{module}.{suffix}" in names:
                raise CheckpointError(f"tensor '{module}.{suffix}' is {what}, which pypto-a8w8 does not implement")
        wname, sname = f"{module}.weight", f"{module}.weight_scale"
        dtype, shape = need(wname)
        if shape != (out, inp):
            raise CheckpointError(f"tensor '{wname}' has shape {list(shape)}, expected [{out}, {inp}] from config.json")
        if is_int8(module):
            counts["int8"] += 1
            if dtype != torch.int8:
                raise CheckpointError(f"tensor '{wname}' has dtype {dtype}, expected torch.int8 "
                                      "(compressed-tensors W8A8 stores int8 weights)")
            sdtype, sshape = need(sname)
            if sdtype not in SCALE_DTYPES:
                raise CheckpointError(f"tensor '{sname}' has dtype {sdtype}, expected float32, bfloat16 or float16")
            if sshape not in ((out, 1), (out,)):
                raise CheckpointError(f"tensor '{sname}' has shape {list(sshape)}, expected [{out}, 1] "
                                      "(one scale per output channel)")
            scale = reader.tensor(sname).float().flatten()
            bad = (~torch.isfinite(scale)) | (scale <= 0)
            if bad.any():
                i = int(bad.nonzero()[0, 0])
                raise CheckpointError(f"tensor '{sname}' has {int(bad.sum())} scale(s) that are not finite and "
                                      f"positive (first: channel {i} = {scale[i].item()})")
        else:
            counts["float"] += 1
            if dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"tensor '{wname}' has dtype {dtype}, expected a float weight "
                                      "(bfloat16/float16/float32); the checkpoint's quantization_config "
                                      "does not mark this layer as quantized")
    heads = ["model.embed_tokens.weight"]
    if not getattr(hf_config, "tie_word_embeddings", False):
        heads.append("lm_head.weight")
    for name in heads:
        dtype, shape = need(name)
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor '{name}' has dtype {dtype}; embeddings and lm_head must stay "
                                  "float (bf16) under pypto-a8w8")
        if shape != (hf_config.vocab_size, hf_config.hidden_size):
            raise CheckpointError(f"tensor '{name}' has shape {list(shape)}, expected "
                                  f"[{hf_config.vocab_size}, {hf_config.hidden_size}]")
    return counts
