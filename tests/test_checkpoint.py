"""The checkpoint tool's folders, and the preflight that turns a malformed checkpoint into
a message naming the tensor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from vllm_pypto.checkpoint import CheckpointError, check_checkpoint
from vllm_pypto.kernels.reference import quantize_weight_per_channel
from vllm_pypto.quant.scheme import W8A8Scheme
from vllm_pypto.tools.make_checkpoint import make_checkpoint
from vllm_pypto.tools.tokenizer import shared_tokenizer_dir

NIHAO_CHAT_IDS = [151644, 872, 198, 108386, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]


def _tensors(folder):
    out = {}
    for fn in os.listdir(folder):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, fn)))
    return out


def test_w8a8_folder_is_complete(tiny_w8a8):
    cfg = json.load(open(os.path.join(tiny_w8a8, "config.json")))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    t = _tensors(tiny_w8a8)
    w, s = t["model.layers.1.mlp.down_proj.weight"], t["model.layers.1.mlp.down_proj.weight_scale"]
    assert w.dtype == torch.int8 and w.shape == (256, 768) and w.abs().max() == 127 and w.min() >= -127
    assert s.dtype == torch.bfloat16 and s.shape == (256, 1)
    assert t["lm_head.weight"].dtype == torch.bfloat16 and t["model.embed_tokens.weight"].shape == (151936, 256)
    assert check_checkpoint(tiny_w8a8, AutoConfig.from_pretrained(tiny_w8a8),
                            W8A8Scheme.from_compressed_tensors(cfg["quantization_config"]).is_quantized) == \
        {"int8": 14, "float": 0}


def test_outlier_channels_are_present(tiny_bf16):
    t = _tensors(tiny_bf16)
    col = t["model.layers.0.self_attn.q_proj.weight"].float().abs().mean(0)
    assert col.max() > 4 * col.median()  # a few input channels carry outliers
    g = t["model.layers.0.input_layernorm.weight"].float()
    assert g.max() > 5 * g.median()


def test_same_seed_means_same_model(tiny_bf16, tmp_path):
    """W8A8 written with fp32 scales is exactly the bf16 folder quantized per channel."""
    out = make_checkpoint(str(tmp_path / "fp32s"), "tiny", "w8a8", seed=0, scale_dtype="float32",
                          tokenizer=False, progress=False)
    a, b = _tensors(tiny_bf16), _tensors(out)
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.gate_proj"):
        q, s = quantize_weight_per_channel(a[name + ".weight"])
        assert torch.equal(q, b[name + ".weight"]) and torch.equal(s, b[name + ".weight_scale"][:, 0])
    assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])


def test_sharded_output_has_index(tmp_path):
    out = make_checkpoint(str(tmp_path / "sh"), "tiny", "w8a8", max_shard_gb=0.05, tokenizer=False, progress=False)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = set(index["weight_map"].values())
    assert len(files) >= 3 and all(os.path.exists(os.path.join(out, f)) for f in files)
    assert index["weight_map"]["model.layers.1.mlp.up_proj.weight_scale"] in files
    cfg = AutoConfig.from_pretrained(out)
    assert check_checkpoint(out, cfg, lambda m: True)["int8"] == 14


def test_tokenizer_is_real_qwen3(tiny_w8a8):
    tok = AutoTokenizer.from_pretrained(tiny_w8a8)
    ids = tok.apply_chat_template([{"role": "user", "content": "你好"}], add_generation_prompt=True,
                                  enable_thinking=False, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == NIHAO_CHAT_IDS
    assert tok.decode(tok.encode("介绍一下北京故宫")) == "介绍一下北京故宫"


def test_tokenizer_built_from_dashscope_matches(tmp_path):
    """Without ../shared the tool builds the vocabulary from dashscope's qwen.tiktoken."""
    from vllm_pypto.tools import tokenizer as T

    out = tmp_path / "tok"
    out.mkdir()
    T.build_from_tiktoken(T.fetch_qwen_tiktoken(str(tmp_path / "dl")), str(out))
    built = AutoTokenizer.from_pretrained(out)
    texts = ["介绍一下北京故宫", "The capital of France is", "  leading spaces\n\nand 12345 digits",
             "emoji 🥰 and mixed 中英文 text's", "def f(x):\n\treturn x**2"]
    ids = built.apply_chat_template([{"role": "user", "content": "你好"}], add_generation_prompt=True,
                                    enable_thinking=False, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert list(ids) == NIHAO_CHAT_IDS
    shared = shared_tokenizer_dir()
    if shared:  # where the verified folder exists, the two must agree token for token
        ref = AutoTokenizer.from_pretrained(shared)
        for t in texts:
            assert built.encode(t) == ref.encode(t), t
    for t in texts:
        assert built.decode(built.encode(t)) == t


# ---- preflight: malformed checkpoints ------------------------------------------------

def _broken_copy(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    edit(t)
    save_file(t, path, metadata={"format": "pt"})
    return dst


def _preflight(folder: str):
    cfg = AutoConfig.from_pretrained(folder)
    qc = getattr(cfg, "quantization_config", None)
    is_int8 = W8A8Scheme.from_compressed_tensors(qc).is_quantized if qc else (lambda m: False)
    return check_checkpoint(folder, cfg, is_int8)


L0 = "model.layers.0.self_attn.k_proj"


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop(f"{L0}.weight_scale"), f"'{L0}.weight_scale' is missing"),
    (lambda t: t.update({f"{L0}.weight": t[f"{L0}.weight"].to(torch.float16)}),
     f"'{L0}.weight' has dtype torch.float16, expected torch.int8"),
    (lambda t: t.update({f"{L0}.weight_scale": t[f"{L0}.weight_scale"].to(torch.int32)}),
     f"'{L0}.weight_scale' has dtype torch.int32"),
    (lambda t: t.update({f"{L0}.weight": t[f"{L0}.weight"][:, :100].contiguous()}),
     f"'{L0}.weight' has shape [256, 100], expected [256, 256]"),
    (lambda t: t.update({f"{L0}.weight_scale": t[f"{L0}.weight_scale"][:7].contiguous()}),
     f"'{L0}.weight_scale' has shape [7, 1], expected [256, 1]"),
    (lambda t: t[f"{L0}.weight_scale"].__setitem__((5, 0), float("nan")),
     f"'{L0}.weight_scale' has 1 scale(s) that are not finite and positive (first: channel 5 = nan)"),
    (lambda t: t[f"{L0}.weight_scale"].__setitem__((9, 0), 0.0),
     f"'{L0}.weight_scale' has 1 scale(s) that are not finite and positive (first: channel 9 = 0.0)"),
    (lambda t: t.update({f"{L0}.weight_zero_point": torch.zeros(256, 1, dtype=torch.int8)}),
     "weight zero point"),
    (lambda t: t.update({f"{L0}.input_scale": torch.ones(1)}), "static activation scale"),
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(torch.int8)}), "'lm_head.weight' has dtype torch.int8"),
])
def test_malformed_w8a8_checkpoints_name_the_tensor(tiny_w8a8, tmp_path, edit, needle):
    bad = _broken_copy(tiny_w8a8, str(tmp_path / "bad"), edit)
    with pytest.raises(CheckpointError) as e:
        _preflight(bad)
    assert needle in str(e.value)


