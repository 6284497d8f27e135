"""Accuracy with lm-eval against the running server: the same local zh/en tasks for the
bf16 reference and each A8W8 configuration, and the delta.

    python benchmarks/accuracy.py --model DIR [--reference BF16_DIR] [--configs pypto-a8w8] \
        [--tasks pypto_local] [--limit N] [--max-drop 0.02]

For every configuration it starts `vllm serve`, runs
`lm_eval --model local-completions` (tasks in benchmarks/lm_eval_tasks/, which carry
their own data: public task data cannot be downloaded here) with --log_samples, and
reads back each task's metric and each document's prediction. It prints, per task, the
reference's metric, the configuration's, the delta, and prediction agreement: the share
of documents where both chose the same answer. On random weights accuracy is chance and
its delta is noise; agreement is the number that moves when quantization breaks
something. The exit status is 1 when, on any task, a configuration's metric falls more
than --max-drop below the reference's or its agreement is below --min-agreement. Writes results/<date>-<machine>-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import glob
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
from configs import Config, parse  # noqa: E402  (benchmarks/configs.py)
from quality import quantized  # noqa: E402
from vllm_pypto.tools.server import VllmServer, console_script  # noqa: E402

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
GROUP = {"pypto_local": ["pypto_arith_en", "pypto_arith_zh", "pypto_capitals_en", "pypto_capitals_zh",
                         "pypto_arith_gen_en"]}


def run_lm_eval(url: str, tokenizer: str, tasks: list[str], out: str, limit: int | None) -> dict:
    """lm_eval against an OpenAI-compatible completions endpoint; returns its results JSON
    and the per-document samples by task."""
    model_args = (f"model=m,base_url={url}/v1/completions,tokenizer={tokenizer},num_concurrent=4,"
                  "max_retries=2,tokenized_requests=False")
    cmd = [console_script("lm_eval"), "--model", "local-completions", "--model_args", model_args, "--tasks", ",".join(tasks),
           "--include_path", TASKS_DIR, "--output_path", out, "--log_samples", "--seed", "0"]
    cmd += ["--limit", str(limit)] if limit else []
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, cwd=TASKS_DIR, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    (results,) = glob.glob(os.path.join(out, "*", "results_*.json"))
    with open(results) as f:
        res = json.load(f)
    samples = {}
    for t in tasks:
        (path,) = glob.glob(os.path.join(out, "*", f"samples_{t}_*.jsonl"))
        with open(path) as f:
            samples[t] = [json.loads(line) for line in f]
    return {"results": res["results"], "samples": samples}


def prediction(sample: dict):
    """The document's chosen answer: argmax loglikelihood (multiple choice) or the generated text."""
    resps = sample["filtered_resps"]
    if resps and isinstance(resps[0], list):
        lls = [float(r[0]) for r in resps]
        return max(range(len(lls)), key=lls.__getitem__)
    return sample["resps"][0][0]  # generation: the raw text (the filter maps every non-number alike)


def metric_of(task_result: dict) -> tuple[str, float]:
    """The task's headline metric (acc for multiple choice, exact_match for generation)."""
    for key, value in task_result.items():
        if key.split(",")[0] in ("acc", "exact_match") and "stderr" not in key:
            return key, value
    raise KeyError(f"no acc/exact_match in {sorted(task_result)}")


def compare(ref: dict, run: dict, tasks: list[str]) -> list[dict]:
    rows = []
    for t in tasks:
        key, r = metric_of(ref["results"][t])
        _, c = metric_of(run["results"][t])
        rp = {s["doc_id"]: prediction(s) for s in ref["samples"][t]}
        cp = {s["doc_id"]: prediction(s) for s in run["samples"][t]}
        same = sum(rp[d] == cp.get(d) for d in rp)
        rows.append({"task": t, "metric": key, "reference": r, "config": c, "delta": c - r,
                     "agreement": same / len(rp), "docs": len(rp)})
    return rows


def serve_and_eval(model: str, c: Config | None, tasks: list[str], limit: int | None, workdir: str) -> dict:
    args = ["--max-model-len", "1024", "--served-model-name", "m", *(c.serve_args() if c else [])]
    t0 = time.time()
    with VllmServer(model, *args, env=c.env if c else {}) as s:
        out = run_lm_eval(s.url, model, tasks, os.path.join(workdir, c.name if c else "reference"), limit)
    print(f"  {c.name if c else 'bf16 reference'}: {time.time() - t0:.0f}s", flush=True)
    return out


def markdown(report: dict) -> str:
    lines = ["| config | task | metric | bf16 reference | config | delta | prediction agreement | docs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in report["configs"].items():
        for r in rows:
            lines.append(f"| {name} | {r['task']} | {r['metric']} | {r['reference']:.3f} | {r['config']:.3f} | "
                         f"{r['delta']:+.3f} | {r['agreement']:.3f} | {r['docs']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--reference", help="bf16 folder of the same model (default: --model)")
    ap.add_argument("--configs", default="pypto-a8w8")
    ap.add_argument("--tasks", default="pypto_local", help="task names or the group pypto_local")
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--max-drop", type=float, default=None, help="fail when a metric drops more than this")
    ap.add_argument("--min-agreement", type=float, default=None, help="fail when prediction agreement is lower")
    ap.add_argument("--out", default="results")
    ap.add_argument("--tag", default="accuracy")
    a = ap.parse_args(argv)
    configs = [parse(c) for c in a.configs.split(",")]
    tasks = [t for name in a.tasks.split(",") for t in GROUP.get(name, [name])]
    reference = a.reference or a.model
    if quantized(reference):
        ap.error(f"{reference} is a quantized folder; pass the bf16 folder of the same model as --reference")
    report = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": platform.node(), "model": a.model,
              "reference": reference, "tasks": tasks, "limit": a.limit, "configs": {}}
    with tempfile.TemporaryDirectory() as d:
        ref = serve_and_eval(reference, None, tasks, a.limit, d)
        for c in configs:
            report["configs"][c.name] = compare(ref, serve_and_eval(a.model, c, tasks, a.limit, d), tasks)
    report["failed"] = [f"{n} {r['task']}: {r['metric']} {r['delta']:+.3f}, agreement {r['agreement']:.3f}"
                        for n, rows in report["configs"].items() for r in rows
                        if (a.max_drop is not None and r["delta"] < -a.max_drop)
                        or (a.min_agreement is not None and r["agreement"] < a.min_agreement)]
    md = markdown(report)
    stem = report_file.write(a.out, a.tag, report, md)
    print("\n" + md + f"\n\nwrote {stem}.json, {stem}.md")
    if report["failed"]:
        print("FAIL: " + "; ".join(report["failed"]))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
