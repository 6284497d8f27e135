"""A real `vllm serve --quantization pypto-a8w8` process over real HTTP."""

from __future__ import annotations

import pytest
import requests
from openai import OpenAI
from transformers import AutoTokenizer

from golden_qwen3 import GoldenQwen3
from test_golden import check, gate
from vllm_pypto.kernels import native_cpu_status
from vllm_pypto.tools.server import VllmServer

MODEL = "qwen3-tiny"
ZH = "介绍一下北京故宫"


@pytest.fixture(scope="module")
def server(tiny_w8a8):
    with VllmServer(tiny_w8a8, "--quantization", "pypto-a8w8", "--served-model-name", MODEL,
                    "--max-model-len", "2048") as s:
        yield s
        log = s.log_tail(400)
    backend = "cpu" if native_cpu_status() is None else "reference"
    assert f"pypto-a8w8: linear layers run on backend={backend}" in log


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="EMPTY")


def test_completion_tokens_match_golden(server, tiny_w8a8):
    r = requests.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
        "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = choice["token_ids"]
    assert len(ids) == 16
    lps = [{t.split(":", 1)[1]: lp} for t, lp in zip(choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"])]
    assert [int(next(iter(d))) for d in lps] == ids
    result = {"prompt": "The capital of France is", "prompt_token_ids": choice["prompt_token_ids"],
              "token_ids": ids, "logprobs": lps}
    check(gate(GoldenQwen3(tiny_w8a8), [result]))


def test_chat_uses_qwen3_template_without_thinking(client, tiny_w8a8):
    tok = AutoTokenizer.from_pretrained(tiny_w8a8)
    msgs = [{"role": "user", "content": ZH}]
    expect = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert expect.endswith("<think>\n\n</think>\n\n")
    resp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                      "ignore_eos": True})
    assert resp.usage.prompt_tokens == len(tok(expect, add_special_tokens=False)["input_ids"])
    assert resp.usage.completion_tokens == 12 and resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content


def test_streamed_chinese_equals_non_streamed_byte_for_byte(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": ZH}], max_tokens=48, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
             if c.choices]
    streamed = "".join(parts)
    assert len([p for p in parts if p]) > 1
    assert streamed.encode("utf-8") == whole.encode("utf-8")
    assert "\ufffd" not in streamed or "\ufffd" in whole  # no replacement char invented by chunking


def test_streamed_completion_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt="今天天气很好，我们去", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed.encode() == whole.encode()


def test_health_and_metrics(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    m = requests.get(server.url + "/metrics", timeout=10).text
    assert "vllm:num_requests_running" in m


def test_demo_exits_nonzero_with_the_server_log_when_startup_fails(tmp_path):
    """`make demo` on a folder the server refuses: progress lines while it starts, then the
    server log's tail and exit status 1, not a traceback or a hang."""
    import json
    import subprocess
    import sys

    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    r = subprocess.run([sys.executable, "-m", "vllm_pypto.demo", "--checkpoint", str(bad)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert "vllm serve did not start: vllm serve exited with" in r.stderr
    assert "Traceback" in r.stderr  # the server's own, from its log tail
    assert "starting: vllm serve" in r.stdout and "s] " in r.stdout  # progress while it started
