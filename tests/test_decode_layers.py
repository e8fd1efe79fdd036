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


def _record_kernels(monkeypatch):
    """Replace the stack's kernels with fakes of the right output shapes that record what each was given."""
    seen = []

    def rmsnorm_quant(x, weight, eps, residual):
        out = (torch.zeros(x.shape, dtype=torch.int8), torch.ones(x.shape[0], 1), torch.zeros_like(residual))
        seen.append(("rmsnorm_quant", dict(x=x, residual=residual, out=out)))
        return out

    def gemm(x_q, x_scale, w_q, w_scale, config=None):
        assert x_q.shape[1] == w_q.shape[1], "a GEMM got an input of the wrong width"
        out = torch.zeros(x_q.shape[0], w_q.shape[0], dtype=torch.bfloat16)
        seen.append(("gemm", dict(x_q=x_q, w_q=w_q, config=config, out=out)))
        return out

    def rope_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, k_scale, v_scale, slots):
        out = torch.zeros(q.shape, dtype=q.dtype)
        seen.append(("rope_kv_write", dict(q=q, k=k, v=v, positions=positions, k_cache=k_cache, slots=slots, out=out)))
        return out

    def attention(q, k_cache, v_cache, k_scale, v_scale, table, seq_lens, scale):
        out = torch.zeros(q.shape, dtype=q.dtype)
        seen.append(("attention", dict(q=q, k_cache=k_cache, table=table, seq_lens=seq_lens, scale=scale, out=out)))
        return out

    def quantizer(name, width):
        def fn(x):
            out = (torch.zeros(x.shape[0], width(x.shape[1]), dtype=torch.int8), torch.ones(x.shape[0], 1))
            seen.append((name, dict(x=x, out=out)))
            return out
        return fn

    monkeypatch.setattr(dl, "rmsnorm_quant", rmsnorm_quant)
    monkeypatch.setattr(dl, "int8_gemm_with_config", gemm)
    monkeypatch.setattr(dl, "rope_kv_write", rope_kv_write)
    monkeypatch.setattr(dl, "decode_attention", attention)
    monkeypatch.setattr(dl, "quant_per_token", quantizer("quant_per_token", lambda k: k))
    monkeypatch.setattr(dl, "silu_mul_quant", quantizer("silu_mul_quant", lambda k: k // 2))
    return seen


def _same(a, b):
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def test_each_layer_is_the_engines_decode_layer_with_the_config_in_its_gemms_place(monkeypatch):
    stack = dl.DecodeLayers("llama-tiny", batch=3, num_layers=2, device="cpu")
    seen = _record_kernels(monkeypatch)
    for f in stack.calls({"o": MINE}):
        f()

    names = ["rmsnorm_quant", "gemm", "rope_kv_write", "attention", "quant_per_token", "gemm", "rmsnorm_quant", "gemm",
             "silu_mul_quant", "gemm"]
    assert [name for name, _ in seen] == names * 2
    shape = KNOWN_SHAPES["llama-tiny"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["hidden_size"] // heads
    used, width = math.ceil(dl.CONTEXT / dl.PAGE), shape["max_position_embeddings"] // dl.PAGE
    for i in range(2):
        norm1, qkv, rope, attn, quant, o, norm2, gate_up, silu, down = [c for _, c in seen[i * 10:(i + 1) * 10]]
        # the engine's data flow, kernel to kernel
        assert _same(qkv["x_q"], norm1["out"][0]) and _same(norm2["x"], o["out"])
        assert norm2["residual"] is norm1["out"][2]  # the residual stream runs through both norms
        assert rope["q"].data_ptr() == qkv["out"].data_ptr() and tuple(rope["q"].shape) == (3, heads, d)
        assert rope["k"].data_ptr() == qkv["out"][:, heads * d:].data_ptr() and tuple(rope["v"].shape) == (3, kv_heads, d)
        assert attn["q"] is rope["out"] and quant["x"].data_ptr() == attn["out"].data_ptr()
        assert _same(o["x_q"], quant["out"][0]) and _same(gate_up["x_q"], norm2["out"][0])
        assert silu["x"] is gate_up["out"] and _same(down["x_q"], silu["out"][0])
        for g, role in zip((qkv, o, gate_up, down), dl.ROLES):
            assert g["w_q"] is stack.weights[i][role][0] and tuple(g["w_q"].shape) == dl.gemm_shapes("llama-tiny")[role]
            assert g["config"] == (MINE if role == "o" else None)  # None: the table's config, as the engine launches
        # the cache: the newest token (position CONTEXT - 1) written into its sequence's last used block, read back
        # through a table as wide as the engine's graph table
        table = attn["table"]
        assert attn["k_cache"] is rope["k_cache"] is stack.caches[i][0] and attn["k_cache"].dtype == torch.int8
        assert tuple(table.shape) == (3, width) and not table[:, used:].any()
        assert sorted(table[:, :used].flatten().tolist()) == list(range(3 * used))  # each block once
        last = dl.CONTEXT - 1
        assert rope["positions"].tolist() == [last] * 3
        assert rope["slots"].tolist() == [int(table[b, last // dl.PAGE]) * dl.PAGE + last % dl.PAGE for b in range(3)]
        assert attn["seq_lens"].tolist() == [dl.CONTEXT] * 3 and attn["scale"] == pytest.approx(d ** -0.5)
    assert stack.weights[0]["o"][0] is not stack.weights[1]["o"][0]
    assert stack.caches[0][0] is not stack.caches[1][0]
    # the engine's step: one block table and one seq_lens for every layer, so the decode's indices are settled from
    # the second layer on (decode_attention._work_order)
    attns = [c for name, c in seen if name == "attention"]
    assert attns[0]["table"] is attns[1]["table"] and attns[0]["seq_lens"] is attns[1]["seq_lens"]


def test_the_real_kernels_run_the_layer_and_write_only_each_sequences_newest_slot():
    """Under the Triton interpreter (CPU): every kernel wrapper takes what the stack gives it, and rope_kv_write
    changes the cache at each sequence's newest token and nowhere else."""
    stack = dl.DecodeLayers("llama-tiny", batch=2, num_layers=1, device="cpu")
    k_cache, v_cache = stack.caches[0][0], stack.caches[0][1]
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = stack.layer(0, {"o": MINE})
    assert tuple(out.shape) == (2, KNOWN_SHAPES["llama-tiny"]["hidden_size"]) and torch.isfinite(out.float()).all()
    changed = (k_cache != k_before).flatten(2).any(-1).nonzero().tolist()  # [block, offset] pairs
    last, table = dl.CONTEXT - 1, stack.table
    slots = [int(table[b, last // dl.PAGE]) * dl.PAGE + last % dl.PAGE for b in range(2)]  # position CONTEXT - 1
    assert sorted(b * dl.PAGE + o for b, o in changed) == sorted(slots)
    v_changed = (v_cache != v_before).any(-2).any(1).nonzero().tolist()  # V is stored [block, head, dim, offset]
    assert sorted(b * dl.PAGE + o for b, o in v_changed) == sorted(slots)


@pytest.mark.gpu
def test_gpu_the_stack_runs_in_the_chain_and_its_gemm_computes_the_reference(monkeypatch):
    from eightbit.kernels import pdl

    assert pdl.chain_enabled(torch.device("cuda")), "the stack is meant to run in the PDL chain (sm_90)"
    stack = dl.DecodeLayers("llama-3.2-1b", batch=4, num_layers=2)
    gate_up = []
    real_silu = dl.silu_mul_quant
    monkeypatch.setattr(dl, "silu_mul_quant", lambda x: gate_up.append(x) or real_silu(x))
    out = stack.layer(1, {"down": MINE})
    assert torch.isfinite(gate_up[0]).all() and torch.isfinite(out).all()
    w_q, w_scale = stack.weights[1]["down"]
    want = R.int8_gemm(*silu_mul_quant(gate_up[0]), w_q, w_scale)  # exact int32 sums of the same int8 input
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    us = stack.time_us({"down": MINE}, target_ms=1.0, replays=2)
    assert 0 < us < 1e4
