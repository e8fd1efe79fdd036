"""Checkpoint tensors streamed into the engine's model (engine/loader.py, engine/layers/linear.py): a whole checkpoint
fills every parameter and shard; a stray, missing, misshapen or wrongly typed tensor is refused by name."""

import re

import pytest
import torch

from eightbit.engine.loader import build_model, load_weights
from eightbit.quant.int8 import quantize_per_channel
from eightbit.quant.testing import tiny_config

CONFIG = tiny_config(num_hidden_layers=1)  # hidden 64, q 128 / k, v 64 rows, intermediate 128, vocab 320


@pytest.fixture(scope="module")
def hf_state():
    """HF transformers' own Llama of that config: the names and shapes a real checkpoint holds."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).state_dict()


def checkpoint(hf_state, quantized=False, drop=(), replace=None):
    """(name, tensor) pairs: HF's float tensors, or eightbit's int8 format (each linear's int8 weight and float32
    [out, 1] weight_scale); without the names in drop, with the tensors in replace swapped in."""
    named = []
    for name, t in hf_state.items():
        if quantized and name.endswith("_proj.weight"):
            q, scale = quantize_per_channel(t)
            named += [(name, q), (name + "_scale", scale)]
        else:
            named.append((name, t))
    replace = replace or {}
    return [(n, replace.get(n, t)) for n, t in named if n not in drop]


def load(named, quantized=False):
    model = build_model(CONFIG, quantized, torch.float32, "cpu")
    load_weights(model, named)
    return model


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "w8a8"])
def test_a_whole_checkpoint_fills_every_shard(hf_state, quantized):
    model = load(checkpoint(hf_state, quantized), quantized)
    qkv = torch.cat([hf_state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([hf_state[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    for fused, want in (("self_attn.qkv_proj", qkv), ("mlp.gate_up_proj", gate_up)):
        got = model.get_parameter(f"model.layers.0.{fused}.weight")
        if quantized:  # per output channel, so quantizing the shards one by one equals quantizing their rows together
            want, scale = quantize_per_channel(want)
            assert torch.equal(model.get_parameter(f"model.layers.0.{fused}.weight_scale"), scale)
        assert torch.equal(got, want)
    assert torch.equal(model.get_parameter("model.norm.weight"), hf_state["model.norm.weight"])


def load_quantizing(named, dtype=torch.bfloat16):
    """A W8A8 model whose linears quantize float weights as they load (loader.load_model's quantization="w8a8")."""
    model = build_model(CONFIG, True, dtype, "cpu")
    for linear in model.linear_layers():
        linear.quantize_on_load = True
    load_weights(model, named)
    return model


def test_float_weights_are_quantized_as_they_load_from_their_own_precision(hf_state):
    """Each shard's float32 weight is quantized per channel as it arrives, into the rows of the fused int8 weight and
    its scale: what quantizing the whole float32 matrix gives, not a bf16 copy of it (rounded twice: it was)."""
    model = load_quantizing(checkpoint(hf_state))
    sources = {"self_attn.qkv_proj": [f"self_attn.{p}_proj" for p in "qkv"], "self_attn.o_proj": ["self_attn.o_proj"],
               "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"], "mlp.down_proj": ["mlp.down_proj"]}
    twice_rounded_differs = False
    for fused, parts in sources.items():
        w = torch.cat([hf_state[f"model.layers.0.{p}.weight"] for p in parts])
        want, scale = quantize_per_channel(w)
        assert torch.equal(model.get_parameter(f"model.layers.0.{fused}.weight"), want)
        assert torch.equal(model.get_parameter(f"model.layers.0.{fused}.weight_scale"), scale)
        twice_rounded_differs |= not torch.equal(quantize_per_channel(w.bfloat16())[0], want)
    assert twice_rounded_differs  # else this test could not tell the two apart
    assert model.get_parameter("model.norm.weight").dtype == torch.bfloat16


