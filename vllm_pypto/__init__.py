"""vllm-pypto: Qwen3 A8W8 serving for vLLM (`--quantization pypto-a8w8`)."""

__version__ = "0.1.0"


def register() -> None:
    """The `vllm.general_plugins` entry point. vLLM calls it in every process, sometimes
    more than once; importing the config module registers the method exactly once
    (Python caches the import)."""
    from .quant import config  # noqa: F401
