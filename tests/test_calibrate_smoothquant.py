"""SmoothQuant: folding is exact, GQA groups share o factors, and the chosen smoothing lowers W8A8 error."""

import pytest
import torch

from eightbit.calibrate.smoothquant import (
    POINTS,
    fake_w8a8,
    fold,
    point_factors,
    smooth_layer,
    smoothing_factors,
    w8a8_error,
)
from eightbit.calibrate.stats import collect_layer_stats
from eightbit.quant.hf_layers import DecoderLayers
from eightbit.quant.testing import tiny_config


def tiny_model(model_type="llama", **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(model_type, num_attention_heads=6, num_key_value_heads=2, hidden_size=96, head_dim=16,
                      **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return model


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type,overrides", [("llama", {}), ("qwen2", {}), ("llama", {"mlp_bias": True})])
def test_folding_alone_leaves_the_model_unchanged(model_type, overrides):
    model = tiny_model(model_type, **overrides)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        ref = model(ids).logits
        g = torch.Generator().manual_seed(1)
        cfg = model.config
        for layer in model.model.layers:
            for point in POINTS:
                weights = [layer.get_submodule(n).weight for n in point.consumers]
                k = weights[0].shape[1]
                act = torch.exp(torch.randn(k, generator=g) * 2)  # outlier-like spread over 2 decades
                s_in, s_prod = point_factors(point, weights, act, 0.5 + 0.4 * torch.rand(1, generator=g).item(),
                                             cfg.num_attention_heads, cfg.num_key_value_heads)
                assert s_in.std() > 0.1  # the factors really move things
                fold(layer, point, s_in, s_prod)
        out = model(ids).logits
    assert rel(out, ref) < 1e-5


def test_o_factors_are_shared_across_the_query_heads_of_a_kv_group():
    heads, kv_heads, d = 6, 2, 4
    o = POINTS[2]
    assert o.name == "o" and o.grouped
    w = torch.randn(8, heads * d)
    act = torch.rand(heads * d) + 0.1
    act[5] = 50.0  # query head 1, dim 1 -> kv head 0 (heads 0..2), dim 1
    s_in, s_kv = point_factors(o, [w], act, 0.5, heads, kv_heads)
    assert s_kv.shape == (kv_heads * d,) and s_in.shape == (heads * d,)
    per_head = s_in.view(heads, d)
    for h in range(heads):
        assert torch.equal(per_head[h], s_kv.view(kv_heads, d)[h // (heads // kv_heads)])
    # the outlier of head 1 sets the factor of kv head 0, dim 1, from the max over the group
    wmax = w.abs().amax(0).view(kv_heads, heads // kv_heads, d).amax(1)
    assert s_kv[1] == pytest.approx((50.0 ** 0.5) / wmax[0, 1].item() ** 0.5, rel=1e-5)


def test_smoothing_factors_formula_and_dead_channels():
    a = torch.tensor([4.0, 0.0, 100.0])
    w = torch.tensor([1.0, 2.0, 0.25])
    s = smoothing_factors(a, w, 0.5)
    assert s[0] == pytest.approx(2.0) and s[1] == 1.0 and s[2] == pytest.approx(20.0)
    # s = a^alpha / w^(1 - alpha); at alpha 0.5 a swap of alpha and 1 - alpha would not show
    s = smoothing_factors(torch.tensor([16.0, 1.0]), torch.tensor([1.0, 16.0]), 0.75)
    torch.testing.assert_close(s, torch.tensor([8.0, 0.5]), rtol=1e-6, atol=0)


def test_layer_stats_span_every_batch():
    """absmax is the max over every calibration token, not the last batch's; the samples are the chosen tokens."""
    from eightbit.calibrate.stats import sample_token_index

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(6, 6))
    hidden = torch.randn(5, 4, 6)
    hidden[0, 1, 2] = 50.0  # the outlier is in the first of three batches
    stats, out = collect_layer_stats(layer, lambda m, x: m(x), hidden, sample_tokens=7, batch_size=2)
    torch.testing.assert_close(stats.absmax["0"], hidden.abs().amax(dim=(0, 1)), rtol=0, atol=0)
    torch.testing.assert_close(stats.samples["0"], hidden.reshape(-1, 6)[sample_token_index(20, 7)], rtol=0, atol=0)
    torch.testing.assert_close(out, layer(hidden).detach())


def test_decoder_layers_run_matches_the_hf_model(tmp_path):
    """The calibration runs each layer with its own RoPE and causal mask: layer 0's output must be what the HF model
    computes (a mask shifted by one went unnoticed: smoothing is exact whatever the inputs)."""
    from transformers import AutoModelForCausalLM

    from eightbit.engine.weights import open_checkpoint
    from eightbit.quant.testing import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    layers = DecoderLayers(open_checkpoint(folder))
    out = layers.run(layers.load(0), hidden[0].float())
    torch.testing.assert_close(out.double(), hidden[1], rtol=1e-4, atol=1e-4)


def test_smoothing_lowers_the_w8a8_error_of_an_outlier_input():
    torch.manual_seed(0)
    x = torch.randn(512, 128)
    x[:, 7] *= 300  # one outlier channel, like SmolLM2's down_proj input
    w = torch.randn(64, 128) / 128 ** 0.5
    base = w8a8_error(x, [w])
    s = smoothing_factors(x.abs().amax(0), w.abs().amax(0), 0.8)
    assert w8a8_error(x, [w], s) < base / 10
    # and the error is measured against the float product
    assert rel(fake_w8a8(x, w), x @ w.t()) ** 2 == pytest.approx(base, rel=1e-4)


def test_smooth_layer_on_calibration_stats(tmp_path):
    from eightbit.engine.weights import open_checkpoint
    from eightbit.quant.testing import make_tiny_checkpoint

    ckpt = open_checkpoint(make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=1))
    layers = DecoderLayers(ckpt)
    layer = layers.load(0)
    x = torch.randn(4, 32, ckpt.config.hidden_size)
    stats, ref = collect_layer_stats(layer, layers.run, x, sample_tokens=128)
    record = smooth_layer(layer, stats, "auto", ckpt.config.num_attention_heads, ckpt.config.num_key_value_heads)
    assert set(record) == {"qkv", "gate_up", "o", "down"}
    for r in record.values():
        assert r["error"] <= r["error_unsmoothed"]
    # the model was built with outlier channels: smoothing must find them at every point but o
    for name in ("qkv", "gate_up", "down"):
        assert record[name]["alpha"] is not None
        assert record[name]["error"] < record[name]["error_unsmoothed"] / 2
    # folded in place: the float layer computes the same function
    assert rel(layers.run(layer, x), ref) < 1e-5
    # a fixed alpha is used everywhere; None smooths nothing but still measures
    layer = layers.load(0)
    fixed = smooth_layer(layer, stats, 0.5, ckpt.config.num_attention_heads, ckpt.config.num_key_value_heads)
    assert all(r["alpha"] == 0.5 for r in fixed.values())
    layer = layers.load(0)
    w_before = layer.mlp.down_proj.weight.clone()
    off = smooth_layer(layer, stats, None, ckpt.config.num_attention_heads, ckpt.config.num_key_value_heads)
    assert all(r["alpha"] is None and r["error"] == r["error_unsmoothed"] for r in off.values())
    assert torch.equal(layer.mlp.down_proj.weight, w_before)
