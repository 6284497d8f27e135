"""Greedy offline generation through vLLM's LLM engine, written as JSON: the tool the
golden and quality checks use to collect outputs of one configuration in one engine.

    python -m vllm_pypto.tools.generate --model DIR --quantization pypto-a8w8 \
        --prompt 介绍一下北京故宫 --prompt "The capital of France is" --max-tokens 48 --out out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def score(llm, items: list[dict]) -> list[list[dict]]:
    """Teacher forcing inside the engine: for each {prompt_token_ids, token_ids}, the rank and
    logprob this engine gives each continuation token (vLLM prompt_logprobs)."""
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=it["prompt_token_ids"] + it["token_ids"]) for it in items], sp)
    scored = []
    for it, o in zip(items, outs):
        steps = o.prompt_logprobs[len(it["prompt_token_ids"]):]
        scored.append([{"rank": s[t].rank, "logprob": s[t].logprob} for s, t in zip(steps, it["token_ids"])])
    return scored


def generate(model: str, prompts: list[str], max_tokens: int, quantization: str | None = None,
             logprobs: int = 2, chat: bool = False, max_model_len: int = 1024, score_items: list[dict] | None = None,
             **engine_kwargs) -> dict:
    """Returns {"results": [...per prompt...], "scored": [...] (if score_items), "startup_s": float}."""
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model, quantization=quantization, dtype="bfloat16", max_model_len=max_model_len,
              seed=0, **engine_kwargs)
    startup = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp,
                        chat_template_kwargs={"enable_thinking": False})
    else:
        outs = llm.generate(prompts, sp)
    results = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        results.append({
            "prompt": p, "prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(c.token_ids),
            "text": c.text,
            # per step: the sampled token's logprob and the top alternatives
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in (c.logprobs or [])],
        })
    return {"results": results, "startup_s": startup, "scored": score(llm, score_items) if score_items else None}


def run(model: str, prompts: list[str], out: str, *args: str, env: dict | None = None,
        timeout: float | None = None) -> dict:
    """This tool in a fresh process (one engine, nothing leaks between configurations), as
    the tests and benchmarks/quality.py use it: `args` are its options after --model,
    --prompts-json and --out. Returns its JSON."""
    prompts_file = out + ".prompts.json"
    with open(prompts_file, "w") as f:
        json.dump(prompts, f, ensure_ascii=False)
    cmd = [sys.executable, "-m", "vllm_pypto.tools.generate", "--model", model, "--prompts-json", prompts_file,
           "--out", out, *args]
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
    r = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None, help="e.g. pypto-a8w8; omit for the checkpoint's own")
    ap.add_argument("--prompt", action="append", default=[], help="repeatable")
    ap.add_argument("--prompts-json", help="a JSON list of prompts")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--logprobs", type=int, default=2)
    ap.add_argument("--chat", action="store_true", help="apply the chat template (enable_thinking false)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--additional-config", type=json.loads, default=None)
    ap.add_argument("--score-json", help="a JSON list of {prompt_token_ids, token_ids} to teacher-force")
    ap.add_argument("--out", default="-")
    a = ap.parse_args(argv)
    prompts = list(a.prompt)
    if a.prompts_json:
        with open(a.prompts_json) as f:
            prompts += json.load(f)
    if not prompts:
        ap.error("give at least one --prompt or --prompts-json")
    extra = {"additional_config": a.additional_config} if a.additional_config else {}
    items = None
    if a.score_json:
        with open(a.score_json) as f:
            items = json.load(f)
    res = generate(a.model, prompts, a.max_tokens, a.quantization, a.logprobs, a.chat, a.max_model_len,
                   score_items=items, **extra)
    text = json.dumps(res, ensure_ascii=False, indent=1)
    if a.out == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
