"""The `pypto-a8w8` quantization method as vLLM sees it.

Two kinds of checkpoint: compressed-tensors W8A8 (int8 weight + weight_scale, taken
over from vLLM's own compressed-tensors method when the user asks for pypto-a8w8),
and plain bf16 Qwen3 (quantized per output channel at load). Embeddings and lm_head stay
bf16 (get_quant_method returns None for them), unless flag int8_lm_head makes the lm_head
one more A8W8 GEMM (quant/lm_head.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from .. import flags, sampling
from ..checkpoint import check_architecture, check_checkpoint
from .linear import PyptoA8W8LinearMethod
from .lm_head import PyptoA8W8LMHeadMethod
from .scheme import W8A8Scheme

NAME = "pypto-a8w8"
MODEL_ARCH = "PyptoQwen3ForCausalLM"  # registered by vllm_pypto.register
MODEL_ENV = "VLLM_PYPTO_MODEL"
logger = logging.getLogger("vllm.pypto")


@register_quantization_config(NAME)
class PyptoA8W8Config(QuantizationConfig):
    def __init__(self, scheme: W8A8Scheme | None = None, quant_description: dict | None = None):
        super().__init__()
        self.scheme = scheme  # None: a float checkpoint, quantized at load
        # vLLM-Ascend's layers read this from whatever quant config is active: AscendRMSNorm.__init__
        # iterates `vllm_config.quant_config.quant_description` (vllm_ascend/ops/layernorm.py,
        # vllm-ascend 0.23.0.post1), as its own configs carry it. Ours: the checkpoint's
        # quantization_config (no "norm.bias" entries, so it adds no norm biases), {} for bf16.
        self.quant_description = dict(quant_description or {})

    def __repr__(self) -> str:
        return f"PyptoA8W8Config(source={'compressed-tensors W8A8' if self.scheme else 'bf16'})"

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # no GPU capability involved

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # no checkpoint quantization_config means: quantize a float checkpoint at load

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PyptoA8W8Config":
        return cls(W8A8Scheme.from_compressed_tensors(config), config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # Take over a pre-quantized checkpoint only when the user asked for us;
        # from_config then refuses any scheme we do not implement.
        return NAME if user_quant == NAME else None

    def stored_int8(self, module: str) -> bool:
        """Whether the checkpoint stores `module` (an unfused HF name) as int8."""
        return self.scheme is not None and self.scheme.is_quantized(module)

    def _unfused(self, prefix: str) -> list[str]:
        parent, _, leaf = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(leaf)
        return [f"{parent}.{s}" for s in shards] if shards else [prefix]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        active = flags.active(getattr(get_current_vllm_config(), "additional_config", None))
        if "fast_top_k_top_p" in active:  # the sampler is vLLM's, in this worker process
            sampling.install()
        if isinstance(layer, ParallelLMHead) and "int8_lm_head" in active:
            return PyptoA8W8LMHeadMethod()
        if not isinstance(layer, LinearBase):
            return None  # embeddings, lm_head: bf16
        stored = {self.stored_int8(name) for name in self._unfused(prefix)}
        if len(stored) > 1:
            raise ValueError(f"{prefix}: the checkpoint quantizes only some of its fused shards "
                             f"{self._unfused(prefix)}; pypto-a8w8 needs all or none")
        source_int8 = stored.pop()
        if self.scheme is not None and not source_int8:
            logger.info("pypto-a8w8: %s is not quantized in the checkpoint (ignore list); running it in bf16",
                        prefix)
            return UnquantizedLinearMethod()
        run_bf16 = "bf16_down_proj" in active and prefix.endswith("mlp.down_proj")
        return PyptoA8W8LinearMethod(prefix, source_int8=source_int8, run_bf16=run_bf16)

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        """Preflight, before any weight is allocated: architecture and every linear tensor.
        Then point vLLM at our Qwen3 model class (vllm_pypto/model/qwen3.py)."""
        flags.parse(os.environ.get(flags.ENV))  # unknown names fail here, before the engine starts
        if hf_config is None or getattr(hf_config, "architectures", None) == [MODEL_ARCH]:
            return  # no config to check, or checked already (vLLM may build the config twice)
        check_architecture(hf_config)
        self._preflight(model_name, hf_config)
        model = os.environ.get(MODEL_ENV, "pypto").strip().lower()
        if model not in ("pypto", "vllm"):
            raise ValueError(f"{MODEL_ENV}={model!r}: choose pypto (fused decoder layers) or vllm (vLLM's Qwen3)")
        if model == "pypto":
            hf_config.architectures = [MODEL_ARCH]
        logger.info("pypto-a8w8: model class %s", hf_config.architectures[0])

    def _preflight(self, model_name: str, hf_config) -> None:
        if not os.path.isdir(model_name):
            logger.warning("pypto-a8w8: %s is not a local folder; checkpoint preflight skipped "
                           "(the loader still checks dtypes, shapes and scales)", model_name)
            return
        counts = check_checkpoint(model_name, hf_config, self.stored_int8)
        logger.info("pypto-a8w8: checkpoint %s passed preflight: %d int8 linears, %d float linears (%s)",
                    model_name, counts["int8"], counts["float"],
                    "quantized at load" if self.scheme is None else "kept bf16 per the ignore list")
