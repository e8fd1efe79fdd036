"""The real compressed-tensors library reads our checkpoint: its config schema and its decompression."""

import json

import compressed_tensors as ct  # the [test] extra installs it: missing is an error, not a skip
import pytest
import torch
from safetensors.torch import load_file

from eightbit.quant.cli import quantize
from eightbit.quant.int8 import dequantize
from eightbit.quant.testing import make_tiny_checkpoint, make_tiny_tokenizer, tiny_text


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("ct")
    src = make_tiny_checkpoint(d / "src", "qwen2", tokenizer=make_tiny_tokenizer(), num_hidden_layers=2)
    (d / "c.txt").write_text(tiny_text(100))
    quantize(src, d / "q", calib_data=str(d / "c.txt"), num_samples=2, seq_len=32, progress=False)
    return d / "q"


def test_quantization_config_parses_as_w8a8(out):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy, preset_name_to_scheme

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == "int-quantized" and parsed.quant_method == "compressed-tensors"
    assert parsed.ignore == ["lm_head"] and parsed.kv_cache_scheme is None
    (scheme,) = parsed.config_groups.values()
    preset = preset_name_to_scheme("W8A8", ["Linear"])
    assert scheme.weights.strategy == QuantizationStrategy.CHANNEL
    assert scheme.input_activations.strategy == QuantizationStrategy.TOKEN
    for field in ("num_bits", "type", "symmetric", "strategy", "dynamic"):
        assert getattr(scheme.weights, field) == getattr(preset.weights, field), field
        assert getattr(scheme.input_activations, field) == getattr(preset.input_activations, field), field


def test_its_compressor_decompresses_our_weights_to_our_dequantize(out):
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    t = load_file(out / "model.safetensors")
    n = 0
    for name, w in t.items():
        if w.dtype != torch.int8:
            continue
        module = name.removesuffix(".weight")
        got = IntQuantizationCompressor.decompress({"weight": w, "weight_scale": t[module + ".weight_scale"]}, scheme)
        want = dequantize(w, t[module + ".weight_scale"])
        torch.testing.assert_close(got["weight"].float(), want, rtol=0, atol=0)
        n += 1
    assert n == 2 * 7


def test_transformers_loads_it_through_compressed_tensors(out):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.float32
    )
    t = load_file(out / "model.safetensors")
    for name in ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"):
        w = model.get_submodule(name).weight
        torch.testing.assert_close(w.float(), dequantize(t[name + ".weight"], t[name + ".weight_scale"]),
                                   rtol=0, atol=0)
    bias = model.get_submodule("model.layers.0.self_attn.q_proj").bias
    torch.testing.assert_close(bias.float(), t["model.layers.0.self_attn.q_proj.bias"].float())
    logits = model(torch.tensor([[1, 5, 7, 9]])).logits
    assert torch.isfinite(logits).all()
