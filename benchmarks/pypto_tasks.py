"""Tasks per decoder layer and simulated device time of our PyPTO kernels at a Qwen3 decode
shape, from pypto's cost model (no NPU needed), next to the upstream's figures. "AICore us"
is the end-to-end time pypto's report tool prints; it prints none for some large kernels,
so simulated cycles are summed as well.

    python benchmarks/pypto_tasks.py --shape 14B --batch 1,16 --context 1024

Counts the whole decode layer as the PyPTO backend's one kernel (kernels.decode_layer:
input norm + quant, QKV, QK-norm + RoPE, paged K/V write, paged decode attention, O, post-norm,
gate_up + SiLU, down), and its paged attention alone, every sequence at --context tokens in
blocks of --block-size. Weights are random: the cost model depends on shapes only.
--cube-tiles lists int8 GEMM tilings to compare, as n x k (output channels x reduction per
cube tile; one cube task per n tile): fewer, larger tasks are not always less device time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import report  # noqa: E402

UPSTREAM = {"logical_tasks_per_layer_first": 709, "logical_tasks_per_layer_final": 356,
            "aicore_tasks_per_step_first": 38705, "layers": 40}


def measure(shape: str, M: int, context: int, bs: int, tilings: list[tuple[int, int]]) -> dict:
    import pypto

    from vllm_pypto.kernels.ascend import kernels as K
    from vllm_pypto.kernels.ascend.verify import cost_model
    from vllm_pypto.tools.shapes import SHAPES

    s = SHAPES[shape]
    H, I, hd, nq, nkv = s.hidden, s.intermediate, s.head_dim, s.q_heads, s.kv_heads  # noqa: E741
    Q, D, MB = nq * hd, nkv * hd, -(-context // bs)
    rows = (M * MB + 1) * bs  # every sequence's blocks, plus block 0
    SIM, bf, i8, z = pypto.RunMode.SIM, torch.bfloat16, torch.int8, torch.zeros
    tables = (torch.arange(M * MB, dtype=torch.int32) + 1).view(M, MB)
    slots = (tables[:, -1:].long() * bs + (context - 1) % bs)
    paging = (tables, torch.full((M, 1), context, dtype=torch.int32), torch.arange(MB * bs, dtype=torch.int32)[None])
    cache = lambda: z(rows, D, dtype=bf)  # noqa: E731
    attention = cost_model(K.paged_decode_attention(M, nkv, nq // nkv, hd, rows, bs, MB, SIM),
                           z(M * nq, hd, dtype=bf), z(M, D, dtype=bf), z(M, D, dtype=bf), slots, *paging, cache(), cache(),
                           z(M * nq, hd, dtype=bf))
    print(f"  {shape} M={M} attention: {attention}", flush=True)
    x, g_h, g_d = z(M, H, dtype=bf), z(1, H, dtype=bf), z(1, hd, dtype=bf)
    cs = lambda n: z(M * n, hd // 2)  # noqa: E731
    layers, default = [], K.INT8_CUBE_TILES
    for n, k in tilings:
        K.INT8_CUBE_TILES = ([16, 16], [k, k], [n, n])
        K.decode_layer.cache_clear()
        layer = cost_model(K.decode_layer(M, H, nq, nkv, hd, I, rows, bs, MB, 1e-6, SIM), x, x.clone(), g_h,
                           z(Q + 2 * D, H, dtype=i8), z(1, Q + 2 * D), g_d, g_d.clone(), cs(nq), cs(nq), cs(nkv),
                           cs(nkv), slots, *paging, cache(), cache(), z(H, Q, dtype=i8), z(1, H), g_h.clone(),
                           z(2 * I, H, dtype=i8), z(1, 2 * I), z(H, I, dtype=i8), z(1, H), x.clone(), x.clone())
        print(f"  {shape} M={M} decode_layer, int8 cube tiles n={n} k={k}: {layer}", flush=True)
        layers.append({"cube_n": n, "cube_k": k, "per_layer": layer,
                       "per_step": {key: (v or 0) * s.layers for key, v in layer.items() if key != "aicore_us"}})
    K.INT8_CUBE_TILES = default
    K.decode_layer.cache_clear()
    return {"shape": shape, "batch": M, "context": context, "block_size": bs, "attention": attention,
            "layers": s.layers, "tilings": layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="14B")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=1024, help="tokens cached per sequence, the new one included")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--cube-tiles", default="256x256,512x128", help="int8 GEMM cube tilings, n x k, comma-separated")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    tilings = [tuple(int(v) for v in t.split("x")) for t in a.cube_tiles.split(",")]
    rows = [measure(a.shape, int(m), a.context, a.block_size, tilings) for m in a.batch.split(",")]
    lines = [f"| shape | batch | context | int8 cube tile n x k | tasks/layer (cube+vector) | of which attention "
             f"| simulated cycles/layer | tasks/step (x{rows[0]['layers']}) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for t in r["tilings"]:
            p = t["per_layer"]
            lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {t['cube_n']} x {t['cube_k']} | {p['tasks']} "
                         f"({p['cube_tasks']}+{p['vector_tasks']}) | {r['attention']['tasks']} | {p['cycles']} | "
                         f"{t['per_step']['tasks']} |")
    lines.append(f"\nupstream (Qwen3-14B, whole layer incl. attention): ~{UPSTREAM['logical_tasks_per_layer_first']} -> "
                 f"~{UPSTREAM['logical_tasks_per_layer_final']} logical tasks/layer, "
                 f"~{UPSTREAM['aicore_tasks_per_step_first']} AICore tasks/step at first.")
    md = "\n".join(lines)
    print("\n" + md)
    report.write(a.out, f"pypto-tasks-{a.shape}", {"date": time.strftime("%Y-%m-%d %H:%M"), "upstream": UPSTREAM,
                                                   "rows": rows}, md)


if __name__ == "__main__":
    main()
