"""The benchmark tools (benchmarks/): their config grammar, the quality gate's decisions,
and each script end to end on the tiny checkpoint, run as a user runs it (a subprocess
with real engines, servers, `vllm bench serve` and lm-eval)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import configs  # noqa: E402
import quality  # noqa: E402
from accuracy import prediction  # noqa: E402
from linear import limit_ms  # noqa: E402
from vllm_pypto import flags  # noqa: E402
from vllm_pypto.kernels.select import cpu_isa_flags  # noqa: E402

ENV = {"VLLM_PYPTO_ALLOW_TEST_FLAGS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
GUARDRAIL = "pypto-a8w8+guardrail_broken_q_rope"


def run_script(name: str, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args], cwd=ROOT,
                          env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout)


def only_json(folder) -> dict:
    (name,) = [n for n in os.listdir(folder) if n.endswith(".json")]
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


# ---- the config grammar -------------------------------------------------------------------

def test_config_grammar():
    c = configs.parse("pypto-a8w8:w8a8@reference+avx2+vllm-model+deferred_rms+fused_gate_up_silu")
    assert (c.method, c.fmt, c.backend, c.flags, c.mods) == (
        "pypto-a8w8", "w8a8", "reference", ("deferred_rms", "fused_gate_up_silu"), ("avx2", "vllm-model"))
    assert c.env == {"VLLM_PYPTO_BACKEND": "reference", flags.ENV: "deferred_rms,fused_gate_up_silu",
                     "VLLM_PYPTO_CPU_ISA": "avx2", "VLLM_PYPTO_MODEL": "vllm"}
    assert c.serve_args() == ["--quantization", "pypto-a8w8"]
    assert configs.parse("ct").fmt == "w8a8" and configs.parse("ct").serve_args() == []
    assert configs.parse("bf16").quantization is None
    assert configs.parse("ct+allcores").env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    for bad, msg in [("pypto-a8w8+no_such_flag", "no_such_flag"), ("fp8", "method"), ("ct:bf16", "format"),
                     ("bf16+deferred_rms", "pypto-a8w8 only"), ("ct+avx2", "pypto-a8w8 only")]:
        with pytest.raises(ValueError, match=msg):
            configs.parse(bad)


def test_flag_combinations_cover_every_offered_flag():
    combos = configs.flag_combinations()
    offered = configs.offered_flags()
    assert combos[0] == "pypto-a8w8" and "guardrail_broken_q_rope" not in offered
    assert all(f"pypto-a8w8+{f}" in combos for f in offered)
    experimental = [f for f in offered if flags.FLAGS[f].status == "experimental"]
    assert "pypto-a8w8" + "".join("+" + f for f in experimental) in combos
    assert len(configs.flag_combinations(all_subsets=True)) == 2 ** len(offered)


# ---- the quality gate's logic -----------------------------------------------------------

def test_repetition_detector():
    loop = [5, 6, 7] * 16
    assert quality.looping(loop) and quality.longest_repeat(loop) == 45
    assert quality.distinct(loop) == pytest.approx(3 / 47)
    fresh = list(range(48))
    assert not quality.looping(fresh) and quality.longest_repeat(fresh) == 0 and quality.distinct(fresh) == 1.0
    # a phrase said twice is not a loop; the same phrase to the end is
    assert not quality.looping(list(range(24)) + list(range(24)))
    assert quality.looping(list(range(20)) + [1, 2, 3, 4] * 7)


def _step(top: dict[int, float]) -> dict:
    return {str(t): lp for t, lp in top.items()}


def test_margin_rule_separates_near_ties_from_confident_steps():
    # reference: 3 greedy steps with margins 0.05 (near-tie), 2.0 (sure), 2.0
    ref = {"token_ids": [1, 2, 3], "logprobs": [_step({1: -0.70, 9: -0.75}), _step({2: -0.1, 9: -2.1}),
                                                _step({3: -0.1, 9: -2.1})]}
    gate = SimpleNamespace(margin=1.0, min_agreement=0.5, max_mean_dlp=0.5)
    # noise: the near-tie flips, the sure steps hold
    noisy = quality.compare(ref, {"token_ids": [9, 2, 3]}, [{"rank": 2, "logprob": -0.8}, {"rank": 1, "logprob": -0.1},
                                                            {"rank": 1, "logprob": -0.12}], 3, gate.margin)
    assert noisy["first_divergence"] == 0 and noisy["margin_at_divergence"] == pytest.approx(0.05)
    assert noisy["violations"] == [] and quality.judge([noisy], gate)["passed"]
    # a bug: a sure step overturned
    bug = quality.compare(ref, {"token_ids": [1, 9, 9]}, [{"rank": 1, "logprob": -0.7}, {"rank": 3, "logprob": -3.0},
                                                          {"rank": 1, "logprob": -0.1}], 3, gate.margin)
    verdict = quality.judge([bug], gate)
    assert [v["step"] for v in bug["violations"]] == [1] and not verdict["passed"]
    assert "overturned" in verdict["reasons"][0]
    # a new loop fails even when the logprobs agree
    looped = dict(noisy, repetition={"looping": True}, ref_repetition={"looping": False})
    assert quality.judge([looped], gate)["reasons"] == ["1 prompts loop where the reference does not (allowed 0)"]


def test_prediction_reads_lm_eval_samples():
    mc = {"filtered_resps": [["-4.0", "False"], ["-1.5", "True"], ["-9", "False"]]}
    gen = {"filtered_resps": ["[invalid]"], "resps": [[" forty two"]]}
    assert prediction(mc) == 1 and prediction(gen) == " forty two"


def test_linear_limit_is_the_slower_of_memory_and_compute():
    # 5120x5120 int8 at 20 GB/s, 10 TOPS: one row waits on memory, 2048 rows on compute
    row = {"N": 5120, "K": 5120, "isa": "amx"}
    peak = {"amx": 10000.0, "avx2": 100.0}
    assert limit_ms({**row, "M": 1}, 20.0, peak) == pytest.approx(1e3 * 5120 * 5120 / 20e9)
    assert limit_ms({**row, "M": 2048}, 20.0, peak) == pytest.approx(1e3 * 2 * 2048 * 5120 * 5120 / 10e12)
    # a path is held to its own peak; a peer (no isa) to the best one
    assert limit_ms({**row, "M": 2048, "isa": "avx2"}, 20.0, peak) == pytest.approx(1e3 * 2 * 2048 * 5120 * 5120 / 1e11)
    assert limit_ms({**row, "M": 2048, "isa": ""}, 20.0, peak) == pytest.approx(1e3 * 2 * 2048 * 5120 * 5120 / 10e12)
    assert limit_ms({**row, "M": 2048}, 20.0, {}) == pytest.approx(1e3 * 5120 * 5120 / 20e9)  # no peak measured


def test_linear_interleave_times_warm_bursts_not_one_cold_call():
    """A method whose first call after another method's is slow (threads asleep, cold TLB) is
    timed on the calls that follow, as a kernel streams in a model."""
    import time

    import torch
    from linear import interleaved

    last = []

    def method(name):
        def run(x, p):
            time.sleep(0.001 if last[-1:] == [name] else 0.03)
            last.append(name)
        return run

    meths = {n: (lambda w, s: w, method(n), 1, "") for n in ("a", "b")}
    rows = interleaved("t", 8, 64, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), meths, [1], rounds=3,
                       burst_s=0.02, rotate_bytes=1024)
    assert [r["method"] for r in rows] == ["a", "b"]
    for r in rows:
        assert r["calls_per_burst"] > 1 and r["ms"] < 10, r  # one call after the other method's: 30 ms


def test_serving_throughput_limit_is_the_slower_of_memory_and_compute():
    from serving import VOCAB, SHAPES, throughput_limit
    s = SHAPES["1.7B"]
    nbytes = s.linear_params() + VOCAB * s.hidden
    # batch 1 waits on memory: one token per pass over the weights
    assert throughput_limit("1.7B", nbytes, 1, 128, 64, 30.0, 800.0) == pytest.approx(30e9 / nbytes)
    # 16 in flight wait on compute: 128 prompt + 63 output tokens through the linears, 64 through the head
    macs = 191 * s.linear_params() + 64 * VOCAB * s.hidden
    assert throughput_limit("1.7B", nbytes, 16, 128, 64, 30.0, 800.0) == pytest.approx(800e9 * 64 / (2 * macs))
    # 1.7B at 783 GOPS: under 90 tok/s, below 8x a 12 tok/s batch-1 rate, whatever the bandwidth
    assert throughput_limit("1.7B", nbytes, 16, 128, 64, 1e6, 783.0) < 90


def test_serving_prefill_floor_uses_the_peak_of_the_rows_isa_path():
    from serving import VOCAB, SHAPES, prefill_floor_ms, row_peak
    s = SHAPES["0.6B"]
    # 128 prompt tokens through every linear, the last through the head: 113 G int8 ops
    ops = 2 * (128 * s.linear_params() + VOCAB * s.hidden)
    assert prefill_floor_ms("0.6B", 128, 262.0) == pytest.approx(ops / 262e9 * 1e3)
    assert 400 < prefill_floor_ms("0.6B", 128, 262.0) < 450  # AVX2 at 262 GOPS: over 296 ms x 1.1
    peaks = {"avx512": 900.0, "avx2": 262.0}  # best path first, as linear.isa_paths lists them
    assert row_peak({"config": "pypto-a8w8:w8a8+avx2+int8_lm_head"}, peaks) == 262.0
    assert row_peak({"config": "pypto-a8w8:w8a8"}, peaks) == 900.0
    assert row_peak({"config": "ct"}, peaks) == 900.0  # oneDNN picks the CPU's best
    assert row_peak({"config": "llama.cpp-server", "peer": True}, peaks) == 900.0
    assert row_peak({"config": "pypto-a8w8:w8a8"}, {}) is None  # no native build: no floor


# ---- the scripts end to end on the tiny checkpoint -----------------------------------------

def test_quality_script_passes_the_default_and_fails_the_guardrail(tiny_bf16, tmp_path):
    r = run_script("quality.py", "--model", tiny_bf16, "--configs", f"pypto-a8w8,{GUARDRAIL}", "--out", str(tmp_path))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    rep = only_json(tmp_path)
    assert rep["failed"] == [GUARDRAIL]
    assert any("\u4e00" <= ch <= "\u9fff" for ch in "".join(rep["prompts"]))  # zh and en prompts
    assert "The capital of France is" in rep["prompts"] and "介绍一下北京故宫" in rep["prompts"]
    ok, bad = rep["configs"]["pypto-a8w8"]["lengths"], rep["configs"][GUARDRAIL]["lengths"]
    assert set(ok) == {"16", "48"}
    for n in ("16", "48"):
        assert ok[n]["summary"]["passed"] and ok[n]["summary"]["violations"] == 0
        assert len(ok[n]["prompts"][0]["tokens"]) == int(n)
    assert bad["48"]["summary"]["violations"] > 0 and not bad["48"]["summary"]["passed"]
    assert bad["48"]["summary"]["tf_top1"] < ok["48"]["summary"]["tf_top1"]
    md = (tmp_path / [n for n in os.listdir(tmp_path) if n.endswith(".md")][0]).read_text()
    assert "| pypto-a8w8 | 48 |" in md and "FAIL" in md


def test_quality_script_refuses_a_quantized_reference(tiny_w8a8, tmp_path):
    r = run_script("quality.py", "--model", tiny_w8a8, "--out", str(tmp_path), timeout=120)
    assert r.returncode == 2 and "--reference" in r.stderr


@pytest.mark.skipif(not {"avx2", "fma"} <= set(cpu_isa_flags()), reason="the kernel needs AVX2+FMA")
def test_attention_script_sets_the_kernels_side_by_side(tmp_path):
    """benchmarks/attention.py: a row per (sequences, context), each kernel timed in every round,
    the per-round ratio, the bound at the run's bandwidth, and the two kernels' outputs within
    bf16 rounding of each other (a wrong block table or layout would differ by O(1)), on the cache
    layout vLLM-CPU packs on this CPU."""
    import torch

    out = tmp_path / "results"
    r = run_script("attention.py", "--shape", "tiny", "--batches", "1,3", "--ctx", "5,300", "--rounds", "2",
                   "--block-size", "32", "--out", str(out), "--tag", "t")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = only_json(out)
    assert [(row["batch"], row["ctx"]) for row in rep["rows"]] == [(1, 5), (1, 300), (3, 5), (3, 300)]
    for row in rep["rows"]:
        assert len(row["ours_us_all"]) == len(row["vllm_us_all"]) == 2 and row["ours_us"] > 0 < row["vllm_us"]
        assert row["ratio"]["min"] <= row["ratio"]["median"] <= row["ratio"]["max"]
        assert 0 < row["bound_us"] and row["max_abs_diff"] < 2 ** -5
        assert row["interior"] == ("amx" if torch.cpu._is_amx_tile_supported() else "vec")  # vLLM-CPU's own layout
    assert rep["cpu"] and len(rep["dram_read_gbs"]) == 2
    assert [n for n in os.listdir(out) if n.endswith(".md")][0].endswith("-attention-t.md")


def test_sampler_script_sets_the_three_ways_side_by_side(tmp_path):
    """benchmarks/sampler.py: vLLM's filter and draw, the flag with torch.topk and (where our library
    runs) the flag's native path, every way timed in every round and drawing the same tokens."""
    out = tmp_path / "results"
    r = run_script("sampler.py", "--batches", "1,3", "--vocab", "5003", "--rounds", "3", "--out", str(out),
                   "--tag", "t")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = only_json(out)
    assert [row["batch"] for row in rep["rows"]] == [1, 3]
    native = {"avx2", "fma"} <= set(cpu_isa_flags())
    for row in rep["rows"]:
        ways = ["vllm", "flag-topk"] + (["flag-native"] if native else [])
        assert sorted(row["ms_all"]) == sorted(ways) and all(len(t) == 3 for t in row["ms_all"].values())
        if native:
            q = row["native_over_vllm"]
            assert q["min"] <= q["median"] <= q["max"]
    assert [n for n in os.listdir(out) if n.endswith(".md")][0].endswith("-sampler-t.md")


