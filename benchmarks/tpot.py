"""Batch-1 TTFT/TPOT of `vllm serve` configurations on one random-weight Qwen3 shape,
measured side by side in one run (the foundation's check; benchmarks/serving.py-style
sweeps with `vllm bench serve` build on the same pieces).

    python benchmarks/tpot.py --shape 0.6B --configs bf16,pypto-a8w8,pypto-a8w8:w8a8

A config is `bf16` (stock vLLM, no quantization, on the bf16 folder), `pypto-a8w8` (ours,
quantizing the bf16 folder at load), `pypto-a8w8:w8a8` (ours on the compressed-tensors
folder) or `ct:w8a8` (vLLM-CPU's own compressed-tensors W8A8 path on that folder). A suffix
`@reference` or `@cpu` picks our kernel backend (VLLM_PYPTO_BACKEND); `+noamx` keeps the cpu
backend on VNNI for every M (VLLM_PYPTO_CPU_AMX=0). `--prompt-words N` makes the prompt long,
so TTFT measures a prefill of ~N tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_pypto.demo import chat_once  # noqa: E402
from vllm_pypto.tools.make_checkpoint import make_checkpoint  # noqa: E402
from vllm_pypto.tools.server import VllmServer  # noqa: E402


def checkpoint(root: str, shape: str, fmt: str) -> str:
    path = os.path.join(root, f"qwen3-{shape}-{fmt}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_checkpoint(path, shape, fmt)
    return path


def run_config(cfg: str, root: str, shape: str, requests: int, max_tokens: int, prompt: str) -> dict:
    noamx = cfg.endswith("+noamx")
    spec, _, backend = cfg.removesuffix("+noamx").partition("@")
    method, _, fmt = spec.partition(":")
    fmt = fmt or "bf16"
    # no prefix caching: every request repeats the prompt, and TTFT must measure the prefill
    args = ["--max-model-len", "2048", "--served-model-name", "m", "--no-enable-prefix-caching"]
    if method == "pypto-a8w8":
        args += ["--quantization", "pypto-a8w8"]
    elif method not in ("bf16", "ct"):
        raise SystemExit(f"unknown config {cfg!r}")
    model = checkpoint(root, shape, fmt)
    t0 = time.time()
    env = {**({"VLLM_PYPTO_BACKEND": backend} if backend else {}), **({"VLLM_PYPTO_CPU_AMX": "0"} if noamx else {})}
    with VllmServer(model, *args, env=env) as s:
        start = time.time() - t0
        chat_once(s.url, "m", "warm up", 8)
        runs = [chat_once(s.url, "m", prompt, max_tokens) for _ in range(requests)]
    tpot = [r["tpot_s"] * 1000 for r in runs]
    ttft = [r["ttft_s"] * 1000 for r in runs]
    row = {"config": cfg, "shape": shape, "startup_s": round(start, 1), "tpot_ms_median": statistics.median(tpot),
           "tpot_ms": tpot, "ttft_ms_median": statistics.median(ttft), "tokens": runs[0]["tokens"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.6B")
    ap.add_argument("--configs", default="bf16,pypto-a8w8")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--checkpoints", default="checkpoints")
    ap.add_argument("--prompt-words", type=int, default=0, help="0: the short chat prompt 介绍一下北京故宫")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    prompt = " ".join(["介绍一下北京故宫"] + ["the palace museum in beijing"] * (a.prompt_words // 5))
    rows = [run_config(c, a.checkpoints, a.shape, a.requests, a.max_tokens, prompt) for c in a.configs.split(",")]
    os.makedirs(a.out, exist_ok=True)
    stamp = f"{time.strftime('%Y-%m-%d')}-{platform.node() or 'machine'}-tpot-{a.shape}" + (
        f"-prompt{a.prompt_words}" if a.prompt_words else "")
    with open(os.path.join(a.out, stamp + ".json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "prompt_words": a.prompt_words,
                   "rows": rows}, f, indent=1)
    base = rows[0]["tpot_ms_median"]
    print(f"\n| config | shape | TPOT ms (median of {a.requests}) | TTFT ms | TPOT vs {rows[0]['config']} |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['config']} | {r['shape']} | {r['tpot_ms_median']:.1f} | {r['ttft_ms_median']:.0f} | "
              f"{r['tpot_ms_median'] / base:.2f}x |")


if __name__ == "__main__":
    main()
