"""Tasks per decoder layer and simulated device time of our PyPTO kernels at a Qwen3 decode
shape, from pypto's cost model (no NPU needed), next to the upstream's figures. "AICore us"
is the end-to-end time pypto's report tool prints; it prints none for some large kernels,
so simulated cycles are summed as well.

    python benchmarks/pypto_tasks.py --shape 14B --batch 1,16

Counts the kernels a decode layer launches on the PyPTO backend today: the QKV and O linears
(per-token quant + int8 GEMM + dequant each) and the MLP block (residual + post-norm + quant,
gate_up, SiLU*up + quant, down: one kernel). Attention (QK-norm, RoPE, paged KV, decode
attention) has no PyPTO kernel of ours yet and is not counted. Weights are random: the cost
model depends on shapes only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

UPSTREAM = {"logical_tasks_per_layer_first": 709, "logical_tasks_per_layer_final": 356,
            "aicore_tasks_per_step_first": 38705, "layers": 40}


def measure(shape: str, M: int) -> dict:
    import pypto

    from vllm_pypto.kernels.ascend import kernels as K
    from vllm_pypto.kernels.ascend.verify import cost_model
    from vllm_pypto.tools.shapes import SHAPES

    s = SHAPES[shape]
    H, I = s.hidden, s.intermediate
    q, kv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
    SIM = pypto.RunMode.SIM
    bf, i8 = torch.bfloat16, torch.int8
    x = torch.zeros(M, H, dtype=bf)
    parts = {}
    for name, (N, Kd) in {"qkv_proj": (q + 2 * kv, H), "o_proj": (H, q)}.items():
        parts[name] = cost_model(K.a8w8_linear(M, Kd, N, SIM), torch.zeros(M, Kd, dtype=bf),
                                 torch.zeros(N, Kd, dtype=i8), torch.zeros(1, N), torch.zeros(M, N, dtype=bf))
        print(f"  {shape} M={M} {name}: {parts[name]}", flush=True)
    parts["mlp_block"] = cost_model(K.mlp_block(M, H, I, 1e-6, SIM), x, x.clone(), torch.zeros(1, H, dtype=bf),
                                    torch.zeros(2 * I, H, dtype=i8), torch.zeros(1, 2 * I),
                                    torch.zeros(H, I, dtype=i8), torch.zeros(1, H), x.clone(), x.clone())
    print(f"  {shape} M={M} mlp_block: {parts['mlp_block']}", flush=True)
    total = {k: sum(p[k] or 0 for p in parts.values()) for k in ("tasks", "cube_tasks", "vector_tasks", "cycles")}
    return {"shape": shape, "batch": M, "parts": parts, "per_layer": total,
            "per_step_without_attention": {k: v * s.layers for k, v in total.items()}, "layers": s.layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="14B")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    rows = [measure(a.shape, int(m)) for m in a.batch.split(",")]
    os.makedirs(a.out, exist_ok=True)
    stamp = f"{time.strftime('%Y-%m-%d')}-{platform.node() or 'machine'}-pypto-tasks-{a.shape}"
    with open(os.path.join(a.out, stamp + ".json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "upstream": UPSTREAM, "rows": rows}, f, indent=1)
    print(f"\n| shape | batch | tasks/layer (cube+vector) | simulated cycles/layer | AICore us (qkv, o, mlp) "
          f"| tasks/step (x{rows[0]['layers']}) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        t, p = r["per_layer"], r["parts"]
        us = ", ".join("n/a" if p[k]["aicore_us"] is None else f"{p[k]['aicore_us']:.0f}" for k in p)
        print(f"| {r['shape']} | {r['batch']} | {t['tasks']} ({t['cube_tasks']}+{t['vector_tasks']}) | "
              f"{t['cycles']} | {us} | {r['per_step_without_attention']['tasks']} |")
    print(f"\nupstream (Qwen3-14B, whole layer incl. attention): ~{UPSTREAM['logical_tasks_per_layer_first']} -> "
          f"~{UPSTREAM['logical_tasks_per_layer_final']} logical tasks/layer, ~{UPSTREAM['aicore_tasks_per_step_first']} "
          f"AICore tasks/step at first. Ours excludes attention (no PyPTO attention kernel yet).")


if __name__ == "__main__":
    main()
