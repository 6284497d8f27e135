"""compressed-tensors configs: the one scheme we implement is accepted, everything else is
refused with the field and value named."""

import copy

import pytest

from vllm_pypto.quant.scheme import UnsupportedScheme, W8A8Scheme
from vllm_pypto.tools.make_checkpoint import W8A8_QUANTIZATION_CONFIG as GOOD


def test_our_checkpoint_config_is_valid_compressed_tensors():
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    cfg = QuantizationConfig.model_validate(GOOD)
    scheme = cfg.config_groups["group_0"]
    assert scheme.weights.strategy == QuantizationStrategy.CHANNEL and scheme.weights.num_bits == 8
    assert scheme.input_activations.dynamic is True and scheme.input_activations.strategy == "token"
    s = W8A8Scheme.from_compressed_tensors(GOOD)
    assert s.is_quantized("model.layers.3.mlp.down_proj") and not s.is_quantized("lm_head")


def _mutate(path: str, value):
    cfg = copy.deepcopy(GOOD)
    node = cfg
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return cfg


@pytest.mark.parametrize("path,value,needle", [
    ("config_groups.group_0.weights.symmetric", False, "weights.symmetric = False"),
    ("config_groups.group_0.weights.strategy", "group", "weights.strategy = 'group'"),
    ("config_groups.group_0.weights.group_size", 128, "weights.group_size = 128"),
    ("config_groups.group_0.weights.num_bits", 4, "weights.num_bits = 4"),
    ("config_groups.group_0.weights.type", "float", "weights.type = 'float'"),
    ("config_groups.group_0.input_activations.dynamic", False, "input_activations.dynamic = False"),
    ("config_groups.group_0.input_activations.strategy", "tensor", "input_activations.strategy = 'tensor'"),
    ("config_groups.group_0.input_activations.symmetric", False, "input_activations.symmetric = False"),
    ("config_groups.group_0.input_activations", None, "input_activations = None"),
    ("format", "float-quantized", "format = 'float-quantized'"),
    ("format", "pack-quantized", "format = 'pack-quantized'"),
    ("quant_method", "gptq", "quant_method = 'gptq'"),
    ("kv_cache_scheme", {"num_bits": 8, "type": "float"}, "kv_cache_scheme"),
    ("quantization_status", "frozen", "quantization_status = 'frozen'"),
])
def test_unsupported_schemes_are_refused_by_name(path, value, needle):
    with pytest.raises(UnsupportedScheme) as e:
        W8A8Scheme.from_compressed_tensors(_mutate(path, value))
    assert needle in str(e.value)
    assert "pypto-a8w8" in str(e.value)


def test_ignore_list_and_regex_targets():
    cfg = _mutate("ignore", ["lm_head", "re:.*mlp.down_proj$"])
    s = W8A8Scheme.from_compressed_tensors(cfg)
    assert not s.is_quantized("model.layers.0.mlp.down_proj")
    assert s.is_quantized("model.layers.0.mlp.up_proj")
    cfg = _mutate("config_groups.group_0.targets", ["re:.*self_attn.*"])
    s = W8A8Scheme.from_compressed_tensors(cfg)
    assert s.is_quantized("model.layers.1.self_attn.o_proj") and not s.is_quantized("model.layers.1.mlp.gate_proj")
