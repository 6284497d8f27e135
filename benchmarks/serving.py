"""Serving performance of every configuration, measured side by side in one run with
vLLM's own serving benchmark (`vllm bench serve`, random dataset), against the memory
bandwidth limit measured in the same run.

    python benchmarks/serving.py --shapes 0.6B,1.7B --configs bf16,ct:w8a8,pypto-a8w8:w8a8 \
        --flag-combos --concurrency 1,4,16

Per shape and configuration it starts `vllm serve` on a random-weight Qwen3 folder (made
once under --checkpoints), drives it at each --concurrency and records TTFT, TPOT, ITL and
E2EL (mean, median, p99), request and token throughput, and, with --dispatches, the
operator dispatches per batch-1 decode step (vllm_pypto.tools.dispatches). --llama-cpp
adds llama.cpp Q8_0 on the same weights (benchmarks/llama_cpp_peer.py) as a peer. Each batch-1
TPOT is also given as a ratio to the bandwidth bound (weight bytes a decode step reads /
DRAM read GB/s, probed before and after the shape's runs) and to the first configuration.
Output tokens/s at every concurrency is given as a multiple of concurrency 1's and, for int8
configs, beside the most any int8 implementation could serve here (throughput_limit: the
bandwidth and this CPU's int8 peak, measured in the same run).
Writes results/<date>-<machine>-serving.{json,md,png}.

Configs follow benchmarks/configs.py; --flag-combos adds pypto-a8w8 with each offered flag
and with all experimental flags together (--all-flag-subsets: every subset).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report as report_file  # noqa: E402  (benchmarks/report.py)
from configs import ISAS, Config, flag_combinations, parse  # noqa: E402  (benchmarks/configs.py)
from vllm_pypto.tools.make_checkpoint import make_checkpoint  # noqa: E402
from vllm_pypto.tools.server import VllmServer, vllm_command  # noqa: E402
from vllm_pypto.tools.shapes import SHAPES, VOCAB  # noqa: E402

METRICS = ("ttft", "tpot", "itl", "e2el")
LLAMA_SERVER = "llama.cpp server Q8_0"  # the row of --llama-cpp's served peer
STATS = ("mean", "median", "p99")
THROUGHPUT = ("request_throughput", "output_throughput", "total_token_throughput")


def log(msg: str, t0: float = time.time()) -> None:
    print(f"[{time.time() - t0:7.0f}s] {msg}", flush=True)


def weight_bytes(shape: str, fmt: str, int8_head: bool = False) -> int:
    """Bytes a batch-1 decode step reads: every linear (int8 or bf16) and the lm_head (bf16, or
    int8 under flag int8_lm_head; its per-row scales are left out, 0.4% of it)."""
    s = SHAPES[shape]
    return s.linear_params() * (1 if fmt == "w8a8" else 2) + (1 if int8_head else 2) * VOCAB * s.hidden


def config_bytes(shape: str, c: Config) -> int:
    """What configuration c really reads per decode step: int8 linears for ct and pypto-a8w8
    (a bf16 folder is quantized at load), bf16 ones for bf16; the head as int8_lm_head says."""
    return weight_bytes(shape, "bf16" if c.method == "bf16" else "w8a8", "int8_lm_head" in c.flags)


def resident_bytes(shape: str, fmt: str) -> int:
    """What the server holds: what a step reads, plus the embeddings when the head is untied."""
    s = SHAPES[shape]
    return weight_bytes(shape, fmt) + (0 if s.tied else 2 * VOCAB * s.hidden)


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def checkpoint(root: str, shape: str, fmt: str) -> str:
    path = os.path.join(root, f"qwen3-{shape}-{fmt}")
    if not os.path.exists(os.path.join(path, "config.json")):
        log(f"writing the random-weight {shape} {fmt} checkpoint to {path}")
        make_checkpoint(path, shape, fmt)
    return path


def summarize(raw: dict) -> dict:
    """The fields we report from one `vllm bench serve --save-result` JSON."""
    out = {"completed": raw["completed"], "failed": raw.get("failed", 0), "duration_s": raw["duration"],
           "total_output_tokens": raw.get("total_output_tokens"),
           **{k: raw[k] for k in THROUGHPUT}}
    for m in METRICS:
        for st in STATS:
            out[f"{st}_{m}_ms"] = raw.get(f"{st}_{m}_ms")
    if out["completed"] == 0:
        raise RuntimeError("vllm bench serve completed no request")
    return out


def bench_serve(url: str, tokenizer: str, concurrency: int, num_prompts: int, input_len: int,
                output_len: int, workdir: str, extra_body: dict | None = None) -> dict:
    name = f"c{concurrency}.json"
    cmd = [vllm_command(), "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", "m",
           "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
           "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0", "--disable-tqdm",
           "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", workdir, "--result-filename", name,
           *(["--extra-body", json.dumps(extra_body)] if extra_body else [])]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    with open(os.path.join(workdir, name)) as f:
        return summarize(json.load(f))


def count_dispatches(model: str, c: Config) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "d.json")
        # the tool sets VLLM_PYPTO_FLAGS and VLLM_PYPTO_MODEL from its own options
        cmd = [sys.executable, "-m", "vllm_pypto.tools.dispatches", "--model", model, "--out", out,
               *(["--quantization", c.quantization] if c.quantization else []),
               *(["--flags", ",".join(c.flags)] if c.flags else []),
               *(["--stock-model-class"] if "vllm-model" in c.mods else [])]
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", **c.env}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            return {"error": r.stderr[-500:]}
        with open(out) as f:
            d = json.load(f)
    return {"per_step": d["per_step"], "per_layer": d["per_layer"]}


def run_config(name: str, shape: str, a: argparse.Namespace) -> dict:
    c = parse(name)
    row = {"config": name, "shape": shape, "fmt": c.fmt}
    need = resident_bytes(shape, c.fmt)
    if need > 0.85 * memory_bytes():
        row["skipped"] = f"{need / 2**30:.0f} GiB of weights do not fit in {memory_bytes() / 2**30:.0f} GiB"
        log(f"{shape} {name}: skipped ({row['skipped']})")
        return row
    model = checkpoint(a.checkpoints, shape, c.fmt)
    args = ["--max-model-len", str(a.input_len + a.output_len + 64), "--served-model-name", "m",
            "--no-enable-prefix-caching", *c.serve_args()]
    drive(VllmServer(model, *args, env=c.env, startup_timeout=3600), row, model, a)
    if a.dispatches:
        row["dispatches"] = count_dispatches(model, c)
    return row


def drive(server: VllmServer, row: dict, tokenizer: str, a: argparse.Namespace, extra_body: dict | None = None):
    """Start the server, run `vllm bench serve` at each concurrency into row["runs"], stop it."""
    t0 = time.time()
    row["runs"] = {}
    with server as s, tempfile.TemporaryDirectory() as d:
        row["startup_s"] = round(time.time() - t0, 1)
        log(f"{row['shape']} {row['config']}: server up in {row['startup_s']:.0f}s")
        bench_serve(s.url, tokenizer, 1, 1, 16, 4, d, extra_body)  # warm-up: first-request compilation is not serving
        for conc in a.concurrency:
            n = max(a.num_prompts, conc * a.rounds)
            res = bench_serve(s.url, tokenizer, conc, n, a.input_len, a.output_len, d, extra_body)
            row["runs"][str(conc)] = res
            log(f"{row['shape']} {row['config']} concurrency {conc}: TPOT median {res['median_tpot_ms']:.1f} ms, "
                f"TTFT median {res['median_ttft_ms']:.0f} ms, {res['output_throughput']:.1f} output tok/s")


def llama_cpp_server_row(shape: str, a: argparse.Namespace) -> dict:
    """llama-cpp-python's OpenAI server on the Q8_0 GGUF of the same weights, driven like ours."""
    from llama_cpp_peer import LlamaCppServer, eog_bias, gguf_for

    folder = checkpoint(a.checkpoints, shape, "w8a8")
    row = {"config": LLAMA_SERVER, "shape": shape, "fmt": "q8_0", "peer": True}
    server = LlamaCppServer(gguf_for(folder), a.input_len + a.output_len + 64, startup_timeout=600)
    row["threads"] = server.threads
    drive(server, row, folder, a, eog_bias(folder))
    return row


