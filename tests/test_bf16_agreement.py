"""pypto-a8w8 against the same checkpoint served in bf16 by stock vLLM.

Agreement is measured by teacher forcing inside the A8W8 engine (vLLM prompt_logprobs):
at each step of the bf16 engine's greedy output, is that token also the A8W8 engine's
top-1? On a random-weight model most steps are near-ties (logit std 2 over 151936
tokens), so int8 noise flips many of them; quality-notes measured 0.997 on a trained
model. Measured here (2026-11-29): top-1 0.903, top-5 1.000 over 288 tokens. The bar is
that minus ~6 binomial standard deviations (0.017 at n=288).
"""

AGREEMENT_BAR = 0.80


def test_teacher_forced_agreement_with_bf16(out_bf16_ref, out_bf16_quantized):
    scored = out_bf16_quantized["scored"]
    ranks = [s["rank"] for steps in scored for s in steps]
    agreement = sum(r == 1 for r in ranks) / len(ranks)
    firsts = []
    for ref, q in zip(out_bf16_ref["results"], out_bf16_quantized["results"]):
        firsts.append(next((i for i, (a, b) in enumerate(zip(ref["token_ids"], q["token_ids"])) if a != b),
                           len(ref["token_ids"])))
    top5 = sum(r <= 5 for r in ranks) / len(ranks)
    print(f"\nA8W8 vs bf16: teacher-forced top-1 agreement {agreement:.3f}, top-5 {top5:.3f} over {len(ranks)} "
          f"tokens; free-running greedy first divergence per prompt {firsts}")
    assert len(ranks) == 6 * 48
    assert agreement >= AGREEMENT_BAR
    assert top5 >= 0.95