@pytest.mark.slow  # two servers at once (~2 min): make test-slow, which CI runs
def test_tpot_script_pairs_the_configs_round_by_round(tmp_path):
    """--paired: the servers up at once, the requests round-robin; every round's TPOT against the
    first config's in the same round, and the results file names the machine and the command.
    Where the optional peer is installed (CI installs it), llama.cpp's server is one of them and
    decodes every requested token."""
    out = tmp_path / "results"
    peer = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("gguf") is not None
    configs = "pypto-a8w8:w8a8,pypto-a8w8:w8a8+int8_lm_head" + (",llama.cpp-server" if peer else "")
    r = run_script("tpot.py", "--shape", "tiny", "--paired", "--requests", "3", "--max-tokens", "6", "--configs",
                   configs, "--checkpoints", str(tmp_path / "ckpt"), "--out", str(out), "--tag", "ab")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = only_json(out)
    assert [n for n in os.listdir(out) if n.endswith(".json")][0].endswith("-tpot-tiny-paired-ab.json")
    first, second, *served_peer = rep["rows"]
    if peer:
        from serving import q8_0_bytes
        (llama,) = served_peer
        assert llama["tokens"] == 6 and len(llama["tpot_ms"]) == 3 and llama["paired_ratio"]["min"] > 0
        assert llama["bytes_per_token"] == q8_0_bytes("tiny")
    assert rep["paired"] and len(first["tpot_ms"]) == len(second["tpot_ms"]) == 3
    # a round whose text came in one chunk has no TPOT (NaN: a tiny model on a fast CPU) and drops out
    assert first["paired_ratio"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    ratios = [t / b for t, b in zip(second["tpot_ms"], first["tpot_ms"]) if math.isfinite(t / b)]
    assert ratios and second["paired_ratio"]["median"] == pytest.approx(statistics.median(ratios))
    assert second["paired_ratio"]["min"] > 0
    ttft = sorted(t / b for t, b in zip(second["ttft_ms"], first["ttft_ms"]))  # TTFT too, round by round
    assert second["paired_ttft_ratio"]["median"] == pytest.approx(ttft[1]) and len(second["ttft_ms"]) == 3
    g = rep["round_gbs"]
    assert len(g) == 3 and min(g) > 0
    for row in rep["rows"]:  # TPOT over the bound round by round, at the probes beside each round
        want = [t / (row["bytes_per_token"] / (x * 1e9) * 1e3) for t, x in zip(row["tpot_ms"], g) if math.isfinite(t)]
        assert row["bound_ratio_per_round"]["median"] == pytest.approx(statistics.median(want))
    md = (out / [n for n in os.listdir(out) if n.endswith(".md")][0]).read_text()
    assert md.startswith(rep["cpu"]) and "round-robin" in md and "per round:" in md and "between rounds" in md
    assert rep["gap_s"] == 1.5 and "1.5 s apart" in md  # the default quiet before each request


@pytest.mark.slow  # three servers and `vllm bench serve` (~3 min): make test-slow, which CI runs
def test_serving_script_records_bench_serve_metrics(tmp_path):
    """Ours and, where the optional peer is installed (CI installs it), llama.cpp's server driven
    by the same client, and llama.cpp in process; each row against the bound of its own bytes."""
    out = tmp_path / "results"
    peer = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("gguf") is not None
    r = run_script("serving.py", "--shapes", "tiny", "--configs", "pypto-a8w8:w8a8+int8_lm_head", "--concurrency",
                   "1,2", "--num-prompts", "2", "--input-len", "16", "--output-len", "8",
                   "--checkpoints", str(tmp_path / "ckpt"), "--out", str(out), *(["--llama-cpp"] if peer else []))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = only_json(out)
    (sh,) = rep["shapes"]
    row, *served_peer = sh["rows"]
    assert min(sh["dram_read_gbs"]) > 0 and row["bound_ms"] > 0 and row["tpot_vs_first"] == 1.0
    for x in [row, *served_peer]:
        assert set(x["runs"]) == {"1", "2"}
        for conc, m in x["runs"].items():
            assert m["completed"] == max(2, 2 * int(conc)) and m["failed"] == 0
            for metric in serving_metrics():
                assert m[metric] is not None and m[metric] > 0, (x["config"], metric)
        assert x["tpot_vs_bound"] == pytest.approx(x["runs"]["1"]["median_tpot_ms"] / x["bound_ms"])
        assert x["runs"]["1"]["tok_s_vs_conc1"] == 1.0 and x["runs"]["2"]["tok_s_vs_conc1"] > 0
        # an int8 row's throughput never beats the limit measured in the same run
        assert all(m["output_throughput"] < m["tok_s_limit"] for m in x["runs"].values()), x["runs"]
    assert sh["int8_peak_gops"] > 0
    from serving import q8_0_bytes, weight_bytes
    assert row["bytes_per_step"] == weight_bytes("tiny", "w8a8", int8_head=True) < weight_bytes("tiny", "w8a8")
    if peer:
        (server,) = served_peer
        assert server["config"] == "llama.cpp server Q8_0" and server["bytes_per_step"] == q8_0_bytes("tiny")
        # every request decoded its whole --output-len: the banned end-of-generation tokens held
        for m in server["runs"].values():
            assert m["total_output_tokens"] >= 0.9 * 8 * m["completed"], m
        assert set(row["tpot_vs_peers"]) == {"llama.cpp Q8_0", "llama.cpp server Q8_0"}
    assert {n.rsplit(".", 1)[1] for n in os.listdir(out)} == {"json", "md", "png"}


@pytest.mark.slow  # one in-process engine (~1.5 min): make test-slow, which CI runs
def test_profile_step_breaks_a_decode_step_down(tmp_path):
    """Every part of a decode step is found (our GEMMs, the int8 head, vLLM's attention and cache
    write, our row ops, the sampler, the engine), and the parts add up to the profiled step, not more."""
    r = run_script("profile_step.py", "--shape", "tiny", "--configs", "pypto-a8w8:w8a8+int8_lm_head",
                   "--batches", "1,2", "--steps", "4", "--checkpoints", str(tmp_path / "ckpt"), "--out", str(tmp_path),
                   "--tag", "t")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = only_json(tmp_path)
    (row,) = rep["rows"]
    assert set(row["batches"]) == {"1", "2"}
    assert row["sampling"] == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}  # as served: generation_config
    for m in row["batches"].values():
        assert m["profiled_steps"] >= 2 and m["step_ms_unprofiled"] > 0
        assert 0.9 * m["step_ms_profiled"] <= sum(m["parts_ms"].values()) <= 1.0001 * m["step_ms_profiled"], m
        assert all(m["parts_ms"][p] > 0 for p in ("linears", "lm_head", "attention", "small ops", "sampler", "engine")), m
        ops = {(p, name) for p, name, _ in m["top_ops_ms"]}
        assert ("linears", "pypto_cpu::a8w8_linear_q") in ops and ("attention", "_C::cpu_attention_with_kv_cache") in ops
        assert m["bytes"]["lm_head"] == 151936 * 256  # int8 head: one byte a weight
    assert {n.rsplit(".", 1)[1] for n in os.listdir(tmp_path) if "profile" in n} == {"json", "md", "png"}
    assert all(n.rsplit(".", 1)[0].endswith("-profile-tiny-t") for n in os.listdir(tmp_path) if "profile" in n)


