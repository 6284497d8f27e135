"""Run our PyPTO kernels on this CPU: real results from pypto's pass-verify interpreter, and
task counts and simulated device time from its cost model. For tests and benchmarks only.

pypto writes large folders under ./output and logs under ~/ascend/log on every call; both
go to a temporary directory that is removed afterwards. 0.2.0 needs one private hook
replaced to hand the interpreter real tensors: patches/pypto_verify_hook.py (checked there).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import shutil
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HOOK = os.path.join(ROOT, "patches", "pypto_verify_hook.py")


def hook():
    if not os.path.exists(HOOK):
        raise RuntimeError(f"{HOOK} is missing: CPU verification of PyPTO kernels needs the repository checkout")
    spec = importlib.util.spec_from_file_location("pypto_verify_hook", HOOK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def scratch():
    """cwd and HOME in a temporary directory (pypto's ./output and ~/ascend/log), removed after."""
    old_cwd, old_home = os.getcwd(), os.environ.get("HOME")
    tmp = tempfile.mkdtemp(prefix="vllm-pypto-")
    os.chdir(tmp)
    os.environ["HOME"] = tmp
    try:
        yield tmp
    finally:
        os.chdir(old_cwd)
        if old_home is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = old_home
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def interpreter():
    """Kernels built with run_mode=SIM and called inside compute real results into their torch
    output tensors (pypto's pass-verify interpreter)."""
    import pypto

    hook().install()
    with scratch():
        pypto.set_verify_options(enable_pass_verify=True, pass_verify_pass_filter=[])
        try:
            yield
        finally:
            pypto.set_verify_options(enable_pass_verify=False)


def run_on_cpu(kernel, *tensors):
    """Call a kernel built with run_mode=SIM through the interpreter, with real torch tensors."""
    with interpreter():
        return kernel(*tensors)


def cost_model(kernel, *tensors) -> dict:
    """Tasks and simulated device time from pypto's cost model (run_mode SIM, no interpreter;
    outputs stay untouched): {"tasks", "cube_tasks", "vector_tasks", "cycles", "aicore_us"}."""
    import pypto

    with scratch() as tmp:
        pypto.set_verify_options(enable_pass_verify=False)
        log = os.path.join(tmp, "stdout.txt")
        with open(log, "w") as f, _fd_redirect(f):  # the summary is printed by pypto's own tools
            kernel(*tensors)
        with open(log) as f:
            text = f.read()
        for report in glob.glob(os.path.join(tmp, "output", "*", "CostModelSimulationOutput",
                                             "_simulate.stat.report.txt")):
            with open(report) as f:
                text += f.read()
    out = {"tasks": _num(r"Total Submit Tasks\.*:\s*(\d+)", text), "cube_tasks": _num(r"\|--Cube Tasks\.*:\s*(\d+)", text),
           "vector_tasks": _num(r"\|--Vector Tasks\.*:\s*(\d+)", text), "cycles": _num(r"Total Cycles\.*:\s*(\d+)", text),
           "aicore_us": _num(r"AICore End-to-End Time:\s*([\d.]+)", text)}
    if out["tasks"] is None:
        raise RuntimeError(f"pypto's cost model printed no task count:\n{text[-3000:]}")
    return out


def _num(pattern: str, text: str):
    m = re.search(pattern, text)
    return None if m is None else float(m.group(1)) if "." in m.group(1) else int(m.group(1))


@contextlib.contextmanager
def _fd_redirect(f):
    """stdout and stderr at the file-descriptor level (C++ and child processes write there)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
