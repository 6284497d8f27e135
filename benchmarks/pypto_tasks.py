"""Tasks and simulated device time of a Qwen3 decode step on our PyPTO kernels, from pypto's
cost model (no NPU needed), next to the upstream's figures. Simulated time is the cost model's
cycles at the 1.8 GHz AICore clock its swimlane assumes: a task-level model of limited
accuracy, not device time. ("AICore us", the end-to-end time pypto's report tool prints, is
shown too where it prints one.)

    python benchmarks/pypto_tasks.py --shape 14B --batch 1,16 --context 1024,4096

Counts the whole decode layer as the serving path runs it, one kernel per layer
(kernels.decode_layer: input norm + quant, QKV, QK-norm + RoPE, paged K/V write, paged decode
attention, O, post-norm, gate_up + SiLU, down), on vLLM-Ascend's paired cache layout, and its
paged attention alone, every sequence at --context tokens in blocks of --block-size. A step is
the layer times the model's layers; the final norm and the LM head run outside PyPTO (vLLM's,
on the platform). Weights are random: the cost model depends on shapes only. --cube-tiles lists
int8 GEMM tilings to compare, as n x k (output channels x reduction per cube tile; one cube task
per n tile): fewer, larger tasks are not always less device time.
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
            "aicore_tasks_per_step_first": 38705, "tpot_ms_first": 360, "tpot_ms_final": 42, "layers": 40}
CLOCK_HZ = 1.8e9  # the AICore clock pypto's cost-model swimlane assumes (../shared/ascend-notes.md)


def measure(shape: str, M: int, context: int, bs: int, tilings: list[tuple[int, int]]) -> dict:
    from vllm_pypto.kernels.ascend import import_pypto
    from vllm_pypto.kernels.ascend import kernels as K
    from vllm_pypto.kernels.ascend import paging as P
    from vllm_pypto.kernels.ascend.verify import cost_model
    from vllm_pypto.tools.shapes import SHAPES

    pypto = import_pypto()
    s = SHAPES[shape]
    H, I, hd, nq, nkv = s.hidden, s.intermediate, s.head_dim, s.q_heads, s.kv_heads  # noqa: E741
    Q, D, MB = nq * hd, nkv * hd, P.bucket(-(-context // bs))
    nb = M * MB + 1  # every sequence's blocks, plus the null block 0
    SIM, bf, i8, z = pypto.RunMode.SIM, torch.bfloat16, torch.int8, torch.zeros
    kv = (z(nb, bs, nkv, hd, dtype=bf), z(nb, bs, nkv, hd, dtype=bf))  # vLLM-Ascend's pair
    view = P.cache_view(kv, nkv, hd)
    tables = (torch.arange(M * MB, dtype=torch.int32) + 1).view(M, MB)
    slots = tables[:, (context - 1) // bs].long() * bs + (context - 1) % bs
    rows, pages, gpos = P.kernel_indices(view, slots, tables)
    paging = (rows, pages, gpos, torch.full((M, 1), context, dtype=torch.int32),
              torch.arange(MB * bs, dtype=torch.int32)[None])
    cache = K.PagedCache(view.kind, view.k_rows.shape[0], bs, nkv, hd)
    attention = cost_model(K.paged_decode_attention(M, nq // nkv, cache, MB, SIM), z(M * nq, hd, dtype=bf),
                           z(M, D, dtype=bf), z(M, D, dtype=bf), *paging, view.k_rows, view.v_rows,
                           z(M * nq, hd, dtype=bf))
    print(f"  {shape} M={M} context={context} attention: {attention}", flush=True)
    x, g_h, g_d = z(M, H, dtype=bf), z(1, H, dtype=bf), z(1, hd, dtype=bf)
    cs = lambda n: z(M * n, hd // 2)  # noqa: E731
    layers, default = [], K.INT8_CUBE_TILES
    for n, k in tilings:
        K.INT8_CUBE_TILES = ([16, 16], [k, k], [n, n])
        K.decode_layer.cache_clear()
        layer = cost_model(K.decode_layer(M, H, nq, I, cache, MB, 1e-6, "vllm", SIM), x, x.clone(), g_h,
                           z(Q + 2 * D, H, dtype=i8), z(1, Q + 2 * D), g_d, g_d.clone(), cs(nq), cs(nq), cs(nkv),
                           cs(nkv), *paging, view.k_rows, view.v_rows, z(H, Q, dtype=i8), z(1, H), g_h.clone(),
                           z(2 * I, H, dtype=i8), z(1, 2 * I), z(H, I, dtype=i8), z(1, H), x.clone(), x.clone())
        print(f"  {shape} M={M} context={context} decode_layer, int8 cube tiles n={n} k={k}: {layer}", flush=True)
        per_step = {key: (v or 0) * s.layers for key, v in layer.items() if key != "aicore_us"}
        per_step["simulated_ms"] = per_step["cycles"] / CLOCK_HZ * 1e3
        layers.append({"cube_n": n, "cube_k": k, "per_layer": layer, "per_step": per_step})
    K.INT8_CUBE_TILES = default
    K.decode_layer.cache_clear()
    return {"shape": shape, "batch": M, "context": context, "block_size": bs, "attention": attention,
            "layers": s.layers, "tilings": layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="14B")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", default="1024", help="tokens cached per sequence, the new one included; comma list")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--cube-tiles", default="256x256", help="int8 GEMM cube tilings, n x k, comma-separated")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    tilings = [tuple(int(v) for v in t.split("x")) for t in a.cube_tiles.split(",")]
    rows = [measure(a.shape, int(m), int(c), a.block_size, tilings) for m in a.batch.split(",")
            for c in a.context.split(",")]
    lines = [f"| shape | batch | context | int8 cube tile n x k | tasks/layer (cube+vector) | of which attention "
             f"| simulated cycles/layer | tasks/step (x{rows[0]['layers']}) | simulated ms/step at 1.8 GHz |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for t in r["tilings"]:
            p = t["per_layer"]
            lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {t['cube_n']} x {t['cube_k']} | {p['tasks']} "
                         f"({p['cube_tasks']}+{p['vector_tasks']}) | {r['attention']['tasks']} | {p['cycles']} | "
                         f"{t['per_step']['tasks']} | {t['per_step']['simulated_ms']:.2f} |")
    lines.append(f"\nupstream (Qwen3-14B, measured on one device, whole step incl. LM head): "
                 f"~{UPSTREAM['aicore_tasks_per_step_first']} AICore tasks/step and {UPSTREAM['tpot_ms_first']} ms TPOT at "
                 f"first, ~{UPSTREAM['tpot_ms_final']} ms TPOT at the end; "
                 f"~{UPSTREAM['logical_tasks_per_layer_first']} -> ~{UPSTREAM['logical_tasks_per_layer_final']} logical "
                 f"tasks/layer. Simulated time is the cost model's, not device time.")
    md = "\n".join(lines)
    print("\n" + md)
    report.write(a.out, f"pypto-tasks-{a.shape}", {"date": time.strftime("%Y-%m-%d %H:%M"), "upstream": UPSTREAM,
                                                   "rows": rows}, md)


if __name__ == "__main__":
    main()
