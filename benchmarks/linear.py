"""A8W8 linear kernels side by side on a Qwen3 shape's linears (default 14B), with this
machine's DRAM read bandwidth and int8 compute peak measured in the same run.

    python benchmarks/linear.py                 # all shapes, M = 1 4 16 64 256
    python benchmarks/linear.py --shapes qkv --ms 1,16
    python benchmarks/linear.py --model 0.6B --ms 1         # the small shapes served end to end

Every method reads its weights from DRAM, not cache: each has its own set of weight copies
totalling well above the L3 size, and consecutive calls rotate through them. Methods, all
with bf16 activations in and bf16 out (per-token int8 quantization included where int8):
  ours        vllm_pypto native CPU kernels (AVX512-VNNI; AMX-INT8 from M = 4 where available)
  ours_vnni   the same kernels with AMX switched off (shown where AMX is available)
  int_mm      torch._int_mm + fp32 rescale (our reference backend)
  vllm_sgl    vLLM-CPU's int8_scaled_mm_with_quant (its W8A8 path on AMX CPUs)
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

from vllm_pypto.kernels import CpuNativeBackend, ReferenceBackend, native_cpu_status  # noqa: E402
from vllm_pypto.kernels.reference import quantize_weight_per_channel  # noqa: E402
from vllm_pypto.tools.shapes import SHAPES as QWEN3  # noqa: E402

ROTATE_BYTES = 1.5 * 2**30  # > 3x the 480 MiB L3 of this machine


def dram_read_gbs(seconds: float = 3.0) -> dict[str, float]:
    """Streaming read bandwidth over buffers rotating through 1.5 GiB: torch's sum, and (when
    built) our AVX-512 read probe, whose access pattern is the GEMV's. The limit is the max."""
    bufs = [torch.ones(64 * 2**20) for _ in range(6)]  # 6 x 256 MiB
    readers = {"torch.sum": lambda b: b.sum()}
    if native_cpu_status() is None:
        from vllm_pypto import _C
        readers["avx512 read probe"] = _C.read_probe
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


def int8_peak_gops() -> float | None:
    """Compute limit: int8 multiply-adds from registers on every thread (AMX tdpbusd where the
    kernels use it, else VNNI vpdpbusd), no memory traffic."""
    if native_cpu_status() is not None:
        return None
    from vllm_pypto import _C
    _C.int8_peak_gops(20000)  # warm-up: AMX permission, frequency
    return max(_C.int8_peak_gops(200000) for _ in range(3))


def methods() -> dict:
    out = {}
    if native_cpu_status() is None:
        be = CpuNativeBackend()
        out["ours"] = (lambda w, s: be.prepack(w, s), be.linear, 1)
        from vllm_pypto import _C
        if _C.isa() == "amx":
            def vnni_only(x, p):
                _C.set_amx(False)
                try:
                    return be.linear(x, p)
                finally:
                    _C.set_amx(True)
            out["ours_vnni"] = (lambda w, s: be.prepack(w, s), vnni_only, 1)
    ref = ReferenceBackend()
    out["int_mm"] = (lambda w, s: ref.prepack(w, s), ref.linear, 1)
    try:
        import vllm._custom_ops  # noqa: F401  registers torch.ops._C
        if torch.cpu._is_amx_tile_supported():
            out["vllm_sgl"] = (lambda w, s: (torch.ops._C.convert_weight_packed(w), s.float()),
                               lambda x, p: torch.ops._C.int8_scaled_mm_with_quant(x, p[0], p[1], None,
                                                                                     torch.bfloat16, True), 1)
    except Exception as e:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
        print(f"vLLM-CPU int8 ops unavailable: {e}", file=sys.stderr)
    out["bf16"] = (lambda w, s: (w.float() * s[:, None]).to(torch.bfloat16), lambda x, p: F.linear(x, p), 2)
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
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per (method, shape, M)")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    torch.manual_seed(0)
    probes = dram_read_gbs()
    bw = max(probes.values())
    peak = int8_peak_gops()
    print(f"DRAM read bandwidth (same run): {probes} GB/s -> limit {bw:.1f} GB/s, "
          f"{torch.get_num_threads()} threads; int8 peak from registers: {peak} GOPS", flush=True)
    ms = [int(m) for m in a.ms.split(",")]
    rows = []
    shapes = QWEN3[a.model].linears()  # 14B: the shapes
    for shape in a.shapes.split(","):
        N, K = shapes[shape]
        w, s = quantize_weight_per_channel(torch.randn(N, K))
        for name, (prep, fn, bpe) in methods().items():
            n_copies = max(2, int(ROTATE_BYTES // (N * K * bpe)) + 1)
            copies = [prep(w.clone(), s) for _ in range(n_copies)]
            for m in ms:
                x = torch.randn(m, K).to(torch.bfloat16)
                t = bench(fn, copies, x, a.min_time)
                row = {"shape": shape, "N": N, "K": K, "M": m, "method": name, "ms": t * 1e3,
                       "weight_GBs": N * K * bpe / t / 1e9, "GOPS": 2 * m * N * K / t / 1e9}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del copies
    report(rows, bw, peak, a.out, a.model)


def limit_ms(row: dict, bw: float, peak: float | None) -> float:
    """The fastest this GEMM can run here: its int8 weights read once from DRAM, or its
    multiply-adds at the peak rate, whichever takes longer."""
    compute = 2 * row["M"] * row["N"] * row["K"] / (peak * 1e9) if peak else 0.0
    return 1e3 * max(row["N"] * row["K"] / (bw * 1e9), compute)


def report(rows: list[dict], bw: float, peak: float | None, out_dir: str, model: str = "14B") -> None:
    by = {(r["shape"], r["M"], r["method"]): r for r in rows}
    lines = [f"Qwen3-{model} linear shapes. Limits measured in the same run: DRAM read bandwidth {bw:.1f} GB/s, "
             f"int8 peak {peak or 0:.0f} GOPS (multiply-adds from registers; {torch.get_num_threads()} threads, "
             f"{platform.processor() or platform.machine()}). limit ms = max(weight bytes / bandwidth, ops / peak): "
             "no kernel can beat it, so best other / limit is the most any kernel could gain over the best other "
             "int8 path.", "",
             "| shape | M | method | ms | weight GB/s | % of DRAM BW | GOPS | % of limit | ours vs best other int8 "
             "| limit vs best other int8 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (shape, m, method), r in by.items():
        others = [v["ms"] for (s2, m2, meth2), v in by.items()
                  if s2 == shape and m2 == m and meth2 in ("int_mm", "vllm_sgl")]
        limit = limit_ms(r, bw, peak)
        ours = method.startswith("ours") and others
        ratio = f"{min(others) / r['ms']:.2f}x" if ours else ""
        most = f"{min(others) / limit:.2f}x" if ours and method == "ours" else ""
        lines.append(f"| {shape} | {m} | {method} | {r['ms']:.3f} | {r['weight_GBs']:.1f} | "
                     f"{100 * r['weight_GBs'] / bw:.0f}% | {r['GOPS']:.0f} | {100 * limit / r['ms']:.0f}% | {ratio} "
                     f"| {most} |")
    text = "\n".join(lines)
    print("\n" + text)
    os.makedirs(out_dir, exist_ok=True)
    stamp = f"{time.strftime('%Y-%m-%d')}-{platform.node() or 'machine'}-linear"
    stamp += "" if model == "14B" else f"-{model}"
    with open(os.path.join(out_dir, stamp + ".json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "model": model, "dram_read_GBs": bw,
                   "int8_peak_GOPS": peak, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, stamp + ".md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