@pytest.mark.slow  # one in-process engine (~1 min): make test-slow, which CI runs
def test_profile_step_breaks_a_prefill_down(tmp_path):
    """--prefill N profiles what a request's first token waits on: the prefill of an N-token prompt,
    whose linears run on N rows (the M = N path of our GEMMs, not the decode GEMV)."""
    r = run_script("profile_step.py", "--shape", "tiny", "--configs", "pypto-a8w8:w8a8", "--prefill", "40",
                   "--batches", "1", "--steps", "3", "--greedy", "--checkpoints", str(tmp_path / "ckpt"),
                   "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = only_json(tmp_path)
    assert rep["prefill_tokens"] == 40 and "prefill of 40-token prompts" in r.stdout
    m = rep["rows"][0]["batches"]["1"]
    assert m["profiled_steps"] == 3 and m["context_tokens"] == 40
    assert 0.9 * m["step_ms_profiled"] <= sum(m["parts_ms"].values()) <= 1.0001 * m["step_ms_profiled"], m
    assert ("linears", "pypto_cpu::a8w8_linear_q") in {(p, name) for p, name, _ in m["top_ops_ms"]}
    assert m["parts_ms"]["small ops"] > 0 and m["parts_ms"]["attention"] > 0
    assert all(n.rsplit(".", 1)[0].endswith("-profile-tiny-prefill40") for n in os.listdir(tmp_path) if "profile" in n)


def serving_metrics() -> list[str]:
    from serving import METRICS, STATS, THROUGHPUT
    return [f"{s}_{m}_ms" for m in METRICS for s in STATS] + list(THROUGHPUT)


@pytest.mark.slow  # two servers and lm-eval's local tasks (~7 min): make test-slow, which CI runs
def test_accuracy_script_runs_lm_eval_and_sees_the_guardrail(tiny_bf16, tmp_path):
    r = run_script("accuracy.py", "--model", tiny_bf16, "--configs", f"pypto-a8w8,{GUARDRAIL}", "--limit", "12",
                   "--min-agreement", "0.3", "--out", str(tmp_path))
    rep = only_json(tmp_path)
    rows = {(name, x["task"]): x for name, xs in rep["configs"].items() for x in xs}
    print("\n" + "\n".join(f"{k}: {v['metric']} {v['config']:.3f} (ref {v['reference']:.3f}), "
                           f"agreement {v['agreement']:.3f}" for k, v in rows.items()))
    assert len(rows) == 2 * 5 and all(x["docs"] == 12 for x in rows.values())
    for t in ("pypto_arith_en", "pypto_arith_zh", "pypto_capitals_en", "pypto_capitals_zh"):
        assert rows[("pypto-a8w8", t)]["agreement"] >= 0.9  # int8 noise does not move a 4-way choice
    gen = "pypto_arith_gen_en"
    assert rows[(GUARDRAIL, gen)]["agreement"] < 0.3 <= rows[("pypto-a8w8", gen)]["agreement"]
    assert r.returncode == 1 and rep["failed"] and all(f.startswith(GUARDRAIL) for f in rep["failed"])


def test_llama_cpp_peer_runs_the_same_model(tiny_bf16, tmp_path):
    """The peer's GGUF is our checkpoint, not just the same shapes: llama.cpp's logits on a
    Q8_0 copy track the independent golden's bf16 logits at every position (a wrong RoPE
    pairing or tensor mapping would not). Skipped where the optional peer is not installed
    (scripts/install_peers.sh, which CI runs)."""
    pytest.importorskip("gguf")
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np
    from golden_qwen3 import GoldenQwen3
    from llama_cpp_peer import measure, write_gguf

    path = write_gguf(tiny_bf16, str(tmp_path / "tiny-q8_0.gguf"))
    ids = [9707, 11, 1879, 374, 264, 1273, 315, 279, 6366, 1849]
    # First in a child: a llama.cpp built for another CPU dies with SIGILL, which would kill pytest.
    probe = subprocess.run([sys.executable, "-c", "import sys, llama_cpp\n"
                            "llama_cpp.Llama(sys.argv[1], n_ctx=16, n_threads=2, verbose=False).eval([9707, 11])",
                            path], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, (f"llama.cpp died (status {probe.returncode}; -4 is SIGILL: built for another "
                                   f"CPU, rerun scripts/install_peers.sh here):\n{probe.stderr[-2000:]}")
    llm = llama_cpp.Llama(path, n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    llm.eval(ids)
    peer_logits = np.array(llm.scores[: len(ids)])
    llm.close()
    golden = GoldenQwen3(tiny_bf16, a8w8=False).logits(ids).numpy()
    for i in range(len(ids)):
        assert np.corrcoef(peer_logits[i], golden[i])[0, 1] > 0.995, i
        assert peer_logits[i].argmax() == golden[i].argmax(), i
    timing = measure(path, tokens=4, prompt_tokens=8)
    assert timing["tpot_ms"] > 0 and timing["tokens"] == 4


@pytest.mark.parametrize("cpu,on,off", [
    ("fpu sse4_2 avx avx2 fma f16c bmi2 sha_ni", ["AVX2", "FMA", "F16C"], ["AVX512", "AVX512_VNNI", "AVX_VNNI"]),
    ("sse4_2 avx avx2 fma f16c bmi2 avx_vnni avx512f avx512cd avx512bw avx512dq avx512vl avx512_vnni amx_int8 "
     "amx_tile", ["AVX2", "AVX512", "AVX512_VNNI", "AVX_VNNI"], ["AVX512_BF16"]),
    ("sse4_2 avx avx2 fma f16c avx512f", ["AVX2"], ["AVX512", "AVX512_VNNI"]),  # F alone: not the set -mavx512* needs
])
def test_llama_cpp_is_built_for_the_cpu_it_runs_on(tmp_path, cpu, on, off):
    """An AVX2-only EPYC (Zen 3) gets no AVX-512 (SIGILL there); a Xeon gets its extensions; AMX is
    off everywhere (GCC builds of llama.cpp's AMX path die at the first tile instruction)."""
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {cpu}\n")
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "llama_cpp_cmake_args.sh"), str(info)],
                         capture_output=True, text=True, check=True).stdout.split()
    args = dict(a[2:].split("=") for a in out)
    assert args["GGML_NATIVE"] == "OFF" and all(args[f"GGML_AMX_{x}"] == "OFF" for x in ("TILE", "INT8", "BF16"))
    assert args["LLAVA_BUILD"] == "OFF"  # the multimodal library: never used, minutes of CI
    assert all(args[f"GGML_{x}"] == "ON" for x in on), args
    assert all(args[f"GGML_{x}"] == "OFF" for x in off), args


