"""What vLLM's server guarantees must still hold under `--quantization pypto-a8w8`: batch
invariance under concurrency, prefix caching and chunked prefill; aborts on disconnect;
bursts past the scheduler; hostile requests answered like stock vLLM; overflowing
activations; tensor parallelism. Every test drives a real `vllm serve` over HTTP.

Marked `slow` (several server start-ups): CI runs them; `make test-fast` skips them.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from conftest import PROMPTS, run_generate
from vllm_pypto.tools.server import VllmServer

pytestmark = pytest.mark.slow

MODEL = "qwen3-tiny"
# long enough that 8 requests of LEN - 20 tokens stay running for seconds even on a fast CI host
LEN = 2048
COMMON = ("--served-model-name", MODEL, "--max-model-len", str(LEN), "--max-num-seqs", "8")


def tiny_server(model: str, *args: str, env: dict | None = None) -> VllmServer:
    """A server with 128 MiB of KV cache instead of VllmServer's 1 GiB (8 x 2048 tokens of the tiny
    model take 16 MiB): 3.8 against 4.7 GB a server. CI once ran out of its 24 GiB with four of
    these up beside the other xdist worker's servers, and an engine found no room for its cache;
    so only `srv` lives for the whole module, and at most one other server beside it."""
    return VllmServer(model, "--kv-cache-memory-bytes", str(128 << 20), *args,
                      env={"VLLM_CPU_KVCACHE_SPACE": None, **(env or {})})


def serve(model: str, *args: str, env: dict | None = None):
    with tiny_server(model, *COMMON, *args, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def srv(tiny_w8a8):
    """pypto-a8w8, prefix caching off, at most 8 running (so 16 requests queue)."""
    yield from serve(tiny_w8a8, "--quantization", "pypto-a8w8", "--no-enable-prefix-caching")


@pytest.fixture
def srv_cached(tiny_w8a8):
    """pypto-a8w8 with prefix caching and prefill chunks of 32 tokens."""
    yield from serve(tiny_w8a8, "--quantization", "pypto-a8w8", "--enable-prefix-caching",
                     "--enable-chunked-prefill", "--max-num-batched-tokens", "32")


def metrics(server) -> dict[str, float]:
    """vLLM's Prometheus gauges and counters, summed over label sets, by name (+ finished_reason)."""
    out: dict[str, float] = {}
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$", line)
        if not m:
            continue
        name = m.group(1)
        reason = re.search(r'finished_reason="(\w+)"', m.group(2) or "")
        if reason:
            name += ":" + reason.group(1)
        out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def wait_for(pred, timeout: float = 60.0, every: float = 0.25):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    return pred()


def complete(server, prompt, max_tokens: int = 24, stream: bool = False, **extra) -> list[int]:
    """Greedy token ids of one completion, streamed or not."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, **extra}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=600, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["token_ids"]
    ids: list[int] = []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                ids += c.get("token_ids") or []
    return ids


def mixed_prompts(n: int = 16, seed: int = 0) -> list[str]:
    """Lengths from 1 to ~300 tokens, zh and en; a third share a long prefix (for the cache)."""
    rng = random.Random(seed)
    words = "the of and to in we model cache token value alpha beta 北京 故宫 天气 春天 一 二 三".split()
    shared = " ".join(rng.choice(words) for _ in range(120))
    prompts = []
    for i in range(n):
        tail = " ".join(rng.choice(words) for _ in range(rng.choice([1, 3, 8, 30, 90, 200])))
        prompts.append(shared + " " + tail if i % 3 == 0 else tail)
    return prompts


# The tests that start servers of their own come first: `srv` (module scope) is started after them,
# so it never stands beside them (see tiny_server).

# --- overflowing activations --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_overflow(tiny_w8a8, tmp_path_factory) -> str:
    """The W8A8 test model with layer 0's down_proj scales at 3e38 for 8 channels: every
    token's MLP output overflows to inf, the next RMSNorm turns it into NaN."""
    d = tmp_path_factory.mktemp("overflow") / "tiny-overflow"
    shutil.copytree(tiny_w8a8, d)
    for f in d.glob("*.safetensors"):
        t = load_file(f)
        key = "model.layers.0.mlp.down_proj.weight_scale"
        if key in t:
            t[key][:8] = 3e38
            save_file(t, f, metadata={"format": "pt"})
    return str(d)


