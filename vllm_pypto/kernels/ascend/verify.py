"""Run our PyPTO kernels on this CPU: real results from pypto's pass-verify interpreter, and
task counts and simulated device time from its cost model. For tests, benchmarks and the
`pypto-interpret` backend (a correctness tool for the Ascend serving path, never a CPU serving mode).

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
import threading

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
    from . import import_pypto

    pypto = import_pypto()
    hook().install()
    with scratch():
        pypto.set_verify_options(enable_pass_verify=True, pass_verify_pass_filter=[])
        try:
            yield
        finally:
            pypto.set_verify_options(enable_pass_verify=False)


class Interpreter:
    """pypto's interpreter inside a serving process: each call runs from one scratch folder of
    this process (pypto writes ./output there; it is emptied after every call), with pypto's own
    console output kept in that folder and shown only when a call fails. Calls are serialized."""

    def __init__(self):
        from . import import_pypto

        pypto = import_pypto()
        self.dir = tempfile.mkdtemp(prefix="vllm-pypto-interpret-")
        self.log = os.path.join(self.dir, "pypto.log")
        self._lock = threading.Lock()
        hook().install()
        pypto.set_verify_options(enable_pass_verify=True, pass_verify_pass_filter=[])
        from .backend import at_exit

        at_exit(lambda: shutil.rmtree(self.dir, ignore_errors=True))

    def __call__(self, kernel, *tensors) -> None:
        with self._lock:
            cwd = os.getcwd()
            os.chdir(self.dir)
            try:
                with open(self.log, "w") as f, _fd_redirect(f):
                    kernel(*tensors)
            except Exception as e:
                with open(self.log, errors="replace") as f:
                    tail = f.read()[-4000:]
                raise RuntimeError(f"pypto interpreter call failed: {e}\n--- pypto output ---\n{tail}") from e
            finally:
                os.chdir(cwd)
                shutil.rmtree(os.path.join(self.dir, "output"), ignore_errors=True)


def run_on_cpu(kernel, *tensors):
    """Call a kernel built with run_mode=SIM through the interpreter, with real torch tensors."""
    with interpreter():
        return kernel(*tensors)


def cost_model(kernel, *tensors) -> dict:
    """Tasks and simulated device time from pypto's cost model (run_mode SIM, no interpreter;
    outputs stay untouched): {"tasks", "cube_tasks", "vector_tasks", "cycles", "aicore_us"}."""
    from . import import_pypto

    pypto = import_pypto()
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
