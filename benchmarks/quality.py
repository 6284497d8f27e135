"""Output quality of A8W8 configurations against the bf16 reference of the same model:
greedy 16- and 48-token runs on fixed zh/en prompts, judged by teacher forcing.

    python benchmarks/quality.py --model DIR [--reference BF16_DIR] \
        [--configs pypto-a8w8,pypto-a8w8+deferred_rms | --flag-combos]

The reference is stock vLLM without quantization on --reference (default: --model, which
must then be a bf16 folder). Each configuration (benchmarks/configs.py; its folder is
--model whatever its :fmt says) runs in its own engine, greedily, and also scores the
reference's greedy tokens (vLLM prompt_logprobs). Per prompt and length it reports the
tokens, the text, the first divergence from the reference and the reference's top-2
margin there, positional token agreement, teacher-forced top-1 agreement, |logprob|
deltas of the reference's tokens, and repetition (longest repeated n-gram, distinct-2, a
looping tail).

Why teacher forcing and a margin rule, not exact matches: int8 noise moves logits a
little, so greedy text may part from the reference where the reference itself hesitated
(a small top-2 margin) and never where it was sure. A configuration fails when
  - the reference's token is not its top-1 at a step where the reference's margin
    exceeds --margin (a confident step overturned: a bug, not noise), or
  - teacher-forced top-1 agreement < --min-agreement, or mean |dlogprob| > --max-mean-dlp, or
  - its greedy output loops (same phrase over and over) on a prompt where the reference's
    does not.
With --baseline CONFIG (e.g. `ct`, vLLM-CPU's own W8A8 on a W8A8 folder) the bars are that
configuration's own figures instead: on a deep random-weight model int8 noise alone
overturns confident steps, and the question becomes "no worse than another A8W8".
The exit status is 1 when any configuration fails. Writes results/<date>-<machine>-<tag>.{json,md}.
The defaults were measured on the tests' random checkpoint (docs/performance.md, "Output quality").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report as report_file  # noqa: E402  (benchmarks/report.py)
from configs import flag_combinations, parse  # noqa: E402  (benchmarks/configs.py)
from vllm_pypto.tools import generate  # noqa: E402

PROMPTS = ["介绍一下北京故宫", "The capital of France is", "请写一首关于春天的诗", "中国的四大发明是",
           "Explain how a transformer language model works.", "今天天气很好，我们去",
           "Once upon a time, in a small village", "The three primary colors are"]
TOP = 5  # logprobs per step: the reference's top-2 margin needs two


def run_engine(model: str, quantization: str | None, env: dict, prompts: list[str], max_tokens: int,
               workdir: str, tag: str, score: list[dict] | None = None, chat: bool = False) -> dict:
    """One engine (vllm_pypto.tools.generate in its own process) for one configuration."""
    args = ["--max-tokens", str(max_tokens), "--logprobs", str(TOP)]
    args += ["--quantization", quantization] if quantization else []
    args += ["--chat"] if chat else []
    if score:
        sfile = os.path.join(workdir, tag + ".score.json")
        with open(sfile, "w") as f:
            json.dump(score, f)
        args += ["--score-json", sfile]
    return generate.run(model, prompts, os.path.join(workdir, tag + ".json"), *args, env=env)


def quantized(folder: str) -> bool:
    with open(os.path.join(folder, "config.json")) as f:
        return "quantization_config" in json.load(f)


# ---- repetition -------------------------------------------------------------------------

def longest_repeat(toks: list[int]) -> int:
    """Length of the longest n-gram that occurs at least twice."""
    best = 0
    for i in range(len(toks)):
        for j in range(i + 1, len(toks)):
            k = 0
            while j + k < len(toks) and toks[i + k] == toks[j + k]:
                k += 1
            best = max(best, k)
    return best


def distinct(toks: list[int], n: int = 2) -> float:
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def looping(toks: list[int]) -> bool:
    """The output ends in one phrase repeated: a periodic tail of at least half the output
    (and 8 tokens) whose period is at most a third of it."""
    n = len(toks)
    tail = max(8, n // 2)
    if n < tail:
        return False
    for p in range(1, n // 3 + 1):
        if all(toks[i] == toks[i - p] for i in range(n - tail + p, n)):
            return True
    return False


def repetition(toks: list[int]) -> dict:
    return {"longest_repeat": longest_repeat(toks), "distinct2": round(distinct(toks), 3), "looping": looping(toks)}


# ---- comparison -------------------------------------------------------------------------

def margins(res: dict) -> list[float]:
    """The reference's top-1 minus top-2 logprob at each greedy step (inf if only one)."""
    out = []
    for step in res["logprobs"]:
        v = sorted(step.values(), reverse=True)
        out.append(v[0] - v[1] if len(v) > 1 else float("inf"))
    return out


