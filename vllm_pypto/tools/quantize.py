"""Quantize a Hugging Face Qwen3 bf16 folder into a compressed-tensors W8A8 folder, offline,
with pypto-a8w8's exact numerics (per output channel, scale = max(amax, 1e-4)/127, round half
to even, clamp to [-127, 127]); weight scales in fp32 by default, so serving the result gives
the same bits as quantizing the bf16 folder at load.

    python -m vllm_pypto.tools.quantize SRC DST [--ignore NAME|re:PATTERN ...]

It streams one tensor at a time (peak memory: about one tensor plus one output shard), copies
config, generation config and tokenizer, and validates its quantization_config with
compressed-tensors' own model, so stock vLLM serves the folder too. It refuses, naming the
tensor or file, what it cannot quantize faithfully: another architecture, a folder that is
already quantized, shards the index names but the folder lacks, NaN/inf weights. It writes into
a temporary folder beside DST and renames it at the end: DST is complete or absent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

from ..checkpoint import _DTYPES, CheckpointError, check_architecture, check_checkpoint, linear_shapes, tensor_files
from ..kernels.reference import quantize_weight_per_channel
from ..quant.scheme import _matches
from .make_checkpoint import W8A8_QUANTIZATION_CONFIG, ShardWriter

WEIGHT_FILES = ("model.safetensors.index.json",)


class TensorStream:
    """One tensor at a time by plain reads at the offsets the safetensors header gives, not
    through a memory map: mapped pages of a 30 GB folder would stay resident as the tool walks it."""

    def __init__(self, files: dict[str, str]):
        self.files, self.headers = files, {}

    def _header(self, path: str) -> tuple[int, dict]:
        if path not in self.headers:
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                self.headers[path] = (8 + n, json.loads(f.read(n)))
        return self.headers[path]

    def tensor(self, name: str) -> torch.Tensor:
        path = self.files[name]
        start, header = self._header(path)
        meta = header[name]
        begin, end = meta["data_offsets"]
        buf = bytearray(end - begin)
        with open(path, "rb") as f:
            f.seek(start + begin)
            f.readinto(buf)
        dtype = _DTYPES[meta["dtype"]]
        if not buf:
            return torch.empty(meta["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(meta["shape"])


def _config(src: str) -> dict:
    path = os.path.join(src, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{src}: no config.json (expected a Hugging Face Qwen3 folder)")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method")
        raise CheckpointError(f"{path} already has a quantization_config (quant_method={method!r}); "
                              "quantize the bf16 folder it was made from")
    check_architecture(SimpleNamespace(**cfg))
    return cfg


def quantization_config(ignore: list[str]) -> dict:
    qc = json.loads(json.dumps(W8A8_QUANTIZATION_CONFIG))
    qc["ignore"] = ["lm_head", *[p for p in ignore if p != "lm_head"]]
    from compressed_tensors.quantization import QuantizationConfig

    QuantizationConfig.model_validate(qc)  # what vLLM's compressed-tensors method parses
    return qc


def quantize(src: str, dst: str, ignore: list[str] | None = None, scale_dtype: str = "float32",
             max_shard_gb: float = 2.0, progress: bool = True) -> str:
    ignore = list(ignore or [])
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists; choose a new destination")
    cfg = _config(src)
    hf = SimpleNamespace(**cfg)
    files = tensor_files(src)  # refuses shards the index names but the folder lacks
    check_checkpoint(src, hf, is_int8=lambda module: False)  # every linear a float weight of its shape
    targets = {m for m in linear_shapes(hf) if not any(_matches(p, m) for p in ignore)}
    qc = quantization_config(ignore)
    sdtype = getattr(torch, scale_dtype)
    t0, done, total = time.time(), 0, len(files)
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.partial-", dir=parent)
    try:
        writer, reader = ShardWriter(tmp, int(max_shard_gb * 2**30)), TensorStream(files)
        for name in files:  # the index's order (or the file's), so shards split as the source's did
            t = reader.tensor(name)
            module = name.removesuffix(".weight")
            if module in targets:
                bad = ~torch.isfinite(t)
                if bad.any():
                    n, k = (int(i) for i in bad.nonzero()[0])
                    raise CheckpointError(f"tensor '{name}' has {int(bad.sum())} non-finite value(s) (first at "
                                          f"[{n}, {k}] = {t[n, k].item()}); a scale cannot represent them")
                q, scale = quantize_weight_per_channel(t)
                writer.add(name, q)
                writer.add(f"{module}.weight_scale", scale.to(sdtype).unsqueeze(1))
            else:
                writer.add(name, t)
            del t
            done += 1
            if progress and (done % 50 == 0 or done == total):
                print(f"[quantize {time.time() - t0:6.1f}s] {done}/{total} tensors", file=sys.stderr, flush=True)
        shards = writer.close()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**cfg, "quantization_config": qc}, f, indent=2)
        for fn in sorted(os.listdir(src)):  # tokenizer, generation config, chat template, licence...
            path = os.path.join(src, fn)
            if os.path.isfile(path) and not fn.endswith(".safetensors") and fn not in (*WEIGHT_FILES, "config.json"):
                shutil.copy2(path, os.path.join(tmp, fn))
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(f"[quantize {time.time() - t0:6.1f}s] wrote {dst}: {len(targets)} int8 linears, {shards} shard(s)",
              file=sys.stderr, flush=True)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a Hugging Face Qwen3 bf16 folder (single file or sharded with an index)")
    ap.add_argument("dst", help="the W8A8 folder to write (must not exist)")
    ap.add_argument("--ignore", action="append", default=[], metavar="NAME|re:PATTERN",
                    help="linear modules to keep in bf16 (compressed-tensors' ignore syntax); repeatable")
    ap.add_argument("--scale-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="weight_scale dtype on disk; float32 gives quantize-at-load's exact scales")
    ap.add_argument("--max-shard-gb", type=float, default=2.0)
    a = ap.parse_args(argv)
    try:
        quantize(a.src, a.dst, a.ignore, a.scale_dtype, a.max_shard_gb)
    except (CheckpointError, FileExistsError) as e:
        print(f"quantize: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
