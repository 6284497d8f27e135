"""The one private hook we replace in PyPI pypto 0.2.0, to check PyPTO kernels on a CPU.

Why: pypto's pass-verify interpreter computes real results on the CPU, but 0.2.0's jit
wrapper (`pypto.frontend.parser.entry.JitCallableWrapper._setup_verify_data`) hands it
host copies made by a stubbed copy routine, i.e. all zeros. Our replacement hands it the
real CPU tensors, so the interpreter writes real outputs into the torch tensors.

It also caches the interpreter's calculator library: pypto 0.2.0 builds it with cmake + g++ in a
temporary folder in every process that first interprets a kernel (45-75 s on 2 cores, before
each test engine's first step); `load_calculator()` builds it once into
~/.cache/vllm-pypto (or $VLLM_PYPTO_CACHE_DIR), keyed by the pypto and torch versions, and loads
that copy in later processes.

Only tests, benchmarks and the pypto-interpret backend use it (vllm_pypto/kernels/ascend/verify.py);
the NPU path never does. `install()` refuses to patch anything but the exact methods it was written
for: if a pypto upgrade changes them, tests/test_pypto.py fails loudly here instead of comparing zeros.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import os
import shutil
import tempfile
from pathlib import Path

PYPTO_VERSION = "0.2.0"
# sha256 of inspect.getsource() of the method we replace, as shipped in pypto 0.2.0
ORIGINAL_SHA256 = "ac411d5078cfb2e4b62c1c240e378e42884f60fcca52260d79a9f7b039e823f2"
# ... and of BuildOnlineManager.build_and_load_calculator, whose build load_calculator() caches
CALCULATOR_SHA256 = "31990c4974df4fe570965a90a0a7de04cb2e93bc45f8239bbcf88be7479bb145"
# resolved at import: the interpreter's callers may point HOME at a scratch folder
CACHE_DIR = Path(os.environ.get("VLLM_PYPTO_CACHE_DIR") or Path.home() / ".cache" / "vllm-pypto")


def original_source() -> str:
    from pypto.frontend.parser import entry

    fn = entry.JitCallableWrapper.__dict__["_setup_verify_data"]
    fn = getattr(fn, "__func__", fn)
    return inspect.getsource(getattr(fn, "_pypto_original", fn))


def original_sha256() -> str:
    return hashlib.sha256(original_source().encode()).hexdigest()


def calculator_sha256() -> str:
    from pypto._utils import BuildOnlineManager

    return hashlib.sha256(inspect.getsource(BuildOnlineManager.build_and_load_calculator).encode()).hexdigest()


def load_calculator() -> None:
    """What BuildOnlineManager.build_and_load_calculator does, with the built library kept in
    CACHE_DIR (built in a private folder, then renamed into place, so concurrent builds are safe)."""
    import importlib.metadata

    import torch
    from pypto._utils import BuildOnlineManager

    mgr = BuildOnlineManager()
    if mgr.calculator_loaded:
        return
    key = f"calculator-pypto{importlib.metadata.version('pypto')}-torch{torch.__version__}"
    key += f"-abi{int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    final = CACHE_DIR / key
    lib = final / "lib" / "libtile_fwk_calculator.so"
    if not lib.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="build-", dir=CACHE_DIR))
        try:
            ctx = mgr._CMakeContext.CompileContext(src_dir=Path(mgr.pkg_lib_dir, "calculator"), tmp_dir=work)
            ctx.cfg_cmd_ext = (f"-DPY3_MOD_TORCH_VERSION={torch.__version__} "
                               f"-DPY3_MOD_TORCH_ROOT_PATH={Path(torch.__file__).parent} "
                               f"-DPY3_MOD_TORCH_C_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
            installed = mgr._CMakeContext().compile(ctx=ctx)
            try:
                os.rename(installed, final)
            except OSError:
                if not lib.exists():  # another process won the race: use its copy
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    mgr.calculator_loaded = True


def _setup_verify_data(pto_tensors) -> None:
    import pypto
    from pypto import pypto_impl
    from pypto.frontend.parser import entry

    if not pypto.get_verify_options().get("enable_pass_verify"):
        return
    load_calculator()
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
    if (sha := calculator_sha256()) != CALCULATOR_SHA256:
        raise RuntimeError("pypto's BuildOnlineManager.build_and_load_calculator is not the build load_calculator() "
                           f"caches (sha256 {sha}); re-read it before changing the patch")
    _setup_verify_data._pypto_patched = True
    _setup_verify_data._pypto_original = getattr(current, "__func__", current)
    entry.JitCallableWrapper._setup_verify_data = staticmethod(_setup_verify_data)
