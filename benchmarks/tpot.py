"""Batch-1 TTFT/TPOT of `vllm serve` configurations on one random-weight Qwen3 shape,
measured side by side in one run (the foundation's check; benchmarks/serving.py-style
sweeps with `vllm bench serve` build on the same pieces).

    python benchmarks/tpot.py --shape 0.6B --configs bf16,pypto-a8w8,pypto-a8w8:w8a8

Configs follow benchmarks/configs.py (`method[:fmt][@backend][+mods][+flags]`), e.g.
`pypto-a8w8:w8a8+fused_gate_up_silu+deferred_rms`. `--prompt-words N` makes the prompt long,
so TTFT measures a prefill of ~N tokens. The config `llama.cpp-server` is the peer users would
pick: llama-cpp-python's OpenAI server on the Q8_0 GGUF of the same weights (benchmarks/
llama_cpp_peer.py), sent the same chat requests, end-of-generation tokens banned so that it
decodes every requested token as ours do under ignore_eos. `--paired` starts every config's server at once and
sends the requests round-robin (the order reversed every other round), so each round measures
the configs seconds apart and the per-round TPOT ratio to the first config cancels the shared
host's drift, which moves a run's TPOT by 5-15% within minutes (docs/performance.md). The DRAM
read bandwidth moves too (28-63 GB/s within an hour here): a paired run probes it between
rounds, and gives each config's TPOT over its bound round by round, at the better of the probes
either side of the round. It also leaves `--gap` seconds between two requests: a vLLM server's
worker keeps one CPU busy for about a second after its last step (vLLM's shared-memory queue
polls before it sleeps), which slowed the next request to another server by about 14%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_pypto.demo import chat_once  # noqa: E402
from vllm_pypto.tools.server import VllmServer  # noqa: E402
import report as report_file  # noqa: E402  (benchmarks/report.py)
from configs import parse  # noqa: E402  (benchmarks/configs.py)
from linear import dram_read_gbs  # noqa: E402  (benchmarks/linear.py)
from vllm_pypto.kernels.select import cpu_isa_flags, cpu_model  # noqa: E402
from serving import checkpoint, config_bytes, q8_0_bytes  # noqa: E402  (benchmarks/serving.py)

LLAMA = "llama.cpp-server"  # the peer's config name


def _server(cfg: str, root: str, shape: str) -> VllmServer:
    if cfg == LLAMA:
        from llama_cpp_peer import LlamaCppServer, gguf_for

        return LlamaCppServer(gguf_for(checkpoint(root, shape, "w8a8")), 2048)
    c = parse(cfg)
    # no prefix caching: every request repeats the prompt, and TTFT must measure the prefill
    args = ["--max-model-len", "2048", "--served-model-name", "m", "--no-enable-prefix-caching", *c.serve_args()]
    return VllmServer(checkpoint(root, shape, c.fmt), *args, env=c.env)


def _row(cfg: str, shape: str, start: float, runs: list[dict]) -> dict:
    tpot = [r["tpot_s"] * 1000 for r in runs]
    ttft = [r["ttft_s"] * 1000 for r in runs]
    row = {"config": cfg, "shape": shape, "startup_s": round(start, 1), "tpot_ms_median": _spread(tpot)["median"],
           "tpot_ms": tpot, "ttft_ms_median": statistics.median(ttft), "ttft_ms": ttft, "tokens": runs[0]["tokens"]}
    print(json.dumps(row), flush=True)
    return row


def _extra_body(cfg: str, root: str, shape: str) -> dict | None:
    """The request fields of a config's server: vLLM's defaults, or the peer's EOG ban."""
    if cfg != LLAMA:
        return None
    from llama_cpp_peer import eog_bias

    return eog_bias(checkpoint(root, shape, "w8a8"))


def _bytes(cfg: str, shape: str) -> int:
    return q8_0_bytes(shape) if cfg == LLAMA else config_bytes(shape, parse(cfg))


def run_config(cfg: str, root: str, shape: str, requests: int, max_tokens: int, prompt: str) -> dict:
    t0 = time.time()
    body = _extra_body(cfg, root, shape)
    with _server(cfg, root, shape) as s:
        start = time.time() - t0
        chat_once(s.url, "m", "warm up", 8, body)
        runs = [chat_once(s.url, "m", prompt, max_tokens, body) for _ in range(requests)]
    return _row(cfg, shape, start, runs)