def test_overflowing_activations_keep_the_server_up(tiny_overflow, tmp_path):
    prompts = PROMPTS[:2]
    ref = run_generate(tiny_overflow, str(tmp_path / "ref.json"), "--quantization", "pypto-a8w8",
                       env={"VLLM_PYPTO_BACKEND": "reference"}, max_tokens=8, prompts=prompts)
    with tiny_server(tiny_overflow, *COMMON, "--quantization", "pypto-a8w8") as s:
        got = [complete(s, p, max_tokens=8) for p in prompts]
        streamed = complete(s, prompts[0], max_tokens=8, stream=True)
        with_logprobs = ask(s, "/v1/completions", {"prompt": prompts[1], "max_tokens": 2, "logprobs": 1})
        health = requests.get(s.url + "/health", timeout=10).status_code
        errors = metrics(s).get("vllm:request_success_total:error", 0)
    assert got == [r["token_ids"] for r in ref["results"]], "native and reference backends disagree on NaN rows"
    assert streamed == got[0]
    # NaN logits: greedy takes token 0; vLLM refuses to put NaN logprobs in JSON (a 400, not a 5xx).
    assert with_logprobs == (400, "Out of range float values are not JSON compliant")
    assert health == 200 and errors == 0


# --- tensor parallelism -------------------------------------------------------------------------

