"""The plugin against the independent golden model (tests/golden_qwen3.py).

What is compared, and why these tolerances. The plugin runs vLLM's stock Qwen3 (its
RMSNorm, RoPE, attention kernels) around our A8W8 linears; the golden computes the same
model from the spec. Their non-linear ops differ by bf16 rounding here and there, and
per-token int8 quantization amplifies one-ulp differences: an element near a rounding
boundary flips by one int8 step. Measured on this checkpoint, perturbing only the
golden's own RoPE rounding (fp32 -> bf16) moved chosen-token logprobs by 0.045 on
average (max 0.19) and changed the argmax at ~10% of steps, all of them near-ties of a
random model. Hence:

- teacher forcing: each token the plugin chose is the golden's argmax, unless the golden's
  own top-2 logit margin is <= DELTA (a near-tie that noise may decide either way);
- greedy: the plugin's 16- and 48-token outputs equal the golden's free-running greedy
  output up to the first such near-tie (and fully, where there is none);
- logprobs: |plugin - golden| for the chosen tokens, mean <= MEAN_TOL, max <= MAX_TOL.
Measured for the correct path (6 prompts x 48 tokens): mean 0.05, max 0.25, no violation.
For a q-only RoPE position offset of one (a bug that still gives plausible text): mean
0.16, max 0.80; k/v scale swap: mean 1.8, 73 violations; per-tensor instead of
per-channel scales: mean 3.6, 81 violations. What this cannot see (a 1% activation-scale
error, clamping at 126) the value-exact unit tests in test_numerics.py do.
test_gate_rejects_a_subtle_bug keeps the gate honest: it must fail on the RoPE bug.
"""

from __future__ import annotations

import os

import pytest
import torch

from golden_qwen3 import GoldenQwen3
from conftest import PROMPTS, run_generate
from vllm_pypto.kernels import native_cpu_status
from vllm_pypto.tools.make_checkpoint import make_checkpoint

DELTA = 0.5      # logits (the checkpoint's logit std is 2): two logits each off by up to 0.25
MEAN_TOL = 0.12  # nats
MAX_TOL = 0.6    # nats


def gate(golden: GoldenQwen3, results: list[dict], n: int | None = None) -> dict:
    viol, dl, exact, prompts_equal, first_divs = [], [], 0, 0, []
    for r in results:
        toks = r["token_ids"][:n]
        tf = golden.teacher_forced(r["prompt_token_ids"], toks)
        plp = [step[str(t)] for step, t in zip(r["logprobs"], toks)]
        dl += [abs(a - b) for a, b in zip(plp, tf["logprob"])]
        viol += [(r["prompt"], i, t, tf["argmax"][i], round(tf["margin"][i], 3))
                 for i, t in enumerate(toks) if t != tf["argmax"][i] and tf["margin"][i] > DELTA]
        first = next((i for i, t in enumerate(toks) if t != tf["argmax"][i]), len(toks))
        first_divs.append(first)
        exact += first
        prompts_equal += first == len(toks)
    return {"violations": viol, "mean_dlp": sum(dl) / len(dl), "max_dlp": max(dl), "tokens": len(dl),
            "exact_prefix_tokens": exact, "prompts_fully_equal": prompts_equal, "first_divergence": first_divs}


def check(rep: dict) -> None:
    print(f"\ngolden gate: {rep['tokens']} tokens, mean|dlogprob| {rep['mean_dlp']:.4f}, max {rep['max_dlp']:.3f}, "
          f"exact greedy prefix {rep['exact_prefix_tokens']}/{rep['tokens']}, first divergence {rep['first_divergence']}")
    assert not rep["violations"], f"plugin chose a token the golden clearly ranks lower: {rep['violations']}"
    assert rep["mean_dlp"] <= MEAN_TOL and rep["max_dlp"] <= MAX_TOL, rep


def check_free_running(golden: GoldenQwen3, results: list[dict], n: int) -> None:
    """The golden's own greedy output, decoded independently, equals the plugin's up to the
    first step where the golden is within DELTA of a tie."""
    for r in results:
        mine = golden.greedy(r["prompt_token_ids"], n)
        theirs = r["token_ids"][:n]
        if mine == theirs:
            continue
        i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        lg = golden.logits(r["prompt_token_ids"] + mine[:i])[-1]
        top2 = lg.topk(2).values
        margin = (top2[0] - top2[1]).item()
        assert margin <= DELTA, f"{r['prompt']!r}: greedy differs at token {i} where the golden's margin is {margin}"
        assert lg[theirs[i]] >= top2[0] - DELTA, f"{r['prompt']!r}: plugin token {theirs[i]} is not a near-tie"


@pytest.fixture(scope="module")
def golden_w8a8(tiny_w8a8):
    return GoldenQwen3(tiny_w8a8)


