"""Shared fixtures: tiny random Qwen3 checkpoints (real config.json, safetensors and Qwen3
tokenizer) and engine outputs, each built once per session.

Engines run through `python -m vllm_pypto.tools.generate` in a subprocess: one engine per
configuration, all prompts at once, so each costs one start-up (~45 s on 2 cores) and
nothing leaks between configurations.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from vllm_pypto.tools import generate
from vllm_pypto.tools.make_checkpoint import make_checkpoint

PROMPTS = ["介绍一下北京故宫", "The capital of France is", "请写一首关于春天的诗",
           "Explain how a transformer language model works.", "今天天气很好，我们去",
           "Once upon a time, in a small village"]
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="session")
def tiny_w8a8(ckpt_root) -> str:
    """compressed-tensors W8A8, bf16 scales on disk (what llm-compressor writes)."""
    return make_checkpoint(str(ckpt_root / "tiny-w8a8"), "tiny", "w8a8", seed=0, progress=False)


@pytest.fixture(scope="session")
def tiny_bf16(ckpt_root) -> str:
    """The same model (same seed) as plain bf16: quantized at load under pypto-a8w8."""
    return make_checkpoint(str(ckpt_root / "tiny-bf16"), "tiny", "bf16", seed=0, progress=False)


def run_generate(model: str, out: str, *args: str, env: dict | None = None, max_tokens: int = 48,
                 prompts: list[str] = PROMPTS, timeout: float = 900) -> dict:
    return generate.run(model, prompts, out, "--max-tokens", str(max_tokens), *args, env={**ENV, **(env or {})},
                        timeout=timeout)


@pytest.fixture(scope="session")
def out_w8a8(tiny_w8a8, tmp_path_factory):
    """pypto-a8w8 on the W8A8 checkpoint."""
    return run_generate(tiny_w8a8, str(tmp_path_factory.mktemp("gen") / "w8a8.json"), "--quantization", "pypto-a8w8")


@pytest.fixture(scope="session")
def out_w8a8_reference_backend(tiny_w8a8, tmp_path_factory):
    """The same engine on the torch reference backend (the default is the native one where it runs)."""
    return run_generate(tiny_w8a8, str(tmp_path_factory.mktemp("gen") / "w8a8-ref.json"), "--quantization",
                        "pypto-a8w8", env={"VLLM_PYPTO_BACKEND": "reference"}, max_tokens=16)


@pytest.fixture(scope="session")
def out_bf16_ref(tiny_bf16, tmp_path_factory):
    """Stock vLLM, no quantization, on the bf16 checkpoint: the bf16 reference."""
    return run_generate(tiny_bf16, str(tmp_path_factory.mktemp("gen") / "bf16.json"))


@pytest.fixture(scope="session")
def out_bf16_quantized(tiny_bf16, out_bf16_ref, tmp_path_factory):
    """pypto-a8w8 quantizing the bf16 checkpoint at load; also teacher-forces the bf16
    reference's greedy continuations in the same engine."""
    d = tmp_path_factory.mktemp("gen")
    items = [{"prompt_token_ids": r["prompt_token_ids"], "token_ids": r["token_ids"]} for r in out_bf16_ref["results"]]
    with open(d / "score.json", "w") as f:
        json.dump(items, f)
    return run_generate(tiny_bf16, str(d / "q.json"), "--quantization", "pypto-a8w8", "--score-json",
                        str(d / "score.json"))



# Two A8W8 runs that should agree up to int8 noise (../shared/quality-notes.md): greedy text may
# part only where the reference's top-2 logprobs are within a few bf16 steps.
MARGIN = 0.13  # four bf16 steps of logits of magnitude 4-8
MAX_DLP = 0.2


def margin(step: dict) -> float:
    top = sorted(step.values(), reverse=True)
    return top[0] - top[1]


def noise_only(ref: dict, got: dict) -> dict:
    """Greedy tokens equal up to the first divergence, which only a near-tie of the reference may
    cause; the chosen tokens' logprobs agree until then. Returns where it diverged."""
    r, g = ref["token_ids"], got["token_ids"]
    assert got["prompt_token_ids"] == ref["prompt_token_ids"]
    assert len(g) == len(r) and g[0] == r[0], "the prefill's token differs"
    at = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
    for i in range(at):
        dlp = abs(got["logprobs"][i][str(r[i])] - ref["logprobs"][i][str(r[i])])
        assert dlp <= MAX_DLP, f"step {i}: logprob of the shared token moved by {dlp:.3f}"
    if at < len(r):
        assert margin(ref["logprobs"][at]) <= MARGIN, (
            f"diverged at step {at} where the reference's top-2 margin is {margin(ref['logprobs'][at]):.3f}")
    return {"diverged_at": at, "of": len(r), "ref_margin": None if at == len(r) else margin(ref["logprobs"][at])}


ISA_PATHS = ("amx", "avx512", "avx_vnni", "avx2")


@pytest.fixture(params=ISA_PATHS)
def isa(request):
    """Run the test on one ISA path of the native kernels; skipped only where this CPU cannot
    run that path (an AMX Xeon runs all four, an AVX2-only EPYC avx2 alone)."""
    from vllm_pypto import _C

    if request.param not in _C.isa_paths():
        pytest.skip(f"this CPU cannot run the {request.param} path (it runs {', '.join(_C.isa_paths()) or 'none'})")
    _C.set_isa(request.param)
    assert _C.isa() == request.param
    yield request.param
    _C.set_isa("auto")


def peak_rss_gib(cmd: list[str], env: dict | None = None) -> float:
    """Run cmd to the end; its peak resident memory (VmRSS, sampled every 50 ms), in GiB."""
    import tempfile

    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a chatty child never blocks on it
        p = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=log, text=True)
        peak = 0
        while p.poll() is None:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    peak = max(peak, next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")))
            except (OSError, StopIteration):
                pass
            time.sleep(0.05)
        log.seek(0)
        assert p.returncode == 0, log.read()[-3000:]
    return peak / 2**20