def test_int8_tensor_in_bf16_checkpoint_is_refused(tiny_bf16, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    bad = _broken_copy(tiny_bf16, str(tmp_path / "bad"), lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(CheckpointError, match=f"'{name}' has dtype torch.int8, expected a float weight"):
        _preflight(bad)


def test_non_qwen3_architecture_is_refused(tiny_bf16, tmp_path):
    bad = str(tmp_path / "llama")
    shutil.copytree(tiny_bf16, bad)
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"dense Qwen3.*architectures=\['LlamaForCausalLM'\]"):
        _preflight(bad)


def test_serve_refuses_broken_checkpoint_with_the_message(tiny_w8a8, tmp_path):
    """End to end: `vllm serve` exits (no hang, no traceback-only crash) and says which tensor."""
    bad = _broken_copy(tiny_w8a8, str(tmp_path / "bad"), lambda t: t.pop(f"{L0}.weight_scale"))
    from vllm_pypto.tools.server import vllm_command

    r = subprocess.run([vllm_command(), "serve", bad, "--quantization", "pypto-a8w8", "--port", "0"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert r.returncode != 0
    assert f"tensor '{L0}.weight_scale' is missing from the checkpoint" in r.stdout + r.stderr


def test_serve_refuses_unsupported_scheme(tiny_w8a8, tmp_path):
    bad = str(tmp_path / "fp8")
    shutil.copytree(tiny_w8a8, bad)
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float"
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    r = subprocess.run([sys.executable, "-m", "vllm_pypto.tools.generate", "--model", bad, "--quantization",
                        "pypto-a8w8", "--prompt", "hi", "--max-tokens", "2"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert r.returncode != 0
    assert "quantization_config.config_groups.group_0.weights.type = 'float' is not supported" in r.stderr
