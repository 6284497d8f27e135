"""Put a real Qwen3 tokenizer beside a checkpoint.

Preferred source: a verified Qwen3 tokenizer folder (QWEN3_TOKENIZER_DIR, or
../shared/qwen3-tokenizer next to the checkout). Otherwise the same vocabulary is
built from the BPE ranks Qwen publishes in the PyPI package `dashscope`
(resources/qwen.tiktoken), with Qwen3's special tokens and chat template from our
package data. There is no toy fallback: if neither source is reachable, it fails.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

DATA = os.path.join(os.path.dirname(__file__), "data")
FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json")
DASHSCOPE = "dashscope==1.24.6"  # a release known to ship resources/qwen.tiktoken
# Qwen2/3 pre-tokenizer: like cl100k but digits split one by one.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def shared_tokenizer_dir() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get("QWEN3_TOKENIZER_DIR"),
                  os.path.join(here, "..", "..", "..", "shared", "qwen3-tokenizer"),
                  os.path.join(os.getcwd(), "..", "shared", "qwen3-tokenizer")]
    for c in candidates:
        if c and os.path.exists(os.path.join(c, "tokenizer.json")):
            return os.path.abspath(c)
    return None


def fetch_qwen_tiktoken(dest: str) -> str:
    """Download dashscope's wheel (no install) and extract qwen.tiktoken."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                    "-d", dest, DASHSCOPE], check=True)
    wheel = glob.glob(os.path.join(dest, "dashscope-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        z.extract("dashscope/resources/qwen.tiktoken", dest)
    return os.path.join(dest, "dashscope", "resources", "qwen.tiktoken")


def build_from_tiktoken(ranks_file: str, out: str) -> None:
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with open(os.path.join(DATA, "qwen3_tokenizer_config.json")) as f:
        cfg = json.load(f)
    specials = [v["content"] for _, v in sorted(cfg["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))]
    tok = TikTokenConverter(vocab_file=ranks_file, pattern=QWEN_PATTERN, extra_special_tokens=specials).converted()
    tok.normalizer = normalizers.NFC()
    first = tok.token_to_id(specials[0])
    if first != 151643:
        raise RuntimeError(f"{ranks_file}: special tokens start at id {first}, expected 151643 (not Qwen's ranks?)")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(out)
    shutil.copyfile(os.path.join(DATA, "qwen3_tokenizer_config.json"), os.path.join(out, "tokenizer_config.json"))


def write_tokenizer(out: str) -> str:
    """Write the tokenizer files into `out`; returns where they came from."""
    src = shared_tokenizer_dir()
    if src:
        for fn in FILES:
            if os.path.exists(os.path.join(src, fn)):
                shutil.copyfile(os.path.join(src, fn), os.path.join(out, fn))
        return src
    with tempfile.TemporaryDirectory() as tmp:
        build_from_tiktoken(fetch_qwen_tiktoken(tmp), out)
    shutil.copyfile(os.path.join(DATA, "qwen3_generation_config.json"), os.path.join(out, "generation_config.json"))
    return f"{DASHSCOPE} qwen.tiktoken"
