"""Paged attention: RoPE and the KV-cache write, then prefill or decode attention over the cache."""

import torch
from torch import nn

from eightbit.engine.context import get_context
from eightbit.kernels import ops


class Attention(nn.Module):
    def __init__(self, num_heads, num_kv_heads, head_dim):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        # Set by the model runner once the cache is allocated; the scales stay None for a float cache.
        self.k_cache = self.v_cache = self.k_scale = self.v_scale = None
        self.cos_sin_cache = None

    def forward(self, positions, q, k, v):
        """q [T, Hq*D], k and v [T, Hkv*D] of the step's new tokens -> [T, Hq*D]."""
        ctx = get_context()
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        cache = (self.k_cache, self.v_cache, self.k_scale, self.v_scale)
        q = ops.rope_kv_write(q, k, v, positions, self.cos_sin_cache, *cache, ctx.slot_mapping)
        if ctx.is_decode:
            o = ops.decode_attention(q, *cache, ctx.block_tables, ctx.seq_lens, self.scale)
        else:
            # a mixed step: the one-token sequences (first) through decode attention, which reads each
            # KV tile once per group of query heads; the prefill kernel would read it once per head
            nd = ctx.num_decodes
            tables, seq_lens = ctx.prefill_part
            o = ops.prefill_attention(q[nd:], *cache, tables, ctx.cu_seqlens_q, seq_lens, self.scale)
            if nd:
                dec = ops.decode_attention(q[:nd], *cache, *ctx.decode_part, self.scale)
                o = torch.cat([dec, o])
        return o.reshape(t, self.num_heads * self.head_dim)
