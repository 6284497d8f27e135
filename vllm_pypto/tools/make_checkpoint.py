"""Write a complete random-weight Qwen3 checkpoint folder: config.json, safetensors
(bf16, or compressed-tensors W8A8 as llm-compressor writes it), tokenizer files.

    python -m vllm_pypto.tools.make_checkpoint --shape 0.6B --format w8a8 --out ckpt/qwen3-0.6b-w8a8

Weights are random but shaped like a trained LLM's where quantization cares: a few
input channels of every linear carry outliers, and the RMSNorm gammas amplify a few
hidden channels (the activation outliers that make per-token int8 hard). Every
tensor is drawn from its own seed, so the bf16 and W8A8 folders made with the same
--seed hold the same model (W8A8 = the bf16 weights quantized per channel).
Memory stays bounded by one tensor plus one shard: int8 is written directly, so a
full 14B W8A8 folder is made on a 24 GiB machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import torch
from safetensors.torch import save_file

from ..kernels.reference import quantize_weight_per_channel
from .shapes import SHAPES, VOCAB, Qwen3Shape
from .tokenizer import write_tokenizer

W8A8_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "global_compression_ratio": None,
    "kv_cache_scheme": None,
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "format": "int-quantized",
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                    "dynamic": False, "group_size": None, "block_structure": None, "actorder": None,
                    "observer": "minmax", "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": None, "block_structure": None,
                              "actorder": None, "observer": None, "observer_kwargs": {}},
        "output_activations": None,
    }},
}


class ShardWriter:
    """Collects tensors and writes safetensors shards of at most `max_bytes`."""

    def __init__(self, out: str, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        save_file(self.pending, os.path.join(self.out, f"shard-{len(self.shards)}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> int:
        self.flush()
        n = len(self.shards)
        if n == 1:
            os.replace(os.path.join(self.out, "shard-0.tmp"), os.path.join(self.out, "model.safetensors"))
            return 1
        weight_map, total = {}, 0
        for i, names in enumerate(self.shards):
            fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out, f"shard-{i}.tmp"), os.path.join(self.out, fn))
            total += os.path.getsize(os.path.join(self.out, fn))
            weight_map.update({name: fn for name in names})
        with open(os.path.join(self.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        return n


class RandomQwen3:
    """Deterministic per-tensor random weights with LLM-like outliers."""

    def __init__(self, shape: Qwen3Shape, seed: int, gain: float, outlier_frac: float, norm_outlier: float):
        self.shape, self.seed, self.gain = shape, seed, gain
        self.outlier_frac, self.norm_outlier = outlier_frac, norm_outlier

    def _gen(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)

    def _outliers(self, name: str, n: int) -> torch.Tensor:
        k = max(1, int(n * self.outlier_frac))
        return torch.randperm(n, generator=self._gen(name + "#outliers"))[:k]

    def linear(self, name: str, out: int, inp: int) -> torch.Tensor:
        w = torch.randn(out, inp, generator=self._gen(name)) * (self.gain / inp ** 0.5)
        w[:, self._outliers(name, inp)] *= 6.0
        return w.to(torch.bfloat16)

    def norm(self, name: str, n: int, outliers: bool) -> torch.Tensor:
        g = 1.0 + 0.1 * (torch.rand(n, generator=self._gen(name)) - 0.5)
        if outliers:
            g[self._outliers(name, n)] *= self.norm_outlier
        return g.to(torch.bfloat16)

    def embedding(self, name: str, scale: float) -> torch.Tensor:
        out = torch.empty(VOCAB, self.shape.hidden, dtype=torch.bfloat16)
        gen, step = self._gen(name), 16384  # chunked: never a full fp32 copy of a 14B embedding
        for i in range(0, VOCAB, step):
            rows = min(step, VOCAB - i)
            out[i:i + rows] = (torch.randn(rows, self.shape.hidden, generator=gen) * scale).to(torch.bfloat16)
        return out


def make_checkpoint(out: str, shape_name: str = "tiny", fmt: str = "w8a8", seed: int = 0,
                    scale_dtype: str = "bfloat16", gain: float = 1.0, head_scale: float = 2.0,
                    outlier_frac: float = 0.005, norm_outlier: float = 8.0, max_shard_gb: float = 2.0, layers: int | None = None,
                    tokenizer: bool = True, progress: bool = True, tied: bool | None = None,
                    embed_scale: float = 1.0) -> str:
    if fmt not in ("bf16", "w8a8"):
        raise ValueError(f"--format must be bf16 or w8a8, got {fmt!r}")
    shape = SHAPES[shape_name]
    overrides = {k: v for k, v in (("layers", layers), ("tied", tied)) if v is not None}
    if overrides:
        shape = Qwen3Shape(**{**shape.__dict__, **overrides})
    os.makedirs(out, exist_ok=True)
    rnd = RandomQwen3(shape, seed, gain, outlier_frac, norm_outlier)
    writer = ShardWriter(out, int(max_shard_gb * 2**30))
    sdtype = getattr(torch, scale_dtype)
    h, hd, t0 = shape.hidden, shape.head_dim, time.time()
    q, kv = shape.q_heads * hd, shape.kv_heads * hd

    def log(msg: str) -> None:
        if progress:
            print(f"[make_checkpoint {time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def add_linear(name: str, n: int, k: int) -> None:
        w = rnd.linear(name, n, k)
        if fmt == "bf16":
            writer.add(f"{name}.weight", w)
        else:
            wq, scale = quantize_weight_per_channel(w)
            writer.add(f"{name}.weight", wq)
            writer.add(f"{name}.weight_scale", scale.to(sdtype).unsqueeze(1))

    # embed_scale: the table's std (a tied head's logits scale with it)
    writer.add("model.embed_tokens.weight", rnd.embedding("model.embed_tokens.weight", embed_scale))
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        writer.add(f"{p}.input_layernorm.weight", rnd.norm(f"{p}.input_layernorm.weight", h, True))
        writer.add(f"{p}.post_attention_layernorm.weight", rnd.norm(f"{p}.post_attention_layernorm.weight", h, True))
        writer.add(f"{p}.self_attn.q_norm.weight", rnd.norm(f"{p}.self_attn.q_norm.weight", hd, False))
        writer.add(f"{p}.self_attn.k_norm.weight", rnd.norm(f"{p}.self_attn.k_norm.weight", hd, False))
        for name, n, k in (("self_attn.q_proj", q, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                           ("self_attn.o_proj", h, q), ("mlp.gate_proj", shape.intermediate, h),
                           ("mlp.up_proj", shape.intermediate, h), ("mlp.down_proj", h, shape.intermediate)):
            add_linear(f"{p}.{name}", n, k)
        log(f"layer {i + 1}/{shape.layers}")
    writer.add("model.norm.weight", rnd.norm("model.norm.weight", h, False))
    if not shape.tied:
        writer.add("lm_head.weight", rnd.embedding("lm_head.weight", head_scale / h ** 0.5))
    shards = writer.close()

    config = shape.config_json()
    if fmt == "w8a8":
        config["quantization_config"] = W8A8_QUANTIZATION_CONFIG
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    source = write_tokenizer(out) if tokenizer else "none"
    log(f"wrote {out}: Qwen3 {shape_name} {fmt}, {shards} shard(s), tokenizer from {source}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--format", default="w8a8", choices=("bf16", "w8a8"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="dtype of weight_scale on disk (llm-compressor writes the model dtype)")
    ap.add_argument("--layers", type=int, help="override the number of decoder layers")
    ap.add_argument("--gain", type=float, default=1.0, help="std of linear outputs relative to their input")
    ap.add_argument("--head-scale", type=float, default=2.0, help="logit std of an untied random lm_head")
    ap.add_argument("--norm-outlier", type=float, default=8.0,
                    help="gain of the few outlier hidden channels in the RMSNorm gammas (activation outliers)")
    ap.add_argument("--max-shard-gb", type=float, default=2.0)
    a = ap.parse_args(argv)
    make_checkpoint(a.out, a.shape, a.format, a.seed, a.scale_dtype, a.gain, a.head_scale,
                    norm_outlier=a.norm_outlier, max_shard_gb=a.max_shard_gb, layers=a.layers)


if __name__ == "__main__":
    main()