def test_a_weight_quantized_as_it_loads_fills_its_scale_once(hf_state):
    """A float checkpoint that also holds a scale is refused; one that lacks a weight names the weight, not the
    scale that would have come with it (a float checkpoint has none)."""
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=re.escape(f"tensor '{name}' fills 'model.layers.0.mlp.down_proj.weight_scale'"
                                                   f", which '{name}_scale' filled")):
        load_quantizing([(name + "_scale", torch.ones(64, 1))] + checkpoint(hf_state))
    with pytest.raises(ValueError, match=re.escape(f"lacks 1 tensor(s), e.g. ['{name}']")):
        load_quantizing(checkpoint(hf_state, drop=(name,)))


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_norm.weight",  # no such module
                                  "model.layers.1.mlp.up_proj.weight",  # a layer this model does not have
                                  "model.norm.bias",  # a module without that parameter
                                  "model.norm.eps",  # an attribute, not a parameter: it crashed with AttributeError
                                  "model.layers.0.self_attn.attn.cos_sin_cache"])  # it replaced the RoPE table
def test_a_tensor_with_no_place_in_the_model(hf_state, name):
    with pytest.raises(ValueError, match=f"checkpoint tensor '{re.escape(name)}' has no place in the model"):
        load(checkpoint(hf_state) + [(name, torch.zeros(64))])


QKV_AND_NORM = ("model.layers.0.self_attn.k_proj.weight", "model.norm.weight")  # one shard leaves qkv_proj unfilled


@pytest.mark.parametrize("quantized,drop,missing", [
    (False, QKV_AND_NORM, list(QKV_AND_NORM)),  # the shard is named as the checkpoint names it
    (True, QKV_AND_NORM, list(QKV_AND_NORM)),
    (True, ["model.layers.0.mlp.down_proj.weight_scale"], ["model.layers.0.mlp.down_proj.weight_scale"]),
], ids=["float", "w8a8", "w8a8-scale"])
def test_a_checkpoint_lacking_tensors(hf_state, quantized, drop, missing):
    with pytest.raises(ValueError, match=re.escape(f"lacks {len(missing)} tensor(s), e.g. {missing}")):
        load(checkpoint(hf_state, quantized, drop=drop), quantized)


def test_a_float_tensor_of_the_wrong_shape(hf_state):
    with pytest.raises(ValueError, match=re.escape("tensor 'model.norm.weight': checkpoint shape (63,) != model shape (64,)")):
        load(checkpoint(hf_state, replace={"model.norm.weight": torch.ones(63)}))
    with pytest.raises(ValueError, match=re.escape("tensor 'model.embed_tokens.weight': checkpoint shape (64, 320) != model")):
        load(checkpoint(hf_state, replace={"model.embed_tokens.weight": torch.zeros(64, 320)}))


@pytest.mark.parametrize("param", ["bias", "weight_scale", "in_features"])
def test_a_linear_refuses_a_tensor_it_does_not_have(hf_state, param):
    name = f"model.layers.0.self_attn.o_proj.{param}"  # a float linear without a bias
    with pytest.raises(ValueError, match=f"tensor '{re.escape(name)}': unexpected tensor '{param}' for a float linear"):
        load(checkpoint(hf_state) + [(name, torch.zeros(64, 1))])


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "w8a8"])
@pytest.mark.parametrize("name,shape,shard", [("self_attn.k_proj.weight", (63, 64), "[k]"),
                                              ("mlp.up_proj.weight", (128, 65), "[1]"),
                                              ("self_attn.o_proj.weight", (64, 64), "")])
def test_a_linear_refuses_a_shard_of_the_wrong_shape(hf_state, quantized, name, shape, shard):
    name = "model.layers.0." + name
    bad = torch.zeros(shape, dtype=torch.int8 if quantized else torch.float32)
    model_shape = tuple(dict(checkpoint(hf_state))[name].shape)
    with pytest.raises(ValueError, match=re.escape(f"tensor '{name}': weight{shard}: checkpoint shape {shape} does not "
                                                   f"match the model's {model_shape}")):
        load(checkpoint(hf_state, quantized, replace={name: bad}), quantized)