@pytest.mark.parametrize("n", [16, 48])
def test_w8a8_checkpoint_matches_golden(out_w8a8, golden_w8a8, n):
    check(gate(golden_w8a8, out_w8a8["results"], n))
    check_free_running(golden_w8a8, out_w8a8["results"], n)


@pytest.mark.parametrize("n", [16, 48])
def test_bf16_checkpoint_quantized_at_load_matches_golden(out_bf16_quantized, tiny_bf16, n):
    g = GoldenQwen3(tiny_bf16, a8w8=True)  # the golden quantizes the bf16 weights itself
    check(gate(g, out_bf16_quantized["results"], n))
    check_free_running(g, out_bf16_quantized["results"], n)


def test_reference_backend_end_to_end(out_w8a8_reference_backend, out_w8a8, golden_w8a8):
    """The torch reference backend through the engine: passes the golden gate, and where the
    native backend is the default, the two are bit-compatible, so tokens and logprobs are equal."""
    ref = out_w8a8_reference_backend["results"]
    check(gate(golden_w8a8, ref))
    if native_cpu_status() is None:
        for a, b in zip(ref, out_w8a8["results"]):
            assert a["token_ids"] == b["token_ids"][:16]
            assert a["logprobs"] == b["logprobs"][:16]


def test_golden_agrees_with_stock_vllm_bf16(out_bf16_ref, tiny_bf16):
    """The golden's non-quantized path against stock vLLM bf16: validates the golden itself."""
    check(gate(GoldenQwen3(tiny_bf16, a8w8=False), out_bf16_ref["results"]))


def test_gate_rejects_a_subtle_bug(out_w8a8, tiny_w8a8):
    """Negative control: a golden whose Q (not K) RoPE is one position ahead must not pass."""
    bad = GoldenQwen3(tiny_w8a8)
    rope, calls = bad.rope, {"n": 0}

    def q_shifted(x, pos):
        calls["n"] += 1
        return rope(x, pos + 1) if calls["n"] % 2 == 1 else rope(x, pos)  # q is rotated first, then k

    bad.rope = q_shifted
    rep = gate(bad, out_w8a8["results"])
    assert rep["violations"] or rep["mean_dlp"] > MEAN_TOL or rep["max_dlp"] > MAX_TOL, rep


def test_bf16_down_proj_flag(tiny_w8a8, out_w8a8, tmp_path):
    """The named upstream-comparison option: down_proj dequantized to bf16 at load."""
    out = run_generate(tiny_w8a8, str(tmp_path / "flag.json"), "--quantization", "pypto-a8w8",
                       env={"VLLM_PYPTO_FLAGS": "bf16_down_proj"}, max_tokens=16)
    check(gate(GoldenQwen3(tiny_w8a8, bf16_down=True), out["results"]))
    default = [r["logprobs"][0] for r in out_w8a8["results"]]
    assert [r["logprobs"][0] for r in out["results"]] != default  # the flag really changes the computation


@pytest.fixture(scope="module")
def tiny_w8a8_tied(ckpt_root):
    """The tiny model with its lm_head tied to the embedding table, as Qwen3-0.6B..4B are; the
    table is scaled as the untied head is (logit std 2), else bf16 logits of ~100 tie by rounding."""
    return make_checkpoint(str(ckpt_root / "tiny-w8a8-tied"), "tiny", "w8a8", seed=0, progress=False, tied=True,
                           embed_scale=2.0 / 256 ** 0.5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_int8_lm_head_flag(tied, tiny_w8a8, out_w8a8, request, tmp_path):
    """lm_head as an A8W8 GEMM: the golden with the same rule for the head (per-row int8 weight,
    per-token activation scale) passes the gate, tied heads included; the flag does change the logits."""
    model = request.getfixturevalue("tiny_w8a8_tied") if tied else tiny_w8a8
    n, prompts = (16, PROMPTS[:4]) if tied else (48, PROMPTS)  # the untied one as every flag: 16 and 48 tokens
    out = run_generate(model, str(tmp_path / "flag.json"), "--quantization", "pypto-a8w8",
                       env={"VLLM_PYPTO_FLAGS": "int8_lm_head"}, max_tokens=n, prompts=prompts)
    golden = GoldenQwen3(model, int8_head=True)
    for k in sorted({16, n}):
        check(gate(golden, out["results"], k))
    check_free_running(golden, out["results"], n)
    if not tied:
        assert [r["logprobs"] for r in out["results"]] != [r["logprobs"] for r in out_w8a8["results"]]
        rep = gate(GoldenQwen3(model), out["results"])  # the bf16-head golden sees the int8 head's noise
        assert rep["mean_dlp"] > gate(GoldenQwen3(model), out_w8a8["results"])["mean_dlp"], rep