def test_baseline_makes_the_bars_relative():
    """On a deep random model int8 noise alone overturns confident steps (vLLM's own W8A8
    too); against a baseline A8W8, matching its figures passes and exceeding them fails."""
    gate = SimpleNamespace(margin=1.0, min_agreement=0.8, max_mean_dlp=0.25)
    per = [{"tf_top1": 0.96, "token_agreement": 0.5, "mean_dlp": 0.4, "max_dlp": 20.0, "max_overturned_margin": 5.0,
            "violations": [{}] * 3, "first_divergence": 0, "repetition": {"looping": False},
            "ref_repetition": {"looping": False}}]
    base = quality.judge(per, gate)
    assert not base["passed"] and len(base["reasons"]) == 2  # absolute bars: violations and mean dlogprob
    assert quality.judge(per, gate, base)["passed"]
    assert quality.judge([dict(per[0], violations=[{}] * 7)], gate, base)["passed"]  # 3 + 2 sqrt(3), rounded up
    worse = [dict(per[0], violations=[{}] * 8, tf_top1=0.9)]
    reasons = quality.judge(worse, gate, base)["reasons"]
    assert len(reasons) == 2 and "allowed 7" in reasons[0] and "0.940" in reasons[1]


@pytest.mark.slow  # three builds of the AVX2 kernels without torch (~1.5 min): make test-slow, which CI runs
def test_gemm_ab_times_two_builds_and_refuses_changed_bits(tmp_path):
    """benchmarks/gemm_ab.py builds the GEMM from two sources and runs them in turn. The same
    source twice: one row per (shape, M), equal output bits. A copy whose plain-AVX2 sums are
    doubled (vpmaddwd by 2 instead of 1): the script names the difference and exits non-zero."""
    args = ["--isa", "avx2", "--model", "tiny", "--shapes", "qkv", "--ms", "1,5", "--rounds", "2", "--seconds", "0.05"]
    same = run_script("gemm_ab.py", *args, "--base", os.path.join(ROOT, "csrc"), "--out", str(tmp_path / "same"))
    assert same.returncode == 0, same.stderr[-3000:]
    rows = only_json(tmp_path / "same")["rows"]
    assert [(r["shape"], r["M"]) for r in rows] == [("qkv", 1), ("qkv", 5)]
    assert all(r["same_output"] and r["A_ms"] > 0 and r["B_ms"] > 0 for r in rows)
    changed = tmp_path / "csrc"
    shutil.copytree(os.path.join(ROOT, "csrc"), changed)
    inc = changed / "gemm256.inc"
    src = inc.read_text()
    assert src.count("_mm256_set1_epi16(1)") == 2  # the GEMM's and the peak loop's
    inc.write_text(src.replace("_mm256_set1_epi16(1)", "_mm256_set1_epi16(2)"))
    bad = run_script("gemm_ab.py", *args, "--base", str(changed), "--out", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "outputs differ" in bad.stderr
    assert not any(r["same_output"] for r in only_json(tmp_path / "bad")["rows"])


@pytest.mark.slow  # two builds (~1 min)
def test_gemm_ab_runs_the_amx_tiles_where_the_cpu_has_them(tmp_path):
    """--isa amx times the AMX path (M = 40: three row blocks, the prefetching kind) on a CPU with
    AMX-INT8, with the same bits from both builds; elsewhere the driver refuses it by name."""
    args = ["--isa", "amx", "--model", "tiny", "--shapes", "qkv,down", "--ms", "40", "--rounds", "1",
            "--seconds", "0.05", "--base", os.path.join(ROOT, "csrc"), "--out", str(tmp_path)]
    res = run_script("gemm_ab.py", *args)
    if "amx_int8" not in cpu_isa_flags():
        assert res.returncode != 0 and "cannot run amx" in res.stderr
        return
    assert res.returncode == 0, res.stderr[-3000:]
    rows = only_json(tmp_path)["rows"]
    assert [(r["shape"], r["M"]) for r in rows] == [("qkv", 40), ("down", 40)]
    assert all(r["same_output"] and r["B_GOPS"] > 0 for r in rows)