def run_or_record(name: str, shape: str, a: argparse.Namespace) -> dict:
    """A configuration that fails (a server that does not start, runs out of memory) is a
    row with its error, and the sweep goes on: hours of other measurements are not lost."""
    try:
        return llama_cpp_server_row(shape, a) if name == LLAMA_SERVER else run_config(name, shape, a)
    except (RuntimeError, TimeoutError, OSError) as e:
        log(f"{shape} {name}: FAILED {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        return {"config": name, "shape": shape, "error": str(e)[-3000:]}


def q8_0_bytes(shape: str) -> int:
    """What llama.cpp reads per decode step: every linear and the head in Q8_0 (34 bytes per 32)."""
    s = SHAPES[shape]
    return (s.linear_params() + VOCAB * s.hidden) * 34 // 32


def row_bytes(row: dict) -> int:
    return q8_0_bytes(row["shape"]) if row.get("peer") else config_bytes(row["shape"], parse(row["config"]))


def throughput_limit(shape: str, bytes_per_step: int, conc: int, input_len: int, output_len: int,
                     bw_gbs: float, peak_gops: float) -> float:
    """Output tokens/s that no int8 implementation can beat on this machine for this workload
    with `conc` requests in flight. A forward pass reads the weights once and yields at most
    `conc` output tokens: conc x bandwidth / bytes. And every multiply-add runs at most at the
    int8 peak: each prompt token and each output token but the last go through every linear,
    each output token through the head (attention left out, so the true limit is lower)."""
    s = SHAPES[shape]
    macs = (input_len + output_len - 1) * s.linear_params() + output_len * VOCAB * s.hidden
    by_memory = conc * bw_gbs * 1e9 / bytes_per_step
    by_compute = peak_gops * 1e9 / (2 * macs / output_len)
    return min(by_memory, by_compute)


def prefill_floor_ms(shape: str, input_len: int, peak_gops: float) -> float:
    """The shortest prefill of one `input_len`-token prompt any int8 implementation could run at
    `peak_gops`: every prompt token through every linear, the last one through the head
    (attention, norms and serving left out, so the true floor is higher). A TTFT target below
    it cannot be met on that ISA path."""
    s = SHAPES[shape]
    return 2 * (input_len * s.linear_params() + VOCAB * s.hidden) / (peak_gops * 1e9) * 1e3


def int8_peaks() -> dict[str, float]:
    """This CPU's int8 multiply-add peak from registers on each ISA path, best path first ({}: no
    native build)."""
    from linear import int8_peak_gops, isa_paths
    return int8_peak_gops(isa_paths(None))


def row_peak(row: dict, peaks: dict[str, float]) -> float | None:
    """The int8 peak of the ISA path a row's GEMMs can use at best: the path its config forces
    (+avx2 ...), else this CPU's best, which vLLM-CPU's oneDNN and llama.cpp also pick."""
    forced = [] if row.get("peer") else [m for m in parse(row["config"]).mods if m in ISAS]
    return peaks.get(forced[0]) if forced else next(iter(peaks.values()), None)


def add_ratios(rows: list[dict], peers: list[dict], bw_gbs: float | None, peaks: dict[str, float] | None = None,
               input_len: int = 128, output_len: int = 64) -> None:
    """TPOT at batch 1 as a ratio to its bandwidth bound (the bytes that configuration reads per
    step over the DRAM read rate of this run), to the first measured config and to each peer (the
    in-process llama.cpp and the llama.cpp server row). At every concurrency, output tokens/s as
    a multiple of the same config's at concurrency 1 and, for int8 configs (where the int8 peak
    of this run applies, per ISA path: `peaks`), beside throughput_limit; their TTFT beside
    prefill_floor_ms."""
    for p in peers:
        if bw_gbs:
            p["bound_ms"] = q8_0_bytes(p["shape"]) / (bw_gbs * 1e9) * 1e3
    measured = [r for r in rows if "runs" in r and "1" in r["runs"]]
    base = measured[0]["runs"]["1"]["median_tpot_ms"] if measured else None
    ref = {p["name"]: p["tpot_ms"] for p in peers}
    ref.update({r["config"]: r["runs"]["1"]["median_tpot_ms"] for r in measured if r.get("peer")})
    for r in measured:
        tpot = r["runs"]["1"]["median_tpot_ms"]
        r["tpot_vs_first"] = tpot / base
        r["tpot_vs_peers"] = {k: tpot / v for k, v in ref.items() if k != r["config"]}
        r["bytes_per_step"] = row_bytes(r)
        if bw_gbs:
            r["bound_ms"] = r["bytes_per_step"] / (bw_gbs * 1e9) * 1e3
            r["tpot_vs_bound"] = tpot / r["bound_ms"]
        int8 = r.get("peer") or parse(r["config"]).method != "bf16"  # llama.cpp's Q8_0 dots are int8 too
        peak = row_peak(r, peaks or {}) if int8 else None
        if peak:
            r["int8_peak_gops"] = peak
            r["ttft_floor_ms"] = prefill_floor_ms(r["shape"], input_len, peak)
        for conc, m in r["runs"].items():
            m["tok_s_vs_conc1"] = m["output_throughput"] / r["runs"]["1"]["output_throughput"]
            if bw_gbs and peak:
                m["tok_s_limit"] = throughput_limit(r["shape"], r["bytes_per_step"], int(conc), input_len,
                                                    output_len, bw_gbs, peak)


def markdown(report: dict) -> str:
    lines = [f"{report.get('cpu', 'CPU not recorded')}, {report.get('cpus')} CPUs, {report['date']}", ""]
    for sh in report["shapes"]:
        bw = sh["dram_read_gbs"]
        peak = f"; int8 peak {sh['int8_peak_gops']:.0f} GOPS" if sh.get("int8_peak_gops") else ""
        lines += [f"### {sh['shape']}: DRAM read {bw[0]:.1f} GB/s before, {bw[1]:.1f} after{peak}; "
                  f"input {report['input_len']} / output {report['output_len']} tokens", "",
                  "| config | conc. | TPOT ms (mean / median / p99) | TTFT ms (median / p99) | TTFT floor ms "
                  "| ITL ms (median) | E2EL s (median) | req/s | output tok/s | tok/s vs conc. 1 | tok/s limit "
                  "| TPOT / bound | TPOT vs first | TPOT vs peers | dispatches/step |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sh["rows"]:
            if "skipped" in r or "error" in r:
                why = f"skipped: {r['skipped']}" if "skipped" in r else "failed: " + r["error"].splitlines()[0][:120]
                lines.append(f"| {r['config']} | - | {why} |" + " |" * 12)
                continue
            for conc, m in r["runs"].items():
                b1 = conc == "1" and "tpot_vs_bound" in r
                ratio = f"{r['tpot_vs_bound']:.2f}x ({r['bound_ms']:.0f} ms)" if b1 else ""
                first = f"{r['tpot_vs_first']:.2f}x" if conc == "1" and "tpot_vs_first" in r else ""
                vs = ", ".join(f"{v:.2f}x {k}" for k, v in r.get("tpot_vs_peers", {}).items()) if conc == "1" else ""
                disp = r.get("dispatches", {}).get("per_step", "") if conc == "1" else ""
                gain = f"{m['tok_s_vs_conc1']:.2f}x" if "tok_s_vs_conc1" in m and conc != "1" else ""
                lim = f"{m['tok_s_limit']:.1f}" if "tok_s_limit" in m else ""
                floor = f"{r['ttft_floor_ms']:.0f}" if conc == "1" and "ttft_floor_ms" in r else ""
                lines.append(
                    f"| {r['config']} | {conc} | {m['mean_tpot_ms']:.1f} / {m['median_tpot_ms']:.1f} / "
                    f"{m['p99_tpot_ms']:.1f} | {m['median_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f} | {floor} | "
                    f"{m['median_itl_ms']:.1f} | {m['median_e2el_ms'] / 1e3:.2f} | {m['request_throughput']:.2f} | "
                    f"{m['output_throughput']:.1f} | {gain} | {lim} | {ratio} | {first} | {vs} | {disp} |")
        for p in sh.get("peers", []):
            bound = f"{p['tpot_ms'] / p['bound_ms']:.2f}x" if "bound_ms" in p else ""
            lines.append(f"| {p['name']} (peer, in process, {p['threads']} threads) | 1 | - / {p['tpot_ms']:.1f} / - | "
                         f"{p['ttft_ms']:.0f} / - | | | | | {1e3 / p['tpot_ms']:.1f} | | | {bound} | | | |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: str) -> bool:
    """Batch-1 TPOT per configuration and shape, beside each shape's bandwidth bound."""
    plt = report_file.pyplot()
    if plt is None:
        return False
    shapes = report["shapes"]
    most = max(len(sh["rows"]) + len(sh.get("peers", [])) for sh in shapes)
    fig, axes = plt.subplots(1, len(shapes), figsize=(8 * len(shapes), 1.5 + 0.55 * most), squeeze=False)
    for ax, sh in zip(axes[0], shapes):
        rows = [r for r in sh["rows"] if "tpot_vs_bound" in r]
        names = [r["config"].replace("+", "\n+") for r in rows] + [p["name"] for p in sh.get("peers", [])]
        vals = [r["runs"]["1"]["median_tpot_ms"] for r in rows] + [p["tpot_ms"] for p in sh.get("peers", [])]
        bars = ax.barh(range(len(vals)), vals,
                       color=["tab:blue"] * len(rows) + ["tab:gray"] * (len(vals) - len(rows)))
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        ax.set_yticks(range(len(vals)), names, fontsize=7)
        bounds = [r["bound_ms"] for r in rows] + [p["bound_ms"] for p in sh.get("peers", []) if "bound_ms" in p]
        if bounds:  # each bar's own bound: the bytes that configuration reads per step
            ax.scatter(bounds, range(len(bounds)), marker="|", s=300, color="tab:red",
                       label="bandwidth bound of its bytes per step")
        ax.set_xlabel("batch-1 TPOT, ms (median)")
        ax.set_title(f"Qwen3-{sh['shape']} (random weights)")
        ax.invert_yaxis()
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0.6B")
    ap.add_argument("--configs", default="bf16,ct:w8a8,pypto-a8w8:w8a8")
    ap.add_argument("--flag-combos", action="store_true", help="add pypto-a8w8:w8a8 with each flag")
    ap.add_argument("--all-flag-subsets", action="store_true", help="add every subset of the offered flags")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--num-prompts", type=int, default=4, help="per concurrency level, at least")
    ap.add_argument("--rounds", type=int, default=2, help="num prompts >= rounds x concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dispatches", action="store_true", help="count dispatches per decode step (one more engine)")
    ap.add_argument("--llama-cpp", action="store_true", help="add llama.cpp Q8_0 (benchmarks/llama_cpp_peer.py)")
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the DRAM probe (no ratios)")
    ap.add_argument("--checkpoints", default="checkpoints")
    ap.add_argument("--out", default="results")
    ap.add_argument("--tag", default="serving")
    a = ap.parse_args(argv)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    configs = a.configs.split(",")
    if a.flag_combos or a.all_flag_subsets:
        configs += [c for c in flag_combinations("pypto-a8w8:w8a8", a.all_flag_subsets) if c not in configs]
    for c in configs:
        parse(c)  # every name is checked before the first server starts
    from linear import dram_read_gbs  # torch + our probe; imported late so --help stays fast

    from vllm_pypto.kernels.select import cpu_isa_flags, cpu_model

    report = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": platform.node(), "cpus": os.cpu_count(),
              "cpu": f"{cpu_model()} ({' '.join(cpu_isa_flags())})",
              "input_len": a.input_len, "output_len": a.output_len, "concurrency": a.concurrency, "shapes": []}
    for shape in a.shapes.split(","):
        bw0 = 0.0 if a.no_bandwidth else max(dram_read_gbs().values())
        peaks0 = {} if a.no_bandwidth else int8_peaks()
        log(f"{shape}: DRAM read {bw0:.1f} GB/s, int8 peak GOPS {', '.join(f'{k} {v:.0f}' for k, v in peaks0.items())}")
        rows = [run_or_record(c, shape, a) for c in configs]
        peers = []
        if a.llama_cpp:  # the same weights as a Q8_0 GGUF; needs llama-cpp-python and gguf
            from llama_cpp_peer import peer
            peers = [{**peer(checkpoint(a.checkpoints, shape, "w8a8"), a.output_len, a.input_len), "shape": shape}]
            log(f"{shape} llama.cpp Q8_0 in process: TPOT median {peers[0]['tpot_ms']:.1f} ms")
            rows.append(run_or_record(LLAMA_SERVER, shape, a))
        bw1 = 0.0 if a.no_bandwidth else max(dram_read_gbs().values())
        # a peak probe that shares the CPUs with anything reads low: the better of the two is the limit
        probes = [] if a.no_bandwidth else [peaks0, int8_peaks()]
        peaks = {k: max(p[k] for p in probes) for k in peaks0}
        add_ratios(rows, peers, None if a.no_bandwidth else max(bw0, bw1), peaks, a.input_len, a.output_len)
        report["shapes"].append({"shape": shape, "dram_read_gbs": [bw0, bw1],
                                 "int8_peak_gops": max(peaks.values(), default=0.0) or None,
                                 "int8_peak_gops_by_path": peaks, "int8_peak_probes": probes, "rows": rows,
                                 "peers": peers})
    md = markdown(report)
    stem = report_file.write(a.out, a.tag, report, md)
    plotted = not a.no_bandwidth and plot(report, stem + ".png")
    print("\n" + md)
    print(f"wrote {stem}.json, {stem}.md" + (f", {stem}.png" if plotted else ""))
    return 1 if any("error" in r for sh in report["shapes"] for r in sh["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