def run_paired(configs: list[str], root: str, shape: str, requests: int, max_tokens: int, prompt: str,
               gap: float) -> tuple[list[dict], list[float]]:
    """Every config's server up at once (an idle vLLM server sleeps, after about a second), requests
    round-robin, `gap` seconds apart -> the rows, and each round's DRAM read GB/s."""
    with contextlib.ExitStack() as stack:
        servers, bodies = [], {cfg: _extra_body(cfg, root, shape) for cfg in configs}
        for cfg in configs:
            t0 = time.time()
            s = stack.enter_context(_server(cfg, root, shape))
            servers.append((cfg, s, time.time() - t0))
            chat_once(s.url, "m", "warm up", 8, bodies[cfg])
        runs: dict[str, list[dict]] = {cfg: [] for cfg in configs}
        probes = [_probe()]  # between rounds: round i lies between probes i and i + 1
        for i in range(requests):
            for cfg, s, _ in servers if i % 2 == 0 else servers[::-1]:
                time.sleep(gap)
                runs[cfg].append(chat_once(s.url, "m", prompt, max_tokens, bodies[cfg]))
            probes.append(_probe())
    rows = [_row(cfg, shape, start, runs[cfg]) for cfg, _, start in servers]
    for r in rows:
        r["paired_ratio"] = _spread(t / b for t, b in zip(r["tpot_ms"], rows[0]["tpot_ms"]))
        r["paired_ttft_ratio"] = _spread(t / b for t, b in zip(r["ttft_ms"], rows[0]["ttft_ms"]))
    return rows, [max(a, b) for a, b in zip(probes, probes[1:])]


def _probe() -> float:
    return max(dram_read_gbs(0.5).values())


def _spread(values) -> dict:
    """Median and range of the measured values: a round whose TPOT could not be timed (NaN, see
    chat_once) drops out, of its own row and of every ratio it is part of."""
    v = sorted(x for x in values if math.isfinite(x))
    if not v:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": statistics.median(v), "min": v[0], "max": v[-1]}


def _spread_text(s: dict, digits: int) -> str:
    return f"{s['median']:.{digits}f}x ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _bound_ms(nbytes: int, gbs: float) -> float:
    return nbytes / (gbs * 1e9) * 1e3


