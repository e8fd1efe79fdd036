"""eval/decode_layers.py, the decode-layer stack `tune_gemm --in-layer` times GEMM configs in: its shapes are the
tuner's, each layer launches the engine's kernels in the engine's order with the given config in its GEMM's place,
and its attention reads through a block table as wide as the engine's graph table. On the GPU: the stack runs and
its GEMM computes what the plain-torch reference does."""

import math

import pytest
import torch

from eightbit.engine.dummy import KNOWN_SHAPES
from eightbit.eval import decode_layers as dl
from eightbit.eval.tune_gemm import TARGETS
from eightbit.kernels import reference as R
from eightbit.kernels.gemm_configs import GemmConfig
from eightbit.kernels.silu_mul_quant import silu_mul_quant

MINE = GemmConfig(16, 32, 512, 1, 1, 2, 3)


def test_the_layers_gemm_shapes_are_the_tuners_targets():
    assert dl.gemm_shapes("llama-3-8b") == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                            "down": (4096, 14336)}
    assert {shape for m in dl.MODELS for shape in dl.gemm_shapes(m).values()} == set(TARGETS)
    assert dl.role_of(2048, 2048) == ("llama-3.2-1b", "o") and dl.role_of(4096, 14336) == ("llama-3-8b", "down")
    with pytest.raises(ValueError, match="no linear layer of .* has N=100, K=64"):
        dl.role_of(100, 64)


def test_each_layer_runs_the_engines_kernels_in_order_with_the_config_in_its_gemms_place(monkeypatch):
    stack = dl.DecodeLayers("llama-tiny", batch=3, num_layers=2, device="cpu")
    seen = []

    def quant(name):
        def fn(x, *args):
            seen.append((name, x))
            return torch.zeros(x.shape[0], 8, dtype=torch.int8), torch.ones(x.shape[0], 1), None
        return fn

    def gemm(x_q, x_scale, w_q, w_scale, config=None):
        seen.append(("gemm", w_q, config))
        return torch.zeros(x_q.shape[0], w_q.shape[0], dtype=torch.bfloat16)

    def attention(q, k, v, ks, vs, table, seq_lens, scale):
        seen.append(("attention", k, table, seq_lens, scale))
        return torch.zeros_like(q)

    monkeypatch.setattr(dl, "rmsnorm_quant", quant("rmsnorm_quant"))
    monkeypatch.setattr(dl, "quant_per_token", lambda x: quant("quant_per_token")(x)[:2])
    monkeypatch.setattr(dl, "silu_mul_quant", lambda x: quant("silu_mul_quant")(x)[:2])
    monkeypatch.setattr(dl, "int8_gemm_with_config", gemm)
    monkeypatch.setattr(dl, "decode_attention", attention)
    for f in stack.calls({"o": MINE}):
        f()

    names = ["rmsnorm_quant", "gemm", "attention", "quant_per_token", "gemm", "rmsnorm_quant", "gemm",
             "silu_mul_quant", "gemm"]
    assert [s[0] for s in seen] == names * 2
    shape = KNOWN_SHAPES["llama-tiny"]
    d = shape["hidden_size"] // shape["num_attention_heads"]
    used, width = math.ceil(dl.CONTEXT / dl.PAGE), shape["max_position_embeddings"] // dl.PAGE
    for i in range(2):
        calls = seen[i * len(names):(i + 1) * len(names)]
        gemms = [c for c in calls if c[0] == "gemm"]
        for (_, w_q, config), role in zip(gemms, dl.ROLES):
            assert w_q is stack.weights[i][role][0] and tuple(w_q.shape) == dl.gemm_shapes("llama-tiny")[role]
            assert config == (MINE if role == "o" else None)  # None: the table's config, as the engine launches
        _, k_cache, table, seq_lens, scale = calls[2]
        assert k_cache is stack.caches[i][0] and k_cache.dtype == torch.int8
        assert tuple(table.shape) == (3, width) and not table[:, used:].any()  # the engine's graph-table width
        assert sorted(table[:, :used].flatten().tolist()) == list(range(3 * used))  # each block once
        assert seq_lens.tolist() == [dl.CONTEXT] * 3 and scale == pytest.approx(d ** -0.5)
    assert stack.weights[0]["o"][0] is not stack.weights[1]["o"][0]
    assert not torch.equal(stack.tables[0], stack.tables[1])


@pytest.mark.gpu
def test_gpu_the_stack_runs_in_the_chain_and_its_gemm_computes_the_reference():
    stack = dl.DecodeLayers("llama-3.2-1b", batch=4, num_layers=2)
    out = stack.layer(1, {"down": MINE})
    w_q, w_scale = stack.weights[1]["down"]
    want = R.int8_gemm(*silu_mul_quant(stack.gate_up), w_q, w_scale)  # exact int32 sums of the same int8 input
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    us = stack.time_us({"down": MINE}, target_ms=1.0, replays=2)
    assert 0 < us < 1e4
