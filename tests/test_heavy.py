"""Opt-in (`make test-heavy`): full-size shapes. Slow and disk-hungry (14B W8A8 is ~15 GB)."""

import os
import resource

import pytest
from transformers import AutoConfig

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
