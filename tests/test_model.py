"""The Qwen3 model class (vllm_pypto/model/qwen3.py) and its flags, through the real engine.

The default path is held to the golden by test_golden.py (out_w8a8 runs this class). Here:
the class is really the one serving, it issues fewer dispatches than vLLM's Qwen3, and
every flag passes the same golden gate at 16 and 48 tokens while computing something
different from the default path (so a flag that silently does nothing fails). The
rounding-level flags cannot be token-identical on a random model whose logits are full of
near-ties; the gate's tolerances (test_golden.py) are the stated tolerance. The test-only
guardrail flag reproduces the upstream's non-equivalent batched Q RoPE and must fail it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ENV, run_generate
from golden_qwen3 import GoldenQwen3
from test_golden import MAX_TOL, MEAN_TOL, check, gate

# native_attn_prologue's engine tests run under `make test-slow` (CI runs both): make test stays
# under 30 minutes on an AVX2-only EPYC, where it took 35 with them
FLAGS = ["fused_qk_norm_rope", "deferred_rms", "fused_gate_up_silu",
         pytest.param("native_attn_prologue", marks=pytest.mark.slow),
         pytest.param("native_decoder_layer", marks=pytest.mark.slow),
         pytest.param("native_decoder_layer,native_decode_attention", marks=pytest.mark.slow)]


def _dispatches(model: str, tmp_path, *args: str) -> dict:
    out = tmp_path / f"dispatch{len(args)}.json"
    r = subprocess.run([sys.executable, "-m", "vllm_pypto.tools.dispatches", "--model", model, "--quantization",
                        "pypto-a8w8", "--out", str(out), *args], env={**os.environ, **ENV},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


def test_model_class_serves_with_fewer_dispatches(tiny_w8a8, tmp_path):
    ours = _dispatches(tiny_w8a8, tmp_path)
    stock = _dispatches(tiny_w8a8, tmp_path, "--stock-model-class")
    print(f"\ndispatches per decode step: ours {ours['per_step']} ({ours['per_layer']}/layer), "
          f"vLLM's Qwen3 {stock['per_step']} ({stock['per_layer']}/layer)")
    assert ours["model_class"] == "PyptoQwen3ForCausalLM" and ours["layer_class"] == "PyptoQwen3DecoderLayer"
    assert stock["model_class"] == "Qwen3ForCausalLM"
    assert ours["per_layer"] < stock["per_layer"] and ours["per_step"] < stock["per_step"]
    # the fused ops really run: one norm+quant per norm, one SiLU*up+quant, four int8 GEMMs
    ops = ours["layer_ops"]
    assert ops.get("pypto_cpu.rmsnorm_quant", 0) + ops.get("pypto.rmsnorm_quant_ref", 0) == 2
    assert ops.get("pypto_cpu.silu_mul_quant", 0) + ops.get("pypto.silu_mul_quant_ref", 0) == 1


@pytest.mark.slow
def test_native_attn_prologue_replaces_vllms_attention_glue(tiny_w8a8, tmp_path):
    """With the flag, a layer's QK-norm, RoPE, cache write and attention are one op: neither of
    vLLM's Python attention ops runs, nor the separate norm and RoPE ops."""
    ours = _dispatches(tiny_w8a8, tmp_path, "--flags", "native_attn_prologue")
    ops = ours["layer_ops"]
    print(f"\nlayer ops with native_attn_prologue: {ops}")
    assert ops.get("pypto.attention_prologue") == 1
    assert not {"vllm.unified_kv_cache_update", "vllm.unified_attention_with_output"} & set(ops)
    assert not [op for op in ops if "rotary" in op or "rms_norm" in op], ops


