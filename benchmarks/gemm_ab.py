"""A/B of the native GEMM between two revisions of csrc/: the ISA path's kernel from a git
revision (default HEAD) and from the working tree, each built without torch around
benchmarks/gemm_ab_driver.cpp, run in turn round after round on the linears of a Qwen3 shape,
with weights read from DRAM. On a shared host that drifts by tens of percent within minutes,
only runs interleaved like this tell a kernel change of 10-30% from the noise.

    python benchmarks/gemm_ab.py --isa avx512 --ms 1,64                 # HEAD against the work tree
    python benchmarks/gemm_ab.py --base HEAD~1 --head HEAD --rounds 9     # two commits

It also checks that both builds give the same output bits (a hash per shape), and writes
results/<date>-<machine>-gemm-ab[-tag].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import report as report_file  # noqa: E402  (benchmarks/report.py)
from linear import isa_paths  # noqa: E402
from vllm_pypto.kernels.select import cpu_isa_flags, cpu_model  # noqa: E402
from vllm_pypto.tools.shapes import SHAPES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("isa_avx2.cpp", "isa_avx512.cpp", "isa_amx.cpp")  # the kernel tables the driver names, torch-free


def export_csrc(rev: str | None, dest: str) -> str:
    """csrc/ at a git revision into dest, or a folder as it is (None: the working tree's csrc/)."""
    if rev is None:
        return os.path.join(ROOT, "csrc")
    if os.path.isdir(rev):
        return rev
    os.makedirs(dest)
    names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", f"{rev}:csrc"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:csrc/{name}"], check=True, capture_output=True).stdout
        with open(os.path.join(dest, name), "wb") as f:
            f.write(blob)
    return dest


def build(csrc: str, out: str) -> str:
    cxx = os.environ.get("CXX", "g++")
    cmd = [cxx, "-O3", "-fopenmp", "-std=c++17", "-I", csrc, os.path.join(ROOT, "benchmarks", "gemm_ab_driver.cpp"),
           *(os.path.join(csrc, s) for s in SOURCES), "-o", out]
    subprocess.run(cmd, check=True)
    return out


def run(exe: str, isa: str, m: int, k: int, n: int, threads: int, seconds: float) -> dict:
    out = subprocess.run([exe, isa, str(m), str(k), str(n), str(threads), str(seconds)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision (or csrc folder) of the A build")
    ap.add_argument("--head", default=None, help="git revision (or csrc folder) of the B build (default: the working tree)")
    ap.add_argument("--isa", default="avx512", choices=("avx512", "avx2", "avx_vnni", "amx"))
    ap.add_argument("--model", default="14B", help="Qwen3 shape whose linears to run")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="1,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seconds", type=float, default=1.0, help="per run (each run is a new process)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    isa_paths(a.isa)  # a path this CPU lacks exits here, by name, not as an illegal instruction in a build
    linears = SHAPES[a.model].linears()
    cases = [(s, m, *linears[s]) for s in a.shapes.split(",") for m in (int(x) for x in a.ms.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        exes = {}
        for label, rev in (("A", a.base), ("B", a.head)):
            exes[label] = build(export_csrc(rev, os.path.join(tmp, label)), os.path.join(tmp, f"drv-{label}"))
        runs: dict = {(c[0], c[1], label): [] for c in cases for label in exes}
        for r in range(a.rounds):
            for shape, m, n, k in cases:
                order = ("A", "B") if r % 2 == 0 else ("B", "A")  # who goes first alternates
                for label in order:
                    res = run(exes[label], a.isa, m, k, n, a.threads, a.seconds)
                    runs[(shape, m, label)].append(res)
                    print(json.dumps({"round": r, "shape": shape, "M": m, "build": label, **res}), flush=True)
    rows = []
    for shape, m, n, k in cases:
        A, B = runs[(shape, m, "A")], runs[(shape, m, "B")]
        same = {x["hash"] for x in A} == {x["hash"] for x in B} and len({x["hash"] for x in A}) == 1
        med = {lab: statistics.median(x["ms"] for x in rs) for lab, rs in (("A", A), ("B", B))}
        wins = sum(b["ms"] < a_["ms"] for a_, b in zip(A, B))
        rows.append({"shape": shape, "N": n, "K": k, "M": m, "A_ms": med["A"], "B_ms": med["B"],
                     "A_GOPS": 2 * m * n * k / med["A"] / 1e6, "B_GOPS": 2 * m * n * k / med["B"] / 1e6,
                     "A_weight_GBs": n * k / med["A"] / 1e6, "B_weight_GBs": n * k / med["B"] / 1e6,
                     "B_speedup": med["A"] / med["B"], "B_faster_rounds": wins, "rounds": a.rounds,
                     "same_output": same})
    head = a.head or "working tree"
    lines = [f"GEMM A/B on {cpu_model()} ({' '.join(cpu_isa_flags())}), ISA path {a.isa}, {a.threads} threads, "
             f"Qwen3-{a.model} linears, weights from DRAM. A = {a.base}, B = {head}; {a.rounds} interleaved rounds, "
             f"a new process per run; medians. Command: `python benchmarks/gemm_ab.py {' '.join(sys.argv[1:])}`", "",
             "| shape (N x K) | M | A ms | B ms | A GOPS | B GOPS | A GB/s | B GB/s | B speed-up | B faster in | same bits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['shape']} {r['N']} x {r['K']} | {r['M']} | {r['A_ms']:.3f} | {r['B_ms']:.3f} | "
                     f"{r['A_GOPS']:.0f} | {r['B_GOPS']:.0f} | {r['A_weight_GBs']:.1f} | {r['B_weight_GBs']:.1f} | "
                     f"{r['B_speedup']:.2f}x | {r['B_faster_rounds']}/{r['rounds']} | {'yes' if r['same_output'] else 'NO'} |")
    md = "\n".join(lines)
    print(md)
    stem = report_file.write(a.out, "gemm-ab" + (f"-{a.tag}" if a.tag else ""),
                             {"cpu": cpu_model(), "isa": a.isa, "base": a.base, "head": head, "threads": a.threads,
                              "rows": rows, "runs": [{"shape": s, "M": m, "build": lab, "runs": v}
                                                     for (s, m, lab), v in runs.items()]}, md)
    print(f"wrote {stem}.json/.md")
    if not all(r["same_output"] for r in rows):
        sys.exit("the two builds' outputs differ: a kernel change must keep every bit")


if __name__ == "__main__":
    main()
