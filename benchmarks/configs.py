"""The configuration grammar every benchmark shares, so one name means one thing in
tpot.py, serving.py, quality.py and accuracy.py:

    method[:fmt][@backend][+<isa>][+vllm-model][+allcores][+<flag>...]

- method: `bf16` (stock vLLM, no quantization), `ct` (vLLM-CPU's own compressed-tensors
  path; needs a W8A8 folder) or `pypto-a8w8` (ours);
- fmt: the checkpoint folder to use, `bf16` or `w8a8` (default: bf16 for bf16/pypto-a8w8,
  w8a8 for ct);
- @backend: our kernel backend, VLLM_PYPTO_BACKEND (`reference`, `cpu`, `pypto`);
- +<isa> (amx, avx512, avx_vnni, avx2): the cpu backend on that ISA path (VLLM_PYPTO_CPU_ISA;
  a path this CPU lacks fails at start-up); +vllm-model: vLLM's Qwen3 class with our
  linears; +<flag>: a flag of vllm_pypto.flags (unknown names fail here, before any start);
- +allcores (any method): VLLM_CPU_NUM_OF_RESERVED_CPU=0, so vLLM-CPU's worker computes on every
  CPU instead of leaving one per rank to its scheduler process (halves the compute threads on a
  2-CPU machine; docs/performance.md, "CPU threads").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from vllm_pypto import flags

METHODS = ("bf16", "ct", "pypto-a8w8")
ISAS = ("amx", "avx512", "avx_vnni", "avx2")
MODS = (*ISAS, "vllm-model", "allcores")
ANY_METHOD_MODS = ("allcores",)


@dataclass(frozen=True)
class Config:
    name: str
    method: str
    fmt: str
    backend: str = ""
    flags: tuple[str, ...] = ()
    mods: tuple[str, ...] = ()

    @property
    def quantization(self) -> str | None:
        """vLLM's --quantization value (None: the checkpoint's own, or none for bf16)."""
        return "pypto-a8w8" if self.method == "pypto-a8w8" else None

    @property
    def env(self) -> dict:
        """The environment that selects this configuration in vllm serve or an engine."""
        env = {}
        if self.backend:
            env["VLLM_PYPTO_BACKEND"] = self.backend
        if self.flags:
            env[flags.ENV] = ",".join(self.flags)
        for isa in set(ISAS) & set(self.mods):
            env["VLLM_PYPTO_CPU_ISA"] = isa
        if "vllm-model" in self.mods:
            env["VLLM_PYPTO_MODEL"] = "vllm"
        if "allcores" in self.mods:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return env

    def serve_args(self) -> list[str]:
        return ["--quantization", self.quantization] if self.quantization else []


def parse(name: str) -> Config:
    head, *mods = name.split("+")
    spec, _, backend = head.partition("@")
    method, _, fmt = spec.partition(":")
    if method not in METHODS:
        raise ValueError(f"config {name!r}: method must be one of {', '.join(METHODS)}, not {method!r}")
    fmt = fmt or ("w8a8" if method == "ct" else "bf16")
    if fmt not in ("bf16", "w8a8") or (method == "ct" and fmt != "w8a8"):
        raise ValueError(f"config {name!r}: format {fmt!r} is not one this method runs")
    chosen = tuple(m for m in mods if m not in MODS)
    if (backend or [m for m in mods if m not in ANY_METHOD_MODS]) and method != "pypto-a8w8":
        raise ValueError(f"config {name!r}: @backend and +modifiers apply to pypto-a8w8 only")
    flags.parse(chosen)  # raises with the list of valid flags
    return Config(name, method, fmt, backend, chosen, tuple(m for m in mods if m in MODS))


def offered_flags() -> list[str]:
    """Flags a user may turn on (test-only guardrails excluded)."""
    return [f.name for f in flags.FLAGS.values() if not f.test_only]


def flag_combinations(base: str = "pypto-a8w8", all_subsets: bool = False) -> list[str]:
    """base, base+each offered flag, and base with every experimental flag at once; with
    all_subsets, every non-empty subset of the offered flags."""
    names = offered_flags()
    if all_subsets:
        subsets = [c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]
    else:
        together = tuple(n for n in names if flags.FLAGS[n].status == "experimental")
        subsets = [(n,) for n in names] + ([together] if len(together) > 1 else [])
    return [base] + [base + "".join("+" + n for n in s) for s in subsets]