@pytest.mark.slow
def test_native_decoder_layer_is_one_op_with_native_attn_prologues_output(tiny_w8a8, tmp_path):
    """With the flag a layer is one dispatch, and the engine's output is native_attn_prologue's (the
    same kernels in the same order), logprobs bit for bit; with fused_gate_up_silu as well."""
    ops = _dispatches(tiny_w8a8, tmp_path, "--flags", "native_decoder_layer")["layer_ops"]
    print(f"\nlayer ops with native_decoder_layer: {ops}")
    assert ops == {"pypto_cpu.decoder_layer": 1}, ops
    out = {flag: run_generate(tiny_w8a8, str(tmp_path / f"{flag}.json"), "--quantization", "pypto-a8w8",
                              env={"VLLM_PYPTO_FLAGS": f"{flag},fused_gate_up_silu"}, max_tokens=16)
           for flag in ("native_attn_prologue", "native_decoder_layer")}
    a, b = ([(r["text"], r["logprobs"]) for r in o["results"]] for o in out.values())
    assert a == b


@pytest.mark.slow
def test_native_decoder_layer_refuses_a_backend_without_it(tiny_w8a8, tmp_path):
    with pytest.raises(RuntimeError, match="flag native_decoder_layer needs the native CPU kernels"):
        run_generate(tiny_w8a8, str(tmp_path / "ref.json"), "--quantization", "pypto-a8w8", max_tokens=2,
                     env={"VLLM_PYPTO_FLAGS": "native_decoder_layer", "VLLM_PYPTO_BACKEND": "reference"})


@pytest.mark.slow
def test_native_decode_attention_needs_native_decoder_layer(tiny_w8a8, tmp_path):
    with pytest.raises(RuntimeError, match="flag native_decode_attention runs inside flag native_decoder_layer's op"):
        run_generate(tiny_w8a8, str(tmp_path / "alone.json"), "--quantization", "pypto-a8w8", max_tokens=2,
                     env={"VLLM_PYPTO_FLAGS": "native_decode_attention"})


@pytest.fixture(scope="module")
def golden(tiny_w8a8):
    return GoldenQwen3(tiny_w8a8)


@pytest.mark.parametrize("flag", FLAGS)
def test_flag_passes_the_golden_gate_and_changes_the_computation(flag, tiny_w8a8, out_w8a8, golden, tmp_path):
    out = run_generate(tiny_w8a8, str(tmp_path / f"{flag}.json"), "--quantization", "pypto-a8w8",
                       env={"VLLM_PYPTO_FLAGS": flag})
    for n in (16, 48):
        check(gate(golden, out["results"], n))
    default = [r["logprobs"] for r in out_w8a8["results"]]
    assert [r["logprobs"] for r in out["results"]] != default, f"{flag} computed exactly the default path"


@pytest.mark.slow
def test_flag_via_additional_config(tiny_w8a8, out_w8a8, tmp_path):
    """vLLM's --additional-config reaches the model class too (not only the environment)."""
    out = run_generate(tiny_w8a8, str(tmp_path / "ac.json"), "--quantization", "pypto-a8w8",
                       "--additional-config", json.dumps({"pypto_flags": ["fused_qk_norm_rope"]}), max_tokens=16)
    env = run_generate(tiny_w8a8, str(tmp_path / "env.json"), "--quantization", "pypto-a8w8",
                       env={"VLLM_PYPTO_FLAGS": "fused_qk_norm_rope"}, max_tokens=16)
    assert [r["logprobs"] for r in out["results"]] == [r["logprobs"] for r in env["results"]]


def test_guardrail_flag_fails_the_quality_gate(tiny_w8a8, golden, tmp_path):
    """The check must catch the upstream regression (a batched Q RoPE that is not equivalent)."""
    out = run_generate(tiny_w8a8, str(tmp_path / "broken.json"), "--quantization", "pypto-a8w8",
                       env={"VLLM_PYPTO_FLAGS": "guardrail_broken_q_rope", "VLLM_PYPTO_ALLOW_TEST_FLAGS": "1"},
                       max_tokens=16)
    rep = gate(golden, out["results"], 16)
    print(f"\nguardrail: {len(rep['violations'])} violations, mean|dlogprob| {rep['mean_dlp']:.3f}, "
          f"max {rep['max_dlp']:.3f}")
    assert rep["violations"] or rep["mean_dlp"] > MEAN_TOL or rep["max_dlp"] > MAX_TOL, rep
