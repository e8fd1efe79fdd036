"""A stack of decode layers made of eightbit's kernels, timed as one CUDA graph: where `tune_gemm --in-layer` times
a GEMM config.

At decode M a GEMM's time depends on the kernels on both sides of it through the PDL chain (kernels/pdl.py). On an
H200 neither a GEMM alone, nor behind its producer, nor (for o) behind the decode attention ranked small-M configs
as the engine did; a stack of whole decode layers did (docs/benchmarks/gemm.md, thirty-seventh session). A layer here
is the engine's decode layer (engine/models/llama.py) on random weights, its kernels called directly, in its order,
each on the one before's output:

    rmsnorm_quant -> qkv GEMM -> rope_kv_write -> decode attention -> quant_per_token -> o GEMM -> rmsnorm_quant
    -> gate_up GEMM -> silu_mul_quant -> down GEMM

Each sequence holds CONTEXT tokens of an int8 cache (groups of 32) and writes its newest token's K/V into that
cache's last slot; the attention reads through a block table as wide as the engine's CUDA-graph table
(max_position_embeddings / 16 blocks), so it takes the engine's split count, and, as in the engine, one table and
one seq_lens serve every layer, so the decode starts early from the second layer on (EARLY_INDICES). Every layer
starts from the same hidden state and residual (the layers are not chained through their data, only through the
stream and the PDL chain, which is what decides how they overlap). Weights and caches are random, one set per
layer, so that the stack reads from HBM as a model does.
"""

import math

import torch

from eightbit.engine.dummy import KNOWN_SHAPES, dummy_config
from eightbit.engine.layers.rotary import cos_sin_cache
from eightbit.eval.bench_attention import PAGE, make_cache
from eightbit.kernels.decode_attention import decode_attention
from eightbit.kernels.int8_gemm import int8_gemm_with_config
from eightbit.kernels.kv_write import rope_kv_write
from eightbit.kernels.quant_per_token import quant_per_token
from eightbit.kernels.rmsnorm_quant import rmsnorm_quant
from eightbit.kernels.silu_mul_quant import silu_mul_quant

ROLES = ("qkv", "o", "gate_up", "down")
MODELS = ("llama-3-8b", "llama-3.2-1b")  # the shapes tune_gemm tunes
CONTEXT = 544  # tokens per sequence: the engine benchmark's 512-token prompts part-way through 64 new tokens


def gemm_shapes(model):
    """{role: (N, K)} of a known model shape's four linear layers."""
    s = KNOWN_SHAPES[model]
    h, heads, kv, inter = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["intermediate_size"]
    d = h // heads
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * inter, h), "down": (h, inter)}


def role_of(n, k):
    """(model, role) of the first of MODELS with a linear layer of shape (N, K); ValueError if none has."""
    for model in MODELS:
        for role, shape in gemm_shapes(model).items():
            if shape == (n, k):
                return model, role
    raise ValueError(f"no linear layer of {MODELS} has N={n}, K={k}: --in-layer times the GEMMs of those models only")


class DecodeLayers:
    """num_layers decode layers of `model` at batch `batch` (the GEMMs' M), each with its own random weights and
    int8 cache; one block table for all, as in the engine."""

    def __init__(self, model, batch, num_layers=8, context=CONTEXT, device="cuda"):
        s = KNOWN_SHAPES[model]
        self.batch, self.hidden = batch, s["hidden_size"]
        self.heads, self.kv_heads = s["num_attention_heads"], s["num_key_value_heads"]
        self.head_dim = self.hidden // self.heads
        self.eps = s.get("rms_norm_eps", 1e-6)  # transformers' LlamaConfig default
        self.weights = [{role: (torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device),
                                torch.rand(n, 1, device=device) * 0.01) for role, (n, k) in gemm_shapes(model).items()}
                        for _ in range(num_layers)]
        used = math.ceil(context / PAGE)
        width = s["max_position_embeddings"] // PAGE  # the engine's graph table: max_model_len / block_size
        self.caches = [make_cache(batch * used, self.head_dim, "int8", self.kv_heads, device)
                       for _ in range(num_layers)]
        # one block table and one seq_lens for every layer, as in an engine step (each layer's cache has its own
        # blocks at the same numbers): from the second layer on the decode's indices are settled and it starts
        # early (decode_attention._work_order), as the engine's does
        self.table = torch.nn.functional.pad(
            torch.randperm(batch * used, dtype=torch.int32, device=device).view(batch, used), (0, width - used))
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        # the newest token: position context - 1, in its sequence's last used block
        last = context - 1
        self.positions = torch.full((batch,), last, dtype=torch.int64, device=device)
        self.slots = (self.table[:, last // PAGE].long() * PAGE + last % PAGE).contiguous()
        self.cos_sin = cos_sin_cache(dummy_config(model), s["max_position_embeddings"]).to(device)
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.x = torch.randn(batch, self.hidden, **bf16)
        self.residual = torch.randn(batch, self.hidden, **bf16)
        self.norm_weight = torch.rand(self.hidden, **bf16) + 0.5

    def layer(self, i, configs):
        """Layer i's kernels; configs: {role: GemmConfig} for the GEMMs to launch with a given config (the others
        take the table's, as the engine does). Returns the down GEMM's output."""
        w, b, d = self.weights[i], self.batch, self.head_dim

        def gemm(role, x_q, x_scale):
            return int8_gemm_with_config(x_q, x_scale, *w[role], config=configs.get(role))

        x_q, x_scale, residual = rmsnorm_quant(self.x, self.norm_weight, self.eps, self.residual)
        q, k, v = gemm("qkv", x_q, x_scale).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = rope_kv_write(q.view(b, self.heads, d), k.view(b, self.kv_heads, d), v.view(b, self.kv_heads, d),
                          self.positions, self.cos_sin, *self.caches[i], self.slots)
        attn = decode_attention(q, *self.caches[i], self.table, self.seq_lens, d ** -0.5)
        out = gemm("o", *quant_per_token(attn.view(b, self.heads * d)))
        x_q, x_scale, _ = rmsnorm_quant(out, self.norm_weight, self.eps, residual)
        return gemm("down", *silu_mul_quant(gemm("gate_up", x_q, x_scale)))

    def calls(self, configs):
        """One callable per layer, for eval/bench_gemm.time_graph."""
        return [lambda i=i: self.layer(i, configs) for i in range(len(self.weights))]

    def time_us(self, configs, target_ms=3.0, replays=3):
        """Median microseconds a layer, the stack replayed as a CUDA graph."""
        from eightbit.eval.bench_gemm import time_graph

        return time_graph(self.calls(configs), target_ms=target_ms, replays=replays)
