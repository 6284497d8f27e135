"""vllm-pypto: Qwen3 A8W8 serving for vLLM (`--quantization pypto-a8w8`)."""

__version__ = "0.1.0"


def register() -> None:
    """The `vllm.general_plugins` entry point. vLLM calls it in every process, sometimes
    more than once; importing the config module registers the method exactly once
    (Python caches the import). The model class is registered by name and imported only
    when vLLM resolves it, i.e. only under pypto-a8w8."""
    from vllm import ModelRegistry

    from .quant import config

    if config.MODEL_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(config.MODEL_ARCH, "vllm_pypto.model.qwen3:PyptoQwen3ForCausalLM")