def compare(ref: dict, run: dict, scored: list[dict], n: int, margin_tol: float) -> dict:
    """One prompt, first n tokens: the configuration's run against the reference's."""
    rt, ct = ref["token_ids"][:n], run["token_ids"][:n]
    m = margins(ref)[:n]
    ref_lp = [ref["logprobs"][i][str(t)] for i, t in enumerate(rt)]
    dlp = [abs(s["logprob"] - lp) for s, lp in zip(scored[:n], ref_lp)]
    first = next((i for i, (a, b) in enumerate(zip(rt, ct)) if a != b), None)
    violations = [{"step": i, "ref_token": rt[i], "rank": s["rank"], "ref_margin": round(m[i], 3)}
                  for i, s in enumerate(scored[:n]) if s["rank"] != 1 and m[i] > margin_tol]
    overturned = [m[i] for i, s in enumerate(scored[:n]) if s["rank"] != 1]
    return {"tokens": ct, "first_divergence": first,
            "max_overturned_margin": round(max(overturned, default=0.0), 3),
            "margin_at_divergence": None if first is None else round(m[first], 3),
            "token_agreement": sum(a == b for a, b in zip(rt, ct)) / n,
            "tf_top1": sum(s["rank"] == 1 for s in scored[:n]) / n,
            "mean_dlp": sum(dlp) / n, "max_dlp": max(dlp), "violations": violations,
            "repetition": repetition(ct), "ref_repetition": repetition(rt)}


def judge(per_prompt: list[dict], gate: argparse.Namespace, base: dict | None = None) -> dict:
    """Aggregate one configuration at one length and decide pass/fail (with reasons). With a
    baseline's summary (another A8W8 implementation on the same prompts), the bars are
    relative: no more violations (within two Poisson sigmas), loops or disagreement than it."""
    k = len(per_prompt)
    agg = {"tf_top1": sum(p["tf_top1"] for p in per_prompt) / k,
           "token_agreement": sum(p["token_agreement"] for p in per_prompt) / k,
           "mean_dlp": sum(p["mean_dlp"] for p in per_prompt) / k,
           "max_dlp": max(p["max_dlp"] for p in per_prompt),
           "violations": sum(len(p["violations"]) for p in per_prompt),
           "max_overturned_margin": max(p["max_overturned_margin"] for p in per_prompt),
           "prompts_equal": sum(p["first_divergence"] is None for p in per_prompt),
           "new_loops": sum(p["repetition"]["looping"] and not p["ref_repetition"]["looping"] for p in per_prompt)}
    bar = {"violations": 0, "min_agreement": gate.min_agreement, "max_mean_dlp": gate.max_mean_dlp, "new_loops": 0}
    if base is not None:
        # overturned steps are rare events: allow the baseline's count plus two Poisson sigmas
        bar = {"violations": base["violations"] + math.ceil(2 * math.sqrt(base["violations"])),
               "min_agreement": base["tf_top1"] - 0.02,
               "max_mean_dlp": 1.25 * base["mean_dlp"] + 0.02, "new_loops": base["new_loops"]}
    reasons = []
    if agg["violations"] > bar["violations"]:
        reasons.append(f"{agg['violations']} confident reference steps overturned (margin > {gate.margin}; "
                       f"allowed {bar['violations']})")
    if agg["tf_top1"] < bar["min_agreement"]:
        reasons.append(f"teacher-forced top-1 agreement {agg['tf_top1']:.3f} < {bar['min_agreement']:.3f}")
    if agg["mean_dlp"] > bar["max_mean_dlp"]:
        reasons.append(f"mean |dlogprob| {agg['mean_dlp']:.3f} > {bar['max_mean_dlp']:.3f}")
    if agg["new_loops"] > bar["new_loops"]:
        reasons.append(f"{agg['new_loops']} prompts loop where the reference does not (allowed {bar['new_loops']})")
    return {**agg, "passed": not reasons, "reasons": reasons}


def evaluate(ref: dict, run: dict, lengths: list[int], gate: argparse.Namespace, base: dict | None = None) -> dict:
    out = {}
    for n in lengths:
        per = [compare(r, c, s, n, gate.margin) for r, c, s in zip(ref["results"], run["results"], run["scored"])]
        for p, c in zip(per, run["results"]):
            p["prompt"] = c["prompt"]
        out[str(n)] = {"summary": judge(per, gate, base[str(n)]["summary"] if base else None), "prompts": per}
    return out


