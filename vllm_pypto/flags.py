"""The experimental-flag registry: every fast path or upstream-compatibility switch
that changes what runs is a named flag here, default off, with its status and its
measured effect. Set with VLLM_PYPTO_FLAGS=a,b or vLLM's
`--additional-config '{"pypto_flags": ["a"]}'`. Unknown names are errors.

    python -m vllm_pypto.flags      # prints the table
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

ENV = "VLLM_PYPTO_FLAGS"
CONFIG_KEY = "pypto_flags"
TEST_FLAGS_ENV = "VLLM_PYPTO_ALLOW_TEST_FLAGS"  # =1 lets the test-only flags through
STATUSES = ("experimental", "validated", "rejected")


@dataclass(frozen=True)
class Flag:
    name: str
    description: str
    status: str
    tpot_effect: str  # measured, in short; the runs, dated, are in docs/performance.md
    test_only: bool = False  # exists to prove a check can fail; refused unless TEST_FLAGS_ENV=1


FLAGS: dict[str, Flag] = {f.name: f for f in (
    Flag("fused_qk_norm_rope",
         "Q/K per-head RMSNorm and RoPE as one op in fp32 (one bf16 rounding, the spec's order); the Q heads "
         "of a GQA group rotate as one tile with cos/sin replicated per head",
         "experimental", "+1-2% (0.6B, served batch 1, two interleaved rounds); in-process +10-25%"),
    Flag("deferred_rms",
         "Quantize bf16(x*gamma) and fold 1/rms into the activation scale after the GEMM (upstream decode trick)",
         "experimental", "-2% to 0% (same runs); in-process none measurable"),
    Flag("fused_gate_up_silu",
         "SiLU(gate)*up and the down-proj's quantization in the gate_up GEMM's fp32 epilogue (no bf16 gate/up)",
         "experimental", "+3% / -2% (same runs); the three flags together +4-5%; in-process within noise"),
    Flag("int8_lm_head",
         "lm_head as one more A8W8 GEMM (int8 weight, one scale per vocab row, per-token activation scale); "
         "with tied embeddings the lookup table stays bf16 and the int8 head is an extra half-size copy",
         "experimental", "-15% (0.6B) / -29% (1.7B) served batch 1, one run each; in-process 0.6B step "
         "-34% (lm_head 39 -> 10 ms); quality as the default path's (0.6B, against ct)"),
    Flag("native_attn_prologue",
         "vLLM-CPU only: per-head QK-norm, RoPE and the K/V write into vLLM-CPU's paged cache as one native op, "
         "then vLLM-CPU's attention kernel, all in one opaque op a layer (no Python KV-update and attention "
         "wrappers); fused_qk_norm_rope's numerics with an fp64 mean square",
         "experimental", "-4% (0.6B served batch 1 with int8_lm_head, one run, AVX2-only EPYC: 85.6 -> 82.0 ms); "
         "with int8_lm_head + fast_top_k_top_p on a Zen 4 EPYC, one noisy run: +8% (0.6B) / -21% (1.7B); "
         "golden gate as the other flags'"),
    Flag("native_decoder_layer",
         "vLLM-CPU only: a whole decoder layer as one opaque op and one native call (norms, the four int8 GEMMs, "
         "native_attn_prologue's QK-norm/RoPE/cache write and vLLM-CPU's attention kernel, called from C++); "
         "native_attn_prologue's output bit for bit, without the Python and dispatch between the ops",
         "experimental", "-11% (0.6B) / -9% (1.7B) served batch 1 with int8_lm_head + fast_top_k_top_p, against "
         "native_attn_prologue: per-round median of 16 paired rounds (both servers up, requests alternating; lower "
         "in 12 of 16 rounds on each; a second 1.7B run -10%), Zen 4 EPYC; -9% on 0.6B forced onto avx2 (11 of 16); unpaired one-at-a-time "
         "runs read -11% to +5%; tokens unchanged"),
    Flag("native_decode_attention",
         "vLLM-CPU only, with native_decoder_layer: on a decode-only step (one query token per sequence), "
         "attention is our kernel (csrc/decode_attention.cpp: one task per sequence and KV head reads K and V "
         "once, fp32 softmax) instead of vLLM-CPU's tiled kernel; steps with a prefill keep vLLM-CPU's. "
         "Textbook fp32 attention, not vLLM-CPU's bits: outputs differ by bf16 rounding. It reads each cache "
         "layout vLLM-CPU packs (vec, vec16, and amx on Xeons with AMX), the same bits from each",
         "experimental", "served batch 1, 1.7B, per-round median of 12 paired rounds: -7% with a ~1,000-token prompt "
         "(0.74-1.26; Zen 4 EPYC), none measurable with the short chat prompt (1.7B on a Zen 3: 1.00x, 0.86-1.18; "
         "0.6B on a Zen 4, 16 rounds: 1.02x, 0.69-1.34); "
         "concurrency 16, 128-token prompts, one unpaired run: +3% output tokens/s (Zen 4); the kernel alone "
         "0.54-0.78x (Zen 4) / 0.25-0.72x (Zen 3) vLLM-CPU's attention time a layer (benchmarks/attention.py); "
         "on a Xeon with AMX (vLLM-CPU's AMX cache layout and kernel), ~1,000-token prompt, 8 paired rounds: 0.97x "
         "(0.84-1.09), and the kernel alone 1.03-1.49x vLLM-CPU's AMX kernel's time"),
    Flag("fast_top_k_top_p",
         "vLLM-CPU's top-k + top-p sampling filter (Qwen3's generation_config asks for top_k 20, top_p 0.95) on "
         "the largest max(k)+64 logits (one native pass over the row) instead of a sort of the whole vocabulary, "
         "and vLLM-CPU's Gumbel draw on the kept logits alone; the kept tokens are vLLM's, bit for bit, and the "
         "drawn token is its draw's (rows where vLLM's choice rests on its sort's order among equal logits still run "
         "vLLM's filter and draw)",
         "experimental", "-31% (0.6B: 42.8 -> 29.7 ms) / -18% (1.7B) served batch 1 with int8_lm_head, one run, "
         "Zen 4 EPYC; concurrency 16 +66% / +48% output tokens/s; the native pass and the draw on the candidates "
         "then took filter + draw from 0.98 to 0.37 ms (batch 1) and 5.5 to 1.6 ms (batch 16), benchmarks/sampler.py, "
         "and a 0.6B step's sampler from 1.5 to 1.1 ms / 6.3-7.7 to 2.4 ms (profile_step.py); tokens unchanged"),
    Flag("bf16_down_proj",
         "Run mlp.down_proj in bf16 (int8 checkpoints are dequantized at load), as the upstream did",
         "rejected", "+21% (0.6B, served batch 1); in-process +40%; twice the down-proj bytes"),
    Flag("guardrail_broken_q_rope",
         "TEST ONLY: fused_qk_norm_rope with cos/sin replicated token-major, the upstream's non-equivalent batched "
         "Q RoPE; the quality checks must fail with it",
         "rejected", "n/a", test_only=True),
)}
assert all(f.status in STATUSES for f in FLAGS.values())


def parse(names: Iterable[str] | str | None) -> frozenset[str]:
    if names is None:
        return frozenset()
    if isinstance(names, str):
        names = names.split(",")
    chosen = frozenset(n.strip() for n in names if n and n.strip())
    unknown = sorted(chosen - FLAGS.keys())
    if unknown:
        raise ValueError(f"unknown pypto-a8w8 flag(s) {unknown}; valid flags: "
                         f"{', '.join(sorted(n for n, f in FLAGS.items() if not f.test_only))}")
    test_only = sorted(n for n in chosen if FLAGS[n].test_only)
    if test_only and os.environ.get(TEST_FLAGS_ENV) != "1":
        raise ValueError(f"pypto-a8w8 flag(s) {test_only} exist only to test the quality checks and break the "
                         f"output on purpose; set {TEST_FLAGS_ENV}=1 to use them")
    return chosen


def active(additional_config: dict | None = None) -> frozenset[str]:
    """Flags from the environment and from vLLM's additional_config, validated."""
    from_config = (additional_config or {}).get(CONFIG_KEY)
    if from_config is not None and not isinstance(from_config, (list, tuple, str)):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a list of flag names, got {from_config!r}")
    return parse(os.environ.get(ENV)) | parse(from_config)


def table() -> str:
    rows = ["| flag | status | TPOT effect | what it does |", "| --- | --- | --- | --- |"]
    rows += [f"| `{f.name}` | {f.status}{' (test only)' if f.test_only else ''} | {f.tpot_effect} | {f.description} |"
             for f in FLAGS.values()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