def test_a_w8a8_linear_refuses_a_float_weight(hf_state):
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"tensor '{name}': W8A8 weight must be int8, the checkpoint has torch.float32"):
        load(checkpoint(hf_state, True, replace={name: hf_state[name]}), quantized=True)


@pytest.mark.parametrize("shape", [(63,), (1, 64), (64, 2)])
def test_a_weight_scale_of_the_wrong_shape(hf_state, shape):
    """[N] and [N, 1] are the two shapes a per-channel scale comes in; anything else is refused by name."""
    name = "model.layers.0.mlp.down_proj.weight_scale"
    with pytest.raises(ValueError, match=re.escape(f"tensor '{name}': weight_scale: checkpoint shape")):
        load(checkpoint(hf_state, True, replace={name: torch.ones(shape)}), quantized=True)
    flat = checkpoint(hf_state, True, replace={name: torch.full((64,), 0.5)})
    assert torch.equal(load(flat, quantized=True).get_parameter(name), torch.full((64, 1), 0.5))


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.0.self_attn.v_proj.weight"])
def test_a_tensor_given_twice_is_refused(hf_state, name):
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{name}' appears twice")):
        load(checkpoint(hf_state) + [(name, hf_state[name])])


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "w8a8"])
def test_an_integer_tensor_for_a_float_parameter_is_refused(hf_state, quantized):
    """An int8 embedding (or norm) was cast to float silently and generated garbage."""
    name = "model.embed_tokens.weight"
    bad = hf_state[name].round().to(torch.int8)
    with pytest.raises(ValueError, match=f"tensor '{name}': must be a float tensor, the checkpoint has torch.int8"):
        load(checkpoint(hf_state, quantized, replace={name: bad}), quantized)


@pytest.mark.parametrize("bad,message", [(torch.ones(64, 1, dtype=torch.int32), "must be a float tensor"),
                                         (torch.full((64, 1), float("nan")), "NaN or inf")])
def test_a_weight_scale_that_is_not_a_finite_float_is_refused(hf_state, bad, message):
    name = "model.layers.0.mlp.down_proj.weight_scale"
    with pytest.raises(ValueError, match=f"tensor '{name}': .*{message}"):
        load(checkpoint(hf_state, True, replace={name: bad}), quantized=True)


@pytest.mark.parametrize("max_model_len, rows", [(None, CONFIG.max_position_embeddings), (48, 48),
                                                 (10**6, CONFIG.max_position_embeddings)])
def test_the_rope_table_covers_the_positions_in_use(max_model_len, rows):
    """It covered max_position_embeddings whatever max_model_len was: 0.5 GB of float32 for a 1M-position model."""
    from eightbit.engine.layers.rotary import cos_sin_cache

    table = build_model(CONFIG, False, torch.float32, "cpu", max_model_len).model.layers[0].self_attn.attn.cos_sin_cache
    assert table.shape[0] == rows and torch.equal(table, cos_sin_cache(CONFIG, CONFIG.max_position_embeddings)[:rows])


def test_a_tied_checkpoint_that_also_holds_lm_head_loads_and_ties_it():
    """HF's state_dict() of a tied model lists lm_head.weight (the embedding, shared): a GGUF opened with the cache off
    hands exactly that to load_weights. It is skipped, and the logits are those of HF's (tied) lm_head."""
    from transformers import LlamaForCausalLM as HFLlama

    config = tiny_config(num_hidden_layers=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = HFLlama(config).eval()
    state = hf.state_dict()
    assert "lm_head.weight" in state
    model = build_model(config, False, torch.float32, "cpu")
    load_weights(model, state.items())
    h = torch.randn(3, config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(model.compute_logits(h), hf.lm_head(h))


def test_fused_linear_shard_sizes_must_add_up_to_out_features():
    from eightbit.engine.layers.linear import Linear

    with pytest.raises(ValueError, match="shard sizes add up to 8, not out_features=10"):
        Linear(16, 10, shards={"q": 4, "k": 2, "v": 2}, dtype=torch.float32)
