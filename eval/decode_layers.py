"""A stack of decode layers made of eightbit's kernels, timed as one CUDA graph: where `tune_gemm --in-layer` times
a GEMM config.

At decode M a GEMM's time depends on the kernels on both sides of it through the PDL chain (kernels/pdl.py). On an
H200 neither a GEMM alone, nor behind its producer, nor (for o) behind the decode attention ranked small-M configs
as the engine did; a stack of whole decode layers did (docs/benchmarks/gemm.md, thirty-seventh session). A layer here
is what the engine's decode step launches per layer, in its order and with its launches:

    rmsnorm_quant -> qkv GEMM -> decode attention -> quant_per_token -> o GEMM -> rmsnorm_quant -> gate_up GEMM
    -> silu_mul_quant -> down GEMM

The attention reads an int8 cache (groups of 32) through a block table as wide as the engine's CUDA-graph table
(max_position_embeddings / 16 blocks), so it takes the engine's split count. Left out: rope_kv_write (the
RoPE and cache write of the new token, a ~1 us kernel that is no GEMM's neighbour). Each kernel reads a fixed input
rather than the one before's output: the stream's order and the PDL chain, not the data, decide how they overlap,
and random activations keep every GEMM's output finite. Weights and caches are random, one set per layer, so
the stack reads from HBM as a model does.
"""

import math

import torch

from eightbit.engine.dummy import KNOWN_SHAPES
from eightbit.kernels.decode_attention import decode_attention
from eightbit.kernels.int8_gemm import int8_gemm_with_config
from eightbit.kernels.quant_per_token import quant_per_token
from eightbit.kernels.reference import v_cache_shape
from eightbit.kernels.rmsnorm_quant import rmsnorm_quant
from eightbit.kernels.silu_mul_quant import silu_mul_quant

ROLES = ("qkv", "o", "gate_up", "down")
MODELS = ("llama-3-8b", "llama-3.2-1b")  # the shapes tune_gemm tunes
PAGE = 16  # the engine's KV block size
KV_GROUP = 32  # the int8 cache's scale group
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


def _int8_cache(num_blocks, kv_heads, d, device):
    k = torch.randint(-127, 128, (num_blocks, PAGE, kv_heads, d), dtype=torch.int8, device=device)
    v = torch.randint(-127, 128, v_cache_shape(num_blocks, PAGE, kv_heads, d, torch.int8), dtype=torch.int8,
                      device=device)
    scales = [(torch.rand(num_blocks, PAGE, kv_heads, d // KV_GROUP, device=device) * 0.02 + 1e-3).half()
              for _ in range(2)]
    return k, v, *scales


class DecodeLayers:
    """num_layers decode layers of `model` at batch `batch` (the GEMMs' M), each with its own random weights, int8
    cache and block table."""

    def __init__(self, model, batch, num_layers=8, context=CONTEXT, device="cuda"):
        s = KNOWN_SHAPES[model]
        self.batch, self.hidden = batch, s["hidden_size"]
        self.heads, kv_heads = s["num_attention_heads"], s["num_key_value_heads"]
        self.head_dim = self.hidden // self.heads
        self.eps = s.get("rms_norm_eps", 1e-6)  # transformers' LlamaConfig default
        self.weights = [{role: (torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device),
                                torch.rand(n, 1, device=device) * 0.01) for role, (n, k) in gemm_shapes(model).items()}
                        for _ in range(num_layers)]
        used = math.ceil(context / PAGE)
        width = s["max_position_embeddings"] // PAGE  # the engine's graph table: max_model_len / block_size
        self.caches = [_int8_cache(batch * used, kv_heads, self.head_dim, device) for _ in range(num_layers)]
        self.tables = [torch.nn.functional.pad(
            torch.randperm(batch * used, dtype=torch.int32, device=device).view(batch, used), (0, width - used))
            for _ in range(num_layers)]
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.x = torch.randn(batch, self.hidden, **bf16)
        self.residual = torch.randn(batch, self.hidden, **bf16)
        self.norm_weight = torch.rand(self.hidden, **bf16) + 0.5
        self.q = torch.randn(batch, self.heads, self.head_dim, **bf16)
        self.gate_up = torch.randn(batch, 2 * s["intermediate_size"], **bf16)

    def layer(self, i, configs):
        """Layer i's kernels; configs: {role: GemmConfig} for the GEMMs to launch with a given config (the others
        take the table's, as the engine does)."""
        w = self.weights[i]

        def gemm(role, x_q, x_scale):
            return int8_gemm_with_config(x_q, x_scale, *w[role], config=configs.get(role))

        gemm("qkv", *rmsnorm_quant(self.x, self.norm_weight, self.eps, self.residual)[:2])
        attn = decode_attention(self.q, *self.caches[i], self.tables[i], self.seq_lens, self.head_dim ** -0.5)
        out = gemm("o", *quant_per_token(attn.view(self.batch, self.heads * self.head_dim)))
        gemm("gate_up", *rmsnorm_quant(out, self.norm_weight, self.eps, self.residual)[:2])
        return gemm("down", *silu_mul_quant(self.gate_up))

    def calls(self, configs):
        """One callable per layer, for eval/bench_gemm.time_graph."""
        return [lambda i=i: self.layer(i, configs) for i in range(len(self.weights))]

    def time_us(self, configs, target_ms=3.0, replays=3):
        """Median microseconds a layer, the stack replayed as a CUDA graph."""
        from eightbit.eval.bench_gemm import time_graph

        return time_graph(self.calls(configs), target_ms=target_ms, replays=replays)
