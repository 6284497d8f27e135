"""The README's first command: build a small random-weight Qwen3 W8A8 checkpoint with the
real Qwen3 tokenizer, serve it with `vllm serve --quantization pypto-a8w8`, send the chat
prompt 介绍一下北京故宫 through the openai client, print the reply, TTFT and TPOT, stop.

The weights are random, so the reply is fluent-looking nonsense: the demo shows the
serving path and its timings, not model quality.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from .tools.make_checkpoint import make_checkpoint
from .tools.server import VllmServer

PROMPT = "介绍一下北京故宫"


def chat_once(base_url: str, model: str, prompt: str, max_tokens: int, extra_body: dict | None = None) -> dict:
    """One streamed chat request; TTFT = first content token, TPOT = the rest per token, NaN where
    all the text came in one chunk (nothing to time between tokens: a tiny model on a fast CPU, or a
    detokenizer holding back a random model's partial characters).
    extra_body: the request's non-OpenAI fields (default: vLLM's, no thinking and ignore_eos)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="EMPTY")
    t0 = time.perf_counter()
    first = last = None
    parts, completion_tokens = [], None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True} if extra_body is None
        else extra_body)
    for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            parts.append(chunk.choices[0].delta.content)
    n = completion_tokens or len(parts)
    return {"text": "".join(parts), "tokens": n, "ttft_s": (first or t0) - t0,
            "tpot_s": ((last - first) / (n - 1)) if len(parts) > 1 and n > 1 else float("nan")}


def show_progress(seconds: float, line: str) -> None:
    """One short line per new server log line while the engine starts."""
    line = re.sub(r"^\(?[A-Za-z]*[^)]*\)?\s*(INFO|WARNING|ERROR)\s+\S+\s+\S+\s+\[[^]]*\]\s*", "", line)
    print(f"  [{seconds:5.1f}s] {line[:110]}", flush=True)


def backend_line(server: VllmServer) -> str:
    """What the worker logged about the kernels that serve: backend and ISA path."""
    lines = server.log_lines("linear layers run on backend=")
    if not lines:
        return "unknown (the server log does not say)"
    return lines[-1].split("linear layers run on ", 1)[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=os.path.join("checkpoints", "qwen3-tiny-w8a8"))
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    if not os.path.exists(os.path.join(a.checkpoint, "config.json")):
        make_checkpoint(a.checkpoint, a.shape, "w8a8")
    print(f"starting: vllm serve {a.checkpoint} --quantization pypto-a8w8 (engine start takes ~1 min on 2 cores)",
          flush=True)
    server = VllmServer(a.checkpoint, "--quantization", "pypto-a8w8", "--served-model-name", "qwen3-demo",
                        "--max-model-len", "2048", progress=show_progress)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as e:  # the message carries the server log's tail
        print(f"\nvllm serve did not start: {e}", file=sys.stderr)
        sys.exit(1)
    try:
        served_by = backend_line(server)
        r = chat_once(server.url, "qwen3-demo", a.prompt, a.max_tokens)
    finally:
        server.stop()
    print(f"\nserved by: {served_by}")
    print(f"prompt: {a.prompt}\nreply ({r['tokens']} tokens, random weights): {r['text']!r}")
    print(f"TTFT {r['ttft_s'] * 1000:.1f} ms   TPOT {r['tpot_s'] * 1000:.1f} ms/token")


if __name__ == "__main__":
    main()
