"""quantization_config: what we write, what we accept, and clear refusals of the rest."""

import copy

import pytest

from eightbit.quant.checkpoint_format import (
    UnsupportedQuantizationConfig,
    build_quantization_config,
    read_calibration_summary,
    read_quantization_config,
)
from eightbit.quant.errors import QuantizeError
from eightbit.quant.schemes import KVCacheScheme, QuantScheme


def written(group_size=32, calibration=None):
    return {"model_type": "llama", "quantization_config": build_quantization_config(
        QuantScheme(kv_cache=KVCacheScheme(group_size=group_size)), calibration)}


def test_written_config_has_the_compressed_tensors_w8a8_shape():
    qc = written()["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    assert qc["ignore"] == ["lm_head"] and qc["kv_cache_scheme"] is None
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"]
    w, a = group["weights"], group["input_activations"]
    assert (w["num_bits"], w["type"], w["strategy"], w["symmetric"], w["dynamic"]) == (8, "int", "channel", True, False)
    assert (a["num_bits"], a["type"], a["strategy"], a["symmetric"], a["dynamic"]) == (8, "int", "token", True, True)


def test_round_trip():
    cfg = written(16, {"data": {"source": "x.txt"}})
    scheme = read_quantization_config(cfg)
    assert scheme == QuantScheme(kv_cache=KVCacheScheme(group_size=16))
    assert read_calibration_summary(cfg) == {"data": {"source": "x.txt"}}


def test_reads_a_transformers_config_object():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=1)
    cfg.quantization_config = written(8)["quantization_config"]
    assert read_quantization_config(cfg).kv_cache.group_size == 8


def test_plain_llm_compressor_style_config_gets_the_default_kv_scheme():
    cfg = written()
    qc = cfg["quantization_config"]
    del qc["eightbit"]
    for args in qc["config_groups"]["group_0"].values():
        if isinstance(args, dict):
            args.pop("group_size", None)
    qc["config_groups"]["group_0"]["weights"]["observer"] = "mse"
    assert read_quantization_config(cfg).kv_cache == KVCacheScheme()


def _mutated(path, value):
    cfg = copy.deepcopy(written())
    d = cfg["quantization_config"]
    *keys, last = path
    for k in keys:
        d = d[k]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value
    return cfg


@pytest.mark.parametrize(
    "path,value,message",
    [
        (["quant_method"], "gptq", "quant_method 'gptq'"),
        (["format"], "pack-quantized", "format 'pack-quantized'"),
        (["format"], "float-quantized", "format 'float-quantized'"),
        (["quantization_status"], "initialized", "not stored as int8"),
        (["config_groups", "group_0", "weights", "strategy"], "tensor", "weights"),
        (["config_groups", "group_0", "weights", "num_bits"], 4, "weights"),
        (["config_groups", "group_0", "weights", "symmetric"], False, "weights"),
        (["config_groups", "group_0", "weights", "type"], "float", "weights"),
        (["config_groups", "group_0", "input_activations", "dynamic"], False, "input_activations"),
        (["config_groups", "group_0", "input_activations", "strategy"], "tensor", "input_activations"),
        (["config_groups", "group_0", "input_activations"], None, "input_activations"),
        (["config_groups", "group_0", "targets"], ["re:.*mlp.*"], "targets"),
        (["kv_cache_scheme"], {"num_bits": 8, "type": "float", "strategy": "tensor"}, "kv_cache_scheme"),
        (["ignore"], [], "ignore"),
        (["ignore"], ["lm_head", "model.layers.0.mlp.down_proj"], "ignore"),
        (["eightbit", "kv_cache", "group_size"], 0, "group size"),
        (["eightbit", "kv_cache", "bogus"], 1, "malformed"),
        (["eightbit", "version"], 99, "newer"),
        (["eightbit", "version"], 2, "newer"),  # the first version after ours
        # grouped weights or activations are not per channel / per token: read as ours they would be mis-scaled
        (["config_groups", "group_0", "weights", "group_size"], 128, "weights"),
        (["config_groups", "group_0", "input_activations", "group_size"], 128, "input_activations"),
        (["eightbit", "version"], "1", "must be an integer"),  # a string was a TypeError
        (["eightbit"], [1], "must be an object"),  # a list was an AttributeError
    ],
)
def test_unsupported_configs_raise_clear_errors(path, value, message):
    with pytest.raises(UnsupportedQuantizationConfig, match=message):
        read_quantization_config(_mutated(path, value))


def test_two_groups_or_none_are_refused():
    cfg = written()
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_1"] = copy.deepcopy(groups["group_0"])
    with pytest.raises(UnsupportedQuantizationConfig, match="2 config groups"):
        read_quantization_config(cfg)
    with pytest.raises(UnsupportedQuantizationConfig, match="no quantization_config"):
        read_quantization_config({"model_type": "llama"})


def test_unsupported_is_a_quantize_error_and_a_value_error():
    assert issubclass(UnsupportedQuantizationConfig, QuantizeError)
    assert issubclass(UnsupportedQuantizationConfig, ValueError)
