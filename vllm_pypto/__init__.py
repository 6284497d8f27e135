"""vllm-pypto: Qwen3 A8W8 serving for vLLM (`--quantization pypto-a8w8`)."""

__version__ = "0.1.0"


def register() -> None:
    """The `vllm.general_plugins` entry point. vLLM calls it in every process, sometimes
    more than once; importing the config module registers the method exactly once
    (Python caches the import). The model class is registered by name and imported only
    when vLLM resolves it, i.e. only under pypto-a8w8."""
    from vllm import ModelRegistry

    from .quant import config

    _accepted_by_the_platform(config.NAME)
    _checked_first(config.NAME)
    if config.MODEL_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(config.MODEL_ARCH, "vllm_pypto.model.qwen3:PyptoQwen3ForCausalLM")


def _accepted_by_the_platform(name: str) -> None:
    """A platform that lists the quantization methods it accepts refuses every other name in
    vLLM's ModelConfig._verify_quantization (Platform.verify_quantization). vLLM-Ascend's
    NPUPlatform does (vllm_ascend/platform.py, `supported_quantization`, vllm-ascend 0.23.0.post1),
    and general plugins load before that check in every process, so add ours to the active
    platform's list. vLLM 0.32's register_quantization_config does the same when it first
    registers a name, but not when the platform is resolved after our config module was imported."""
    from vllm.platforms import current_platform

    accepted = current_platform.supported_quantization
    if accepted and name not in accepted:
        accepted.append(name)


def _checked_first(name: str) -> None:
    """vLLM asks every registered method, in QUANTIZATION_METHODS order, whether it takes over a
    pre-quantized checkpoint (override_quantization_method), and the first to answer wins. Ours
    answers only when the user passed --quantization pypto-a8w8, so it goes first: a platform's own
    takeover (vLLM-Ascend's AscendModelSlimConfig claims every quantization_config without a
    quant_method on an NPU, quantization/modelslim_config.py, 0.23.0.post1) never overrides that choice."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if QUANTIZATION_METHODS and QUANTIZATION_METHODS[0] != name:
        QUANTIZATION_METHODS.remove(name)
        QUANTIZATION_METHODS.insert(0, name)