def markdown(report: dict) -> str:
    lines = ["| config | tokens | TF top-1 | token agreement | prompts equal | mean / max abs dlogprob "
             "| largest margin overturned | violations | new loops | result |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, cfg in report["configs"].items():
        for n, res in cfg["lengths"].items():
            s = res["summary"]
            verdict = "pass" if s["passed"] else "FAIL: " + "; ".join(s["reasons"])
            if name == report.get("baseline"):
                verdict = "baseline (not gated): " + verdict
            lines.append(f"| {name} | {n} | {s['tf_top1']:.3f} | {s['token_agreement']:.3f} | "
                         f"{s['prompts_equal']}/{len(res['prompts'])} | {s['mean_dlp']:.3f} / {s['max_dlp']:.2f} | "
                         f"{s['max_overturned_margin']:.3f} | {s['violations']} | {s['new_loops']} | {verdict} |")
    lines += ["", "First divergence per prompt (token index; '-' = equal), reference margin there:", ""]
    for name, cfg in report["configs"].items():
        n = max(cfg["lengths"], key=int)
        cells = [("-" if p["first_divergence"] is None else f"{p['first_divergence']} ({p['margin_at_divergence']})")
                 for p in cfg["lengths"][n]["prompts"]]
        lines.append(f"- {name} ({n} tokens): " + ", ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", required=True, help="checkpoint folder the configurations run on")
    ap.add_argument("--reference", help="bf16 folder of the same model (default: --model)")
    ap.add_argument("--configs", default="pypto-a8w8")
    ap.add_argument("--flag-combos", action="store_true", help="add pypto-a8w8 with each offered flag")
    ap.add_argument("--max-tokens", default="16,48")
    ap.add_argument("--prompts", help="a JSON list of prompts (default: 8 built-in zh/en prompts)")
    ap.add_argument("--chat", action="store_true", help="apply the chat template")
    ap.add_argument("--margin", type=float, default=1.0, help="a reference step this sure must not be overturned")
    ap.add_argument("--min-agreement", type=float, default=0.8, help="teacher-forced top-1 agreement floor")
    ap.add_argument("--max-mean-dlp", type=float, default=0.25, help="mean |dlogprob| ceiling (nats)")
    ap.add_argument("--baseline", help="judge the configs against this one (e.g. ct: vLLM's own W8A8) instead "
                    "of the absolute bars; it is reported, not gated")
    ap.add_argument("--out", default="results")
    ap.add_argument("--tag", default="quality")
    a = ap.parse_args(argv)
    configs = a.configs.split(",")
    if a.flag_combos:
        configs += [c for c in flag_combinations() if c not in configs]
    if a.baseline and a.baseline not in configs:
        configs.insert(0, a.baseline)
    configs.sort(key=lambda c: c != a.baseline)  # the baseline runs first: the others are judged against it
    parsed = [parse(c) for c in configs]  # unknown flags fail before any engine starts
    lengths = sorted(int(n) for n in a.max_tokens.split(","))
    prompts = PROMPTS
    if a.prompts:
        with open(a.prompts) as f:
            prompts = json.load(f)
    reference = a.reference or a.model
    if quantized(reference):
        ap.error(f"{reference} is a quantized folder; pass the bf16 folder of the same model as --reference")
    for c in parsed:
        if c.method == "bf16" or (c.method == "ct" and not quantized(a.model)):
            ap.error(f"config {c.name} on {a.model} would be the bf16 reference itself")

    report = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": platform.node(), "model": a.model,
              "baseline": a.baseline,
              "reference": reference, "prompts": prompts, "gate": {"margin": a.margin,
              "min_agreement": a.min_agreement, "max_mean_dlp": a.max_mean_dlp}, "configs": {}}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        ref = run_engine(reference, None, {}, prompts, lengths[-1], d, "reference", chat=a.chat)
        report["reference_outputs"] = [{"prompt": r["prompt"], "tokens": r["token_ids"], "text": r["text"]}
                                       for r in ref["results"]]
        items = [{"prompt_token_ids": r["prompt_token_ids"], "token_ids": r["token_ids"]} for r in ref["results"]]
        print(f"[{time.time() - t0:5.0f}s] reference done", flush=True)
        for c in parsed:
            run = run_engine(a.model, c.quantization, c.env, prompts, lengths[-1], d, f"cfg{len(report['configs'])}",
                             score=items, chat=a.chat)
            base = None if c.name == a.baseline or not a.baseline else report["configs"][a.baseline]["lengths"]
            report["configs"][c.name] = {"env": c.env, "lengths": evaluate(ref, run, lengths, a, base),
                                         "texts": [r["text"] for r in run["results"]]}
            s = report["configs"][c.name]["lengths"][str(lengths[-1])]["summary"]
            print(f"[{time.time() - t0:5.0f}s] {c.name}: {'pass' if s['passed'] else 'FAIL'} "
                  f"(TF top-1 {s['tf_top1']:.3f}, mean |dlp| {s['mean_dlp']:.3f}, {s['violations']} violations)",
                  flush=True)
    failed = [n for n, c in report["configs"].items() if n != a.baseline
              and not all(r["summary"]["passed"] for r in c["lengths"].values())]
    report["failed"] = failed
    md = markdown(report)
    stem = report_file.write(a.out, a.tag, report, md)
    print("\n" + md + f"\n\nwrote {stem}.json, {stem}.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