def plot(report: dict, path: str) -> bool:
    """Batch-1 TPOT and TTFT per config (each run of a config that ran twice), beside the bound."""
    plt = report_file.pyplot()
    if plt is None:
        return False
    rows = report["rows"]
    names = [r["config"].replace("+", "\n+") for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 1.5 + 0.5 * len(rows)))
    for ax, key, label in ((a1, "tpot_ms_median", "batch-1 TPOT, ms (median)"),
                           (a2, "ttft_ms_median", "TTFT, ms (median)")):
        bars = ax.barh(range(len(rows)), [r[key] for r in rows], color="tab:blue")
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        ax.set_yticks(range(len(rows)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(label)
    if all("bound_ms" in r for r in rows):  # each config's own bound (older files have one for all)
        a1.scatter([r["bound_ms"] for r in rows], range(len(rows)), marker="|", s=300, color="tab:red",
                   label="bandwidth bound of its bytes per step")
    else:
        a1.axvline(report["bound_ms"], color="tab:red", ls="--", label=f"bandwidth bound {report['bound_ms']:.0f} ms")
    a1.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Qwen3-{rows[0]['shape']} (random weights), run order top to bottom, {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def header(report: dict) -> str:
    """The results file's first lines: machine, date, command, the DRAM probes."""
    return (f"{report['cpu']}, {report['cpus']} CPUs, {report['date']} UTC; `{report['command']}`; DRAM read "
            f"{' / '.join(f'{b:.1f}' for b in report['dram_read_gbs'])} GB/s (before / after)"
            + (f"; all servers up at once, requests round-robin, {report.get('gap_s') or 0:g} s apart"
               if report.get("paired") else "") + "\n\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.6B")
    ap.add_argument("--configs", default="bf16,pypto-a8w8")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--checkpoints", default="checkpoints")
    ap.add_argument("--prompt-words", type=int, default=0, help="0: the short chat prompt 介绍一下北京故宫")
    ap.add_argument("--out", default="results")
    ap.add_argument("--tag", default="", help="appended to the results file name")
    ap.add_argument("--paired", action="store_true",
                    help="all servers up at once, requests round-robin: per-round TPOT ratios to the first config")
    ap.add_argument("--gap", type=float, default=1.5,
                    help="--paired: seconds of quiet before each request, so that the last server has gone idle")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of an earlier run's JSON")
    a = ap.parse_args()
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), a.replot.rsplit(".", 1)[0] + ".png")
        return
    prompt = " ".join(["介绍一下北京故宫"] + ["the palace museum in beijing"] * (a.prompt_words // 5))
    configs = a.configs.split(",")
    for c in configs:  # a typo fails here, not after the first servers ran
        if c != LLAMA:
            parse(c)
    bw = max(dram_read_gbs().values())
    print(f"DRAM read {bw:.1f} GB/s", flush=True)
    round_gbs = None
    if a.paired:
        rows, round_gbs = run_paired(configs, a.checkpoints, a.shape, a.requests, a.max_tokens, prompt, a.gap)
    else:
        rows = [run_config(c, a.checkpoints, a.shape, a.requests, a.max_tokens, prompt) for c in configs]
    bw_after = max(dram_read_gbs().values())  # the host is shared: say how much it moved
    print(f"DRAM read after the runs {bw_after:.1f} GB/s", flush=True)
    for r in rows:  # each config against the bytes it reads per step, at the better of the two probes
        r["bytes_per_token"] = _bytes(r["config"], a.shape)
        r["bound_ms"] = _bound_ms(r["bytes_per_token"], max(bw, bw_after))
        if round_gbs:  # and round by round, at the better probe beside each round
            r["bound_ratio_per_round"] = _spread(t / _bound_ms(r["bytes_per_token"], g)
                                                 for t, g in zip(r["tpot_ms"], round_gbs))
    os.makedirs(a.out, exist_ok=True)
    stamp = f"{time.strftime('%Y-%m-%d')}-{platform.node() or 'machine'}-tpot-{a.shape}" + (
        f"-prompt{a.prompt_words}" if a.prompt_words else "") + ("-paired" if a.paired else "") + (
        f"-{a.tag}" if a.tag else "")
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": f"{cpu_model()} ({' '.join(cpu_isa_flags())})",
              "cpus": os.cpu_count(),
              "command": " ".join(sys.argv), "prompt_words": a.prompt_words, "paired": a.paired,
              "gap_s": a.gap if a.paired else None,
              "dram_read_gbs": [bw, bw_after], "round_gbs": round_gbs,
              "rows": rows}
    with open(os.path.join(a.out, stamp + ".json"), "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.join(a.out, stamp + ".png"))
    base = rows[0]["tpot_ms_median"]
    paired = [f" per round: {_spread_text(r['paired_ratio'], 3)}" if "paired_ratio" in r else "" for r in rows]
    lines = [f"| config | shape | TPOT ms (median of {a.requests}) | TTFT ms{' (vs the first row)' if a.paired else ''} "
             f"| TPOT vs {rows[0]['config']} "
             f"| MB read per step | TPOT / its bandwidth bound |", "| --- | --- | --- | --- | --- | --- | --- |"]
    per_round = [f"; per round: {_spread_text(r['bound_ratio_per_round'], 2)}" if "bound_ratio_per_round" in r else ""
                 for r in rows]
    ttft_rounds = [f"; per round {_spread_text(r['paired_ttft_ratio'], 2)}" if "paired_ttft_ratio" in r else ""
                   for r in rows]
    lines += [f"| {r['config']} | {r['shape']} | {r['tpot_ms_median']:.1f} | {r['ttft_ms_median']:.0f}{t} | "
              f"{r['tpot_ms_median'] / base:.2f}x{p} | {r['bytes_per_token'] / 1e6:.0f} | "
              f"{r['tpot_ms_median'] / r['bound_ms']:.2f}x ({r['bound_ms']:.1f} ms){b} |"
              for r, p, b, t in zip(rows, paired, per_round, ttft_rounds)]
    head = header(report)
    if round_gbs:
        g = round_gbs
        head += (f"DRAM read between rounds: {statistics.median(g):.1f} GB/s median ({min(g):.1f}-{max(g):.1f}); "
                 f"the per-round bound ratio is each round's TPOT over the bytes at the better probe beside it.\n\n")
    print("\n" + head + "\n".join(lines))
    with open(os.path.join(a.out, stamp + ".md"), "w") as f:
        f.write(head + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
