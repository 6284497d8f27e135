"""vLLM-CPU's top-k/top-p filter and Gumbel draw over a Qwen3 vocabulary, three ways side by side
in one run: vLLM's own (a sort of every row, the draw over every logit), flag fast_top_k_top_p
with torch.topk and vLLM's draw (the flag where our library is not built), and the flag with
csrc/sampling.cpp (one pass for the candidates, the draw on them alone).

    python benchmarks/sampler.py --batches 1,16

Each round runs the three in turn (rotating which goes first) on a fresh copy of the same fp32
logits, with Qwen3's defaults (top_k 20, top_p 0.95) and one seed a row, and checks that all
three draw the same tokens. Reported: the median time of each (the copy of the logits included,
as the sampler's own fp32 copy is) and the per-round ratio of the native path to the other two.
Writes results/<date>-<machine>-sampler[-tag].{json,md}.
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
from vllm_pypto import sampling  # noqa: E402
from vllm_pypto.kernels.select import cpu_isa_flags, cpu_model  # noqa: E402

WAYS = ("vllm", "flag-topk", "flag-native")


def draw(way: str, logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One filter + draw, as vLLM-CPU's TopKTopPSampler.forward_cpu runs it (logits are updated in place)."""
    from vllm.v1.sample.ops import topk_topp_sampler as s

    vllm_draw = torch.ops._C.fused_gumbel_argmax
    if way == "vllm":
        return vllm_draw(s.apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True), seeds)
    native = sampling._native
    if way == "flag-topk":
        sampling._native = lambda: False
    try:
        kept = sampling.top_k_top_p(logits, k, p, s.apply_top_k_top_p_pytorch)
        kept = s.apply_top_k_top_p_pytorch(logits, k, p) if kept is None else kept
        return sampling.gumbel_argmax(kept, seeds, vllm_draw)
    finally:
        sampling._native = native


def run_batch(batch: int, vocab: int, rounds: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=g) * 3
    k, p = torch.full((batch,), 20), torch.full((batch,), 0.95)
    ways = WAYS if sampling._native() else WAYS[:2]
    times = {w: [] for w in ways}
    for r in range(rounds + 1):  # round 0 warms up
        seeds = torch.randint(0, 2**31, (batch,), generator=g)
        tokens = {}
        for w in ways[r % len(ways):] + ways[:r % len(ways)]:
            t0 = time.perf_counter()
            tokens[w] = draw(w, x.clone(), k, p, seeds)
            if r:
                times[w].append((time.perf_counter() - t0) * 1e3)
        assert all(torch.equal(tokens[w], tokens["vllm"]) for w in ways), f"the ways drew different tokens: {tokens}"
    row = {"batch": batch, "vocab": vocab, "ms_all": times, "ms": {w: statistics.median(t) for w, t in times.items()}}
    if "flag-native" in ways:
        for w in WAYS[:2]:
            q = [a / b for a, b in zip(times["flag-native"], times[w])]
            row[f"native_over_{w}"] = {"median": statistics.median(q), "min": min(q), "max": max(q)}
    return row


def markdown(rep: dict) -> str:
    lines = [f"{rep['cpu']} ({rep['isa_flags']}), {rep['threads']} threads, {rep['date']}; `{rep['command']}`; "
             f"ms per filter + draw (top_k 20, top_p 0.95, fp32 logits), median of {rep['rounds']} rounds", "",
             "| batch | vLLM ms | flag, torch.topk ms | flag, native ms | native / vLLM per round | "
             "native / flag with topk per round |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rep["rows"]:
        ms = r["ms"]

        def ratio(key):
            q = r.get(key)
            return f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f})" if q else "n/a"
        native = f"{ms['flag-native']:.3f}" if "flag-native" in ms else "n/a (not built)"
        lines.append(f"| {r['batch']} | {ms['vllm']:.3f} | {ms['flag-topk']:.3f} | {native} | "
                     f"{ratio('native_over_vllm')} | {ratio('native_over_flag-topk')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16", help="rows of logits (sequences in the step)")
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen3's")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C from the build this CPU runs, as linear.py)

    rows = [run_batch(b, a.vocab, a.rounds) for b in map(int, a.batches.split(","))]
    rep = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(), "isa_flags": " ".join(cpu_isa_flags()),
           "threads": torch.get_num_threads(), "command": " ".join(["benchmarks/sampler.py", *sys.argv[1:]]),
           "rounds": a.rounds, "rows": rows}
    stem = report_file.write(a.out, "sampler" + (f"-{a.tag}" if a.tag else ""), rep, markdown(rep))
    print(markdown(rep))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