# The bf16 checkpoint only: its tensors are quantized as they arrive and then go through the very
# loaders (int8 weight, fp32 scale parameters, vLLM's TP slicing) a W8A8 checkpoint's take, so one
# TP=2 server covers both (a second one cost CI ~3 minutes).
@pytest.mark.parametrize("ckpt, tp1", [("tiny_bf16", "out_bf16_quantized")])
def test_tensor_parallel_2_equals_tp_1(ckpt, tp1, request):
    """vLLM's own multiprocess executor, one worker per core. TP=1 outputs: the offline engine's."""
    model, expect = request.getfixturevalue(ckpt), request.getfixturevalue(tp1)["results"]
    with tiny_server(model, *COMMON, "--quantization", "pypto-a8w8", "--tensor-parallel-size", "2",
                         env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as s:
        got = [complete(s, r["prompt_token_ids"], max_tokens=48) for r in expect]
        log = s.log_tail(2000)
    shards = re.findall(r"pypto-a8w8: (\S+) holds weight \[(\d+), (\d+)\] and (\d+) scales of \[(\d+), (\d+)\] "
                        r"on TP rank (\d)/2", log)
    assert {(name, rank) for name, *_, rank in shards} == {
        (f"model.layers.0.{m}", r) for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                             "mlp.down_proj") for r in "01"}
    for name, *sizes, _ in shards:
        n, k, scales, full_n, full_k = map(int, sizes)
        # column-parallel: half the output channels and their scales; row-parallel: half of K, all scales
        row = name.endswith(("o_proj", "down_proj"))
        assert (n, k, scales) == ((full_n, full_k // 2, full_n) if row else (full_n // 2, full_k, full_n // 2)), name
    diverged = [i for i, (g, r) in enumerate(zip(got, expect)) if g != r["token_ids"]]
    assert not diverged, f"TP=2 differs from TP=1 on prompts {diverged}"
    print(f"\nTP=2 {ckpt}: {len(got)}/{len(got)} prompts x 48 tokens equal TP=1")


# --- schema fuzzing -----------------------------------------------------------------------------

def test_schemathesis_finds_no_server_error(tiny_w8a8, tmp_path):
    """Property-based requests from the server's own OpenAPI schema, bounded (25 per
    operation, fixed seed); a short context keeps each accepted generation cheap."""
    with tiny_server(tiny_w8a8, "--served-model-name", MODEL, "--max-model-len", "128", "--max-num-seqs", "8",
                     "--quantization", "pypto-a8w8") as s:
        r = subprocess.run([shutil.which("schemathesis") or os.path.join(os.path.dirname(sys.executable),
                                                                             "schemathesis"),
                            "run", s.url + "/openapi.json", "--checks", "not_a_server_error", "--phases",
                            "examples,fuzzing", "--max-examples", "25", "--seed", "0", "--workers", "2",
                            "--request-timeout", "120", "--exclude-path-regex", "elastic_ep"],
                           capture_output=True, text=True, timeout=900, cwd=tmp_path)
        healthy = s.healthy()
        log = s.log_tail(100000)
    summary = re.search(r"(\d+) generated, (\d+) passed", r.stdout)
    assert r.returncode == 0 and summary, r.stdout[-4000:]
    assert int(summary.group(1)) >= 200 and summary.group(1) == summary.group(2), r.stdout[-4000:]
    assert healthy and not re.search(r'" 5\d\d ', log)


# --- batch invariance, aborts and bursts on one long-lived server ---------------------------------

@pytest.mark.parametrize("which", ["srv", "srv_cached"])
def test_concurrent_requests_equal_batch_one(which, request):
    server = request.getfixturevalue(which)
    prompts = mixed_prompts()
    before = metrics(server)
    alone = [complete(server, p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda ip: complete(server, ip[1], stream=ip[0] % 2 == 1), enumerate(prompts)))
    diverged = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    assert all(len(a) == 24 for a in alone)
    assert not diverged, f"{len(diverged)}/16 concurrent outputs differ from batch 1: {diverged}"
    print(f"\n{which}: 16/16 concurrent outputs equal batch 1")
    if which == "srv_cached":
        hits = metrics(server)["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0)
        assert hits > 0, "prefix caching never hit; the cached path was not exercised"


def idle(server) -> dict[str, float]:
    m = metrics(server)
    return {k: m[k] for k in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}


def open_request(server, body: dict) -> socket.socket:
    """A raw HTTP request whose client will later hang up without reading the answer."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def first_bytes(sock: socket.socket, n: int = 200) -> bytes:
    """What the server has sent on a socket so far (b"" if nothing within 0.5 s)."""
    sock.settimeout(0.5)
    try:
        return sock.recv(n)
    except OSError:
        return b""


def test_disconnected_clients_are_aborted(srv):
    base = idle(srv)
    assert base["vllm:num_requests_running"] == 0 and base["vllm:num_requests_waiting"] == 0
    before = metrics(srv)
    body = {"model": MODEL, "prompt": "今天天气很好，我们去", "max_tokens": LEN - 20, "temperature": 0,
            "ignore_eos": True}
    # 12 requests for 8 slots: streaming and not, running and queued
    t0, seen = time.time(), []

    def all_in():
        m = idle(srv)
        state = (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"])
        if not seen or seen[-1][1] != state:
            seen.append((round(time.time() - t0, 2), state))
        return m if state == (8, 4) else None

    socks = [open_request(srv, {**body, "stream": i % 2 == 0}) for i in range(12)]
    busy = wait_for(all_in, 60, every=0.1)
    if not busy:  # CI once saw only idle here: say what the server answered instead
        pytest.fail(f"never 8 running + 4 queued; (s, (running, waiting)) seen: {seen}; "
                    f"answers: {[first_bytes(s) for s in socks]}\n{srv.log_tail(40)}")
    assert busy["vllm:kv_cache_usage_perc"] > base["vllm:kv_cache_usage_perc"], busy
    for sock in socks:
        sock.close()
    after = wait_for(lambda: (lambda m: m if m == base else None)(idle(srv)), 60)
    assert after == base, f"not back to idle after disconnects: {idle(srv)} vs {base}"
    # aborted, not finished: no request completed and far fewer tokens than asked were made
    # (vLLM counts client aborts in neither finished_reason, so these are the evidence)
    delta = {k: metrics(srv)[k] - before[k] for k in ("vllm:request_success_total:length",
                                                      "vllm:request_success_total:stop",
                                                      "vllm:generation_tokens_total")}
    assert delta["vllm:request_success_total:length"] == delta["vllm:request_success_total:stop"] == 0, delta
    assert delta["vllm:generation_tokens_total"] < 12 * (LEN - 20) / 2, delta
    print(f"\nabort: idle {base} -> busy {busy} -> after hang-up {after}; {delta}")
    assert len(complete(srv, "still serving?", max_tokens=4)) == 4


def test_burst_past_the_scheduler_loses_nothing(srv):
    n, health, done = 64, [], threading.Event()

    def poll():
        while not done.is_set():
            health.append(requests.get(srv.url + "/health", timeout=10).status_code)
            time.sleep(0.2)

    def one(i):
        r = requests.post(srv.url + "/v1/completions", timeout=600, json={
            "model": MODEL, "prompt": f"request {i}: " + "天气 " * (i % 40), "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        return r.status_code, r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.text

    before = metrics(srv).get("vllm:request_success_total:length", 0)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with ThreadPoolExecutor(n) as ex:
            results = list(ex.map(one, range(n)))
    finally:
        done.set()
        poller.join()
    assert results == [(200, "length")] * n, [r for r in results if r != (200, "length")]
    assert metrics(srv)["vllm:request_success_total:length"] - before == n
    assert len(health) >= 3 and set(health) == {200}, health
    print(f"\nburst: {n} sent, {sum(r == (200, 'length') for r in results)} complete, 0 errors; "
          f"/health polled {len(health)} times, all 200")


# --- hostile requests: same answers as stock vLLM ----------------------------------------------

@pytest.fixture
def stock(tiny_bf16):
    """Stock vLLM (no quantization) on the same model, tokenizer and limits."""
    yield from serve(tiny_bf16)


HOSTILE = {
    "prompt_at_limit": ("/v1/completions", {"prompt": [100] * (LEN - 1), "max_tokens": 1}),
    "prompt_fills_limit": ("/v1/completions", {"prompt": [100] * LEN, "max_tokens": 1}),
    "prompt_one_over": ("/v1/completions", {"prompt": [100] * (LEN + 1), "max_tokens": 1}),
    "long_text_prompt": ("/v1/completions", {"prompt": "北京 " * 5000, "max_tokens": 1}),
    "max_tokens_past_limit": ("/v1/completions", {"prompt": "hi", "max_tokens": LEN + 10}),
    "max_tokens_negative": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    "empty_prompt": ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    "empty_prompt_list": ("/v1/completions", {"prompt": [], "max_tokens": 4}),
    "empty_messages": ("/v1/chat/completions", {"messages": [], "max_tokens": 4}),
    "empty_message_content": ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}],
                                                       "max_tokens": 2, "temperature": 0}),
    "huge_n": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 100000}),
    "large_n": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 64, "temperature": 1.0, "seed": 1}),
    "token_id_out_of_vocab": ("/v1/completions", {"prompt": [10 ** 9], "max_tokens": 2}),
    "token_id_negative": ("/v1/completions", {"prompt": [-1], "max_tokens": 2}),
    "token_id_last": ("/v1/completions", {"prompt": [151935], "max_tokens": 2, "temperature": 0}),
    "logprobs_too_many": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 100000}),
    "temperature_negative": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": -1}),
    "lone_surrogate": ("/v1/completions", {"prompt": "\ud800abc", "max_tokens": 2}),
    "unknown_model": ("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}),
    "wrong_types": ("/v1/completions", {"prompt": {"a": 1}, "max_tokens": "many"}),
}


def ask(server, path: str, body: dict) -> tuple[int, str]:
    r = requests.post(server.url + path, json={"model": MODEL, **body}, timeout=300)
    try:
        err = r.json().get("error") or {}
        msg = err.get("message", "") if isinstance(err, dict) else str(err)
    except ValueError:
        msg = r.text
    return r.status_code, re.sub(r"(cmpl|chatcmpl)-[0-9a-f]+", "<id>", msg)


def test_hostile_requests_answered_like_stock_vllm(srv, stock):
    mismatched, server_errors = {}, {}
    for name, (path, body) in HOSTILE.items():
        ours, theirs = ask(srv, path, body), ask(stock, path, body)
        print(f"\nhostile {name}: ours {ours[0]} stock {theirs[0]} {ours[1][:90]!r}", end="")
        if ours[0] >= 500:
            server_errors[name] = ours
        if ours != theirs:
            mismatched[name] = (ours, theirs)
    assert not server_errors, server_errors
    assert not mismatched, mismatched
    assert ask(srv, *HOSTILE["prompt_one_over"])[0] == 400 and ask(srv, *HOSTILE["prompt_at_limit"])[0] == 200
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
