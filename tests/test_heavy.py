"""Opt-in (`make test-heavy`): full-size shapes. Slow and disk-hungry (14B W8A8 is ~15 GB)."""

import os
import resource
import shutil

import pytest
from transformers import AutoConfig

from conftest import peak_rss_gib
from vllm_pypto.checkpoint import check_checkpoint
from vllm_pypto.tools.make_checkpoint import make_checkpoint


@pytest.mark.heavy
def test_full_14b_w8a8_checkpoint_fits_in_24gib(tmp_path):
    out = make_checkpoint(str(tmp_path / "qwen3-14b-w8a8"), "14B", "w8a8", tokenizer=False)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    size_gib = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 2**30
    assert peak_gib < 12, f"peak RSS {peak_gib:.1f} GiB"
    assert 14 < size_gib < 17
    counts = check_checkpoint(out, AutoConfig.from_pretrained(out), lambda m: True)
    assert counts == {"int8": 40 * 7, "float": 0}


@pytest.mark.heavy
def test_14b_bf16_quantized_offline_and_at_load_on_24gib(tmp_path):
    """Qwen3-14B bf16 (29.5 GB on disk) on this 24 GiB machine: the offline tool and
    quantize-at-load both stay far below the bf16 model's size. Prints the peaks for the notes."""
    import sys

    bf16 = make_checkpoint(str(tmp_path / "qwen3-14b-bf16"), "14B", "bf16")
    tool = peak_rss_gib([sys.executable, "-m", "vllm_pypto.tools.quantize", bf16, str(tmp_path / "w8a8")])
    print(f"\noffline tool on 14B bf16: peak RSS {tool:.1f} GiB")
    assert tool < 8
    counts = check_checkpoint(str(tmp_path / "w8a8"), AutoConfig.from_pretrained(str(tmp_path / "w8a8")),
                              lambda m: True)
    assert counts == {"int8": 40 * 7, "float": 0}
    shutil.rmtree(tmp_path / "w8a8")  # disk: both folders and the page cache are 45 GB
    at_load = peak_rss_gib([sys.executable, "-m", "vllm_pypto.tools.generate", "--model", bf16, "--quantization",
                             "pypto-a8w8", "--max-tokens", "2", "--enforce-eager", "--max-model-len", "512",
                             "--prompt", "The capital of France is", "--out", str(tmp_path / "g.json")],
                            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    print(f"14B bf16 quantized at load: peak RSS {at_load:.1f} GiB")
    assert at_load < 22
