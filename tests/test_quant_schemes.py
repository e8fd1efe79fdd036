"""Scheme dataclasses: validation, dict round trip, bytes per weight and per KV token."""

import pytest
from transformers import LlamaConfig

from eightbit.quant.schemes import (
    ActivationScheme,
    KVCacheScheme,
    QuantScheme,
    WeightScheme,
    kv_bytes_per_token,
    weight_bytes,
)


def smollm2_config():
    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
    )


def test_round_trip_through_dict():
    s = QuantScheme(kv_cache=KVCacheScheme(group_size=16))
    d = s.to_dict()
    assert d["weights"] == {"num_bits": 8, "symmetric": True, "strategy": "channel", "dynamic": False}
    assert d["input_activations"]["strategy"] == "token" and d["input_activations"]["dynamic"] is True
    assert d["kv_cache"] == {"num_bits": 8, "group_size": 16, "symmetric": True, "scale_dtype": "float16"}
    assert QuantScheme.from_dict(d) == s


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: WeightScheme(strategy="tensor"), "unsupported weight scheme .*strategy='tensor'"),
        (lambda: WeightScheme(symmetric=False), "unsupported weight scheme .*symmetric=False"),
        (lambda: ActivationScheme(dynamic=False), "unsupported activation scheme .*dynamic=False"),
        (lambda: ActivationScheme(num_bits=4), "unsupported activation scheme .*num_bits=4"),
        (lambda: KVCacheScheme(group_size=0), "group size must be a positive integer, got 0"),
        (lambda: KVCacheScheme(scale_dtype="float32"), "unsupported KV-cache scheme .*scale_dtype='float32'"),
    ],
)
def test_unsupported_schemes_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("g", [8, 16, 32, 64])
def test_group_sizes_that_fit(g):
    KVCacheScheme(group_size=g).check_head_dim(64)


def test_head_dim_itself_is_a_group_size():
    KVCacheScheme(group_size=96).check_head_dim(96)


@pytest.mark.parametrize("g,d", [(48, 64), (32, 48), (12, 96), (128, 64)])
def test_group_sizes_that_do_not_fit(g, d):
    with pytest.raises(ValueError, match=f"group size {g} does not fit head_dim {d}"):
        KVCacheScheme(group_size=g).check_head_dim(d)


def test_kv_bytes_per_token_smollm2():
    cfg = smollm2_config()
    values = 2 * 30 * 3 * 64  # k and v, layers, kv heads, head_dim
    assert kv_bytes_per_token(cfg) == values * 2  # bf16
    for g in (8, 16, 32, 64):
        assert kv_bytes_per_token(cfg, KVCacheScheme(group_size=g)) == pytest.approx(values * (1 + 2 / g))
    assert kv_bytes_per_token(cfg, KVCacheScheme()) == 12240  # default G = 32


def test_weight_bytes_smollm2():
    cfg = smollm2_config()
    linear = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
    scales = 30 * (576 * 2 + 192 * 2 + 1536 * 2 + 576)
    floats = 49152 * 576 + 576 + 30 * 2 * 576  # tied embedding, final norm, two norms a layer
    assert weight_bytes(cfg) == linear + 4 * scales + 2 * floats
    assert weight_bytes(cfg, quantized=False) == 2 * (linear + floats)
    assert linear + floats == pytest.approx(134.5e6, rel=0.01)  # the hand count is SmolLM2's published 134.5M


def test_weight_bytes_counts_biases_and_untied_head():
    cfg = smollm2_config()
    cfg.tie_word_embeddings = False
    cfg.attention_bias = True
    base = smollm2_config()
    extra = 49152 * 576 + 30 * (576 + 192 + 192 + 576)
    assert weight_bytes(cfg) - weight_bytes(base) == 2 * extra
