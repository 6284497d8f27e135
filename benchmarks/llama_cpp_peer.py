"""The llama.cpp peer: the same random-weight Qwen3 as a Q8_0 GGUF, timed at batch 1
through llama-cpp-python, so serving.py --llama-cpp shows it beside our numbers, twice: in
process (`measure`, no HTTP), and served by llama-cpp-python's OpenAI server (`LlamaCppServer`,
what a user would deploy), which serving.py drives with the same `vllm bench serve` client as ours.

    python benchmarks/llama_cpp_peer.py --checkpoint checkpoints/qwen3-0.6B-w8a8 [--tokens 64]

The GGUF is written straight from our checkpoint folder with the `gguf` package (no F16
intermediate, so 14B fits): each linear is dequantized with its per-channel scale and
requantized to Q8_0 (32-value blocks, fp16 scale); norms stay f32. Tensors are streamed
to the file one at a time. Timing: prefill of --prompt-tokens fixed token ids (TTFT),
then --tokens greedy single-token evals (TPOT = their median), no sampling overhead.

Install: `bash scripts/install_peers.sh` (the `peers` extra's packages; llama-cpp-python builds
llama.cpp from source, without AMX, which GCC builds cannot run here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import sys

import numpy as np
import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_pypto.tools.server import VllmServer  # noqa: E402

# Hugging Face name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.")
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str | None:
    base = hf[: -len(".weight")]
    if base == "model.embed_tokens":
        return "token_embd.weight"
    if base == "model.norm":
        return "output_norm.weight"
    if base == "lm_head":
        return "output.weight"
    if base.startswith("model.layers."):
        i, rest = base[len("model.layers."):].split(".", 1)
        return f"blk.{i}.{LAYER_NAMES[rest]}.weight" if rest in LAYER_NAMES else None
    return None


def _tensors(folder: str):
    """(hf name, loader) for every weight, in file order; a loader returns fp32 numpy."""
    for fn in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        f = safe_open(os.path.join(folder, fn), framework="pt")
        names = set(f.keys())
        for k in sorted(names):
            if not k.endswith(".weight"):
                continue

            def load(f=f, k=k):
                w = f.get_tensor(k)
                scale = k + "_scale"
                if w.dtype == torch.int8:  # compressed-tensors: per-output-channel scale
                    w = w.float() * f.get_tensor(scale).float().reshape(-1, 1)
                return w.float().numpy()
            yield k, f.get_slice(k).get_shape(), load


def write_gguf(folder: str, path: str) -> str:
    import gguf

    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    with open(os.path.join(folder, "tokenizer.json")) as f:
        tok = json.load(f)
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_name(os.path.basename(folder.rstrip("/")))
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(float(c["rope_theta"]))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    # the tokenizer: byte-level BPE with Qwen2's pre-tokenizer, padded to the model's vocab
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"]}
    tokens, types = [], []
    by_id = {i: s for s, i in vocab.items()}
    for i in range(c["vocab_size"]):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.CONTROL if i in special else
                     gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    w.add_add_bos_token(False)

    plan = []
    for hf, shape, load in _tensors(folder):
        name = gguf_name(hf)
        if name is None:
            raise ValueError(f"{folder}: no GGUF name for tensor {hf}")
        if len(shape) == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            byte_shape = gguf.quant_shape_to_byte_shape(tuple(shape), qtype)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
        else:
            qtype = gguf.GGMLQuantizationType.F32
            w.add_tensor_info(name, tuple(shape), np.dtype(np.float32), int(np.prod(shape)) * 4)
        plan.append((load, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for load, qtype in plan:  # one tensor in memory at a time
        x = load()
        w.write_tensor_data(gguf.quants.quantize(x, qtype) if qtype != gguf.GGMLQuantizationType.F32 else x)
    w.close()
    return path


def measure(gguf_path: str, tokens: int = 64, prompt_tokens: int = 128, threads: int | None = None) -> dict:
    """Batch-1 prefill (TTFT) and greedy decode (median per-token eval) through llama-cpp-python."""
    from llama_cpp import Llama

    threads = threads or os.cpu_count()
    llm = Llama(gguf_path, n_ctx=prompt_tokens + tokens + 16, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False, seed=0)
    vocab = llm.n_vocab()

    def greedy() -> int:  # the last position's logits, straight from the context (no sampler)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

    rng = np.random.default_rng(0)
    prompt = rng.integers(1000, 100000, prompt_tokens).tolist()
    t0 = time.perf_counter()
    llm.eval(prompt)
    nxt = greedy()
    ttft = time.perf_counter() - t0
    step = []
    for _ in range(tokens):
        t = time.perf_counter()
        llm.eval([nxt])
        nxt = greedy()
        step.append(time.perf_counter() - t)
    llm.close()
    return {"name": "llama.cpp Q8_0", "tpot_ms": statistics.median(step) * 1e3, "ttft_ms": ttft * 1e3,
            "tokens": tokens, "threads": threads, "gguf_bytes": os.path.getsize(gguf_path)}


def gguf_for(folder: str) -> str:
    """The GGUF beside the checkpoint, written once."""
    path = folder.rstrip("/") + "-q8_0.gguf"
    if not os.path.exists(path):
        t0 = time.time()
        write_gguf(folder, path + ".part")
        os.replace(path + ".part", path)
        print(f"wrote {path} in {time.time() - t0:.0f}s", flush=True)
    return path


def peer(folder: str, tokens: int, prompt_tokens: int) -> dict:
    return measure(gguf_for(folder), tokens, prompt_tokens)


class LlamaCppServer(VllmServer):
    """`python -m llama_cpp.server` on the GGUF, started and stopped like `vllm serve`. It serves
    one request at a time (no batching; the others wait their turn) and has no ignore_eos:
    eog_bias() keeps the random model from stopping early, so every request decodes its
    max_tokens as under --ignore-eos."""
    name, health_path = "llama_cpp.server", "/v1/models"

    def __init__(self, gguf_path: str, n_ctx: int, threads: int | None = None, **kw):
        threads = threads or os.cpu_count()
        super().__init__(gguf_path, "--model_alias", "m", "--n_ctx", str(n_ctx), "--n_threads", str(threads),
                         "--n_threads_batch", str(threads), "--n_batch", "512", "--verbose", "False",
                         # queue concurrent requests instead of cancelling them; and no SSE pings:
                         # a request queued past 15 s got one first and `vllm bench serve` then saw
                         # no data chunk in its stream (30 of 32 failed at concurrency 16)
                         "--interrupt_requests", "False", "--disable_ping_events", "True", **kw)
        self.threads = threads

    def command(self) -> list[str]:
        return [sys.executable, "-c", LENIENT_REQUEST_IDS, "--model", self.model, "--host", "127.0.0.1",
                "--port", str(self.port), *self.args]


# `python -m llama_cpp.server`, except that its request-id middleware (starlette-context's
# RequestIdPlugin) accepts any x-request-id: it answers 400 to every id that is not a UUID, and
# `vllm bench serve` sends "<prefix><n>". Nothing else of the server changes.
LENIENT_REQUEST_IDS = """
import runpy, starlette_context.plugins as p
class RequestIdPlugin(p.RequestIdPlugin):
    def __init__(self, *a, **k):
        super().__init__(*a, **{**k, "validate": False})
p.RequestIdPlugin = RequestIdPlugin
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def eog_bias(folder: str) -> dict:
    """logit_bias that bans the end-of-generation tokens (eos and <|endoftext|>)."""
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    return {"logit_bias": {str(t): -100.0 for t in {c["eos_token_id"], c["bos_token_id"]}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint folder (bf16 or compressed-tensors W8A8)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    a = ap.parse_args()
    print(json.dumps(peer(a.checkpoint, a.tokens, a.prompt_tokens)))


if __name__ == "__main__":
    main()
