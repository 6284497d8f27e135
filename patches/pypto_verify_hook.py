"""The one private hook we replace in PyPI pypto 0.2.0, to check PyPTO kernels on a CPU.

Why: pypto's pass-verify interpreter computes real results on the CPU, but 0.2.0's jit
wrapper (`pypto.frontend.parser.entry.JitCallableWrapper._setup_verify_data`) hands it
host copies made by a stubbed copy routine, i.e. all zeros. Our replacement hands it the
real CPU tensors, so the interpreter writes real outputs into the torch tensors.

Only tests and benchmarks use it (vllm_pypto/kernels/ascend/verify.py); the NPU path never
does. `install()` refuses to patch anything but the exact method it was written for: if a
pypto upgrade changes it, tests/test_pypto.py fails loudly here instead of comparing zeros.
"""

from __future__ import annotations

import hashlib
import inspect

PYPTO_VERSION = "0.2.0"
# sha256 of inspect.getsource() of the method we replace, as shipped in pypto 0.2.0
ORIGINAL_SHA256 = "ac411d5078cfb2e4b62c1c240e378e42884f60fcca52260d79a9f7b039e823f2"


def original_source() -> str:
    from pypto.frontend.parser import entry

    fn = entry.JitCallableWrapper.__dict__["_setup_verify_data"]
    fn = getattr(fn, "__func__", fn)
    return inspect.getsource(getattr(fn, "_pypto_original", fn))


def original_sha256() -> str:
    return hashlib.sha256(original_source().encode()).hexdigest()


def _setup_verify_data(pto_tensors) -> None:
    import pypto
    from pypto import pypto_impl
    from pypto.frontend.parser import entry

    if not pypto.get_verify_options().get("enable_pass_verify"):
        return
    entry.BuildOnlineManager().build_and_load_calculator()
    # the real CPU tensors, not zero-filled host copies
    pypto_impl.SetVerifyData(entry._pto_to_tensor_data(pto_tensors), [], entry._pto_verify_datas.get_data())


def install() -> None:
    """Idempotent. Raises if pypto is not the version, or the method not the code, we patch."""
    import importlib.metadata

    from pypto.frontend.parser import entry

    version = importlib.metadata.version("pypto")
    if version != PYPTO_VERSION:
        raise RuntimeError(f"patches/pypto_verify_hook.py is for pypto=={PYPTO_VERSION}, found {version}")
    current = entry.JitCallableWrapper.__dict__["_setup_verify_data"]
    if getattr(getattr(current, "__func__", current), "_pypto_patched", False):
        return
    sha = original_sha256()
    if sha != ORIGINAL_SHA256:
        raise RuntimeError("pypto's JitCallableWrapper._setup_verify_data is not the code this patch replaces "
                           f"(sha256 {sha}); re-read it before changing the patch")
    _setup_verify_data._pypto_patched = True
    _setup_verify_data._pypto_original = getattr(current, "__func__", current)
    entry.JitCallableWrapper._setup_verify_data = staticmethod(_setup_verify_data)
