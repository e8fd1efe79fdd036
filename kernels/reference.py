"""Plain-PyTorch versions of every fused op: the CPU backend and the test oracle.

Each op here (rms_norm ... decode_attention, the names `kernels.ops` dispatches) has a Triton twin with the
same signature in its own file under kernels/; `kernels.ops` picks one by device. Both check their inputs with
the same functions (kernels/checks.py), so they refuse the same bad input alike. The rest of this file
(rotary, gather_kv, dequantize_blocks, ...) are helpers of the ops and of tests. Math is done in float32 and
cast back to the input dtype at the end.

The paged KV cache (one layer):
    k_cache           [num_blocks, block_size, num_kv_heads, head_dim]   model dtype or int8
    v_cache           the same for a float cache; int8: [num_blocks, num_kv_heads, head_dim, block_size]
    k_scale, v_scale  [num_blocks, block_size, num_kv_heads, head_dim // G]  int8 cache only; float16 in the
                      engine (any float dtype is accepted; the Triton prefill rounds float32 ones to float16)
A token's slot is block_id * block_size + offset; sequence b's tokens live in
the blocks block_tables[b, 0], block_tables[b, 1], ... in order.

The int8 V cache is stored key-minor (a page's keys adjacent for each channel) because the
attention kernels' P·V tensor-core dot reads consecutive keys per thread, and sm_90 can
transpose 16-bit tiles on the way from shared memory (ldmatrix.trans) but not 8-bit ones:
token-major int8 V was read one byte at a time (docs/benchmarks/attention.md). `v_token_major`
gives the [num_blocks, block_size, Hkv, D] view every reference op works on.
"""

import torch
import torch.nn.functional as F

from eightbit.kernels import checks
from eightbit.kernels.checks import v_cache_shape  # noqa: F401  (the cache layout, imported from here by callers)
from eightbit.quant.int8 import dequantize_groups, quantize_groups, quantize_per_token

# --- norms, activations, per-token quantization ------------------------------------------


def rms_norm(x, weight, eps, residual=None):
    """(x + residual) -> RMSNorm. Returns (normed in x.dtype, the new residual or None).

    With a residual, the sum x + residual is both normalized and returned as the
    next layer's residual (the pre-norm transformer's running stream).
    """
    checks.rms_norm(x, weight, residual)
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        residual = x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), residual


def rmsnorm_quant(x, weight, eps, residual=None):
    """rms_norm, then per-token int8. Returns (q int8, scale f32 [M, 1], new residual or None)."""
    out, residual = rms_norm(x, weight, eps, residual)
    q, scale = quant_per_token(out)
    return q, scale, residual


def silu_mul(gate_up):
    """gate_up [M, 2I] (gate first, then up) -> SiLU(gate) * up [M, I]."""
    checks.silu_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def silu_mul_quant(gate_up):
    """silu_mul, then per-token int8 -> (q int8 [M, I], scale f32 [M, 1])."""
    return quant_per_token(silu_mul(gate_up))


def quant_per_token(x):
    """x [M, K] -> (int8 [M, K], float32 scale [M, 1]). The input is first rounded to its own dtype."""
    checks.quant_per_token(x)
    return quantize_per_token(x)


def int8_gemm(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
    """int8 x_q [M, K] @ int8 w_q [N, K]^T, exact in int32, then * x_scale[m] * w_scale[n] (+ bias)."""
    checks.int8_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    acc = _int8_matmul(x_q, w_q)
    out = acc.float() * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _int8_matmul(a, b):
    """a [M, K] @ b [N, K]^T of int8, exact in int32."""
    if a.device.type == "cpu" and _fp32_matmul_is_ieee():
        return _int8_matmul_fp32(a, b)
    return (a.double() @ b.double().t()).to(torch.int32)  # exact: |sum| < 2^53


K_CHUNK = 1024  # 1024 products of at most 128 * 128 = 2^14 sum to at most 2^24: integers float32 holds exactly


def _int8_matmul_fp32(a, b):
    """Float32 matmuls over K chunks of K_CHUNK, whose partial sums (in any order of accumulation) are integers
    within 2^24, so exact; added in int32. On the CPU 2-8x faster than torch._int_mm (~0.5 ms a row at SmolLM2's
    sizes) and float64."""
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32, device=a.device)
    for k0 in range(0, a.shape[1], K_CHUNK):
        out += F.linear(a[:, k0:k0 + K_CHUNK].float(), b[:, k0:k0 + K_CHUNK].float()).to(torch.int32)
    return out


def _fp32_matmul_is_ieee():
    """Whether float32 matmuls on the CPU are plain float32 (set_float32_matmul_precision("medium" / "high") makes
    oneDNN use bfloat16 / TF32, which would round the sums)."""
    try:
        return torch.backends.mkldnn.matmul.fp32_precision in ("none", "ieee")
    except (AttributeError, RuntimeError):
        return False


# --- rotary embedding and the KV-cache write ---------------------------------------------


def rotary(q, k, positions, cos_sin_cache):
    """Rotate-half RoPE (HF Llama) on q [T, Hq, D] and k [T, Hkv, D].

    cos_sin_cache [max_pos, D] float32 holds cos in its first D/2 columns and sin in the rest.
    """
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def v_token_major(k_cache, v_cache):
    """v_cache as a [num_blocks, block_size, Hkv, D] view (no copy; writes go to the cache)."""
    checks.v_cache_layout(k_cache, v_cache)
    return v_cache.permute(0, 3, 1, 2) if v_cache.dtype == torch.int8 else v_cache


def kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """Store k, v [T, Hkv, D] at their slots; quantize in groups if the cache is int8. In place.

    A slot of -1 means "do not store" (padding)."""
    checks.kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    _store_kv(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def _store_kv(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    for x, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_token_major(k_cache, v_cache), v_scale)):
        if scale is None:
            cache[block, offset] = x.to(cache.dtype)
        else:
            group_size = cache.shape[-1] // scale.shape[-1]
            q, s = quantize_groups(x, group_size, scale.dtype)
            cache[block, offset] = q
            scale[block, offset] = s


def rope_kv_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """RoPE on q and k, then k and v into the paged cache. Returns the rotated q."""
    checks.kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    checks.rope(q, k, positions, cos_sin_cache)
    q, k = rotary(q, k, positions, cos_sin_cache)
    _store_kv(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    return q


def gather_kv(cache, scale, block_table, length):
    """The first `length` tokens of one sequence from the paged cache, dequantized: [length, Hkv, D] f32.

    cache: token-major [num_blocks, block_size, Hkv, D] (for V: v_token_major's view)."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    x = cache[blocks].flatten(0, 1)[:length]
    if scale is None:
        return x.float()
    return dequantize_groups(x, scale[blocks].flatten(0, 1)[:length])


def dequantize_blocks(k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, dtype):
    """The int8 blocks each sequence uses (those below cdiv(seq_len, block_size)), dequantized into a new
    token-major float cache of B * width blocks (sequence b's block j at b * width + j; the rest zeros), with its
    block table arange(B * width).view(B, width). Returns (K copy, V copy, block table)."""
    nb, page, hkv, d = k_cache.shape
    b, width = block_tables.shape
    k_out = torch.zeros((b * width, page, hkv, d), dtype=dtype, device=k_cache.device)
    v_out = torch.zeros_like(k_out)
    v_tok = v_token_major(k_cache, v_cache)
    for i, length in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : (length + page - 1) // page].long()
        k_out[i * width: i * width + len(blocks)] = dequantize_groups(k_cache[blocks], k_scale[blocks], dtype)
        v_out[i * width: i * width + len(blocks)] = dequantize_groups(v_tok[blocks], v_scale[blocks], dtype)
    table = torch.arange(b * width, dtype=torch.int32, device=k_cache.device).view(b, width)
    return k_out, v_out, table


# --- attention ---------------------------------------------------------------------------


def prefill_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens, softmax_scale):
    """Causal varlen attention of packed queries over the paged cache.

    q [T, Hq, D]: the queries of B sequences packed back to back; sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] and these are its last tokens, so the i-th of its
    n queries sits at position seq_lens[b] - n + i and sees keys 0..that position, all
    read from the cache (kv_write has already stored the new ones). GQA: query head h
    uses kv head h // (Hq // Hkv). Returns [T, Hq, D] in q.dtype; rows past cu_seqlens_q[-1] (padding) are not
    written (undefined), in either backend.
    """
    checks.attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, "prefill_attention")
    checks.prefill_queries(q, cu_seqlens_q, seq_lens)
    checks.softmax_scale(softmax_scale, "prefill_attention")
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = gather_kv(k_cache, k_scale, block_tables[b], length)
        v = gather_kv(v_token_major(k_cache, v_cache), v_scale, block_tables[b], length)
        out[s:e] = _attend(q[s:e], k, v, softmax_scale, first_pos=length - (e - s))
    return out


def decode_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, softmax_scale):
    """One query per sequence: q [B, Hq, D] at position seq_lens[b] - 1. Returns [B, Hq, D].

    Batched over sequences: every block table is gathered to its full width and the
    keys past each sequence's length are masked out. A sequence of length 0 (a padded slot) gives zeros.
    """
    checks.attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, "decode_attention")
    checks.decode_batch(q, block_tables)
    checks.softmax_scale(softmax_scale, "decode_attention")
    b, hq, d = q.shape
    if b == 0:
        return q.new_empty(q.shape)
    k = gather_kv_padded(k_cache, k_scale, block_tables)  # [B, L, Hkv, D]
    v = gather_kv_padded(v_token_major(k_cache, v_cache), v_scale, block_tables)
    hkv = k.shape[2]
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * softmax_scale
    past_end = torch.arange(k.shape[1], device=q.device) >= seq_lens.view(b, 1, 1, 1)
    probs = scores.masked_fill(past_end, float("-inf")).softmax(dim=-1)
    probs = probs.masked_fill((seq_lens == 0).view(b, 1, 1, 1), 0.0)  # no keys: zeros, as the kernels give
    v = v.masked_fill(past_end.view(b, -1, 1, 1), 0.0)  # never-written slots may hold NaN: 0 * NaN = NaN
    return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(b, hq, d).to(q.dtype)


def gather_kv_padded(cache, scale, block_tables):
    """All blocks of every table, dequantized: [B, width * block_size, Hkv, D] float32."""
    blocks = block_tables.long()
    # -1 padding, or a stale id in a column past the sequence's end (a graph's table), reads block 0: masked keys
    blocks = torch.where((blocks >= 0) & (blocks < cache.shape[0]), blocks, 0)
    x = cache[blocks].flatten(1, 2)
    if scale is None:
        return x.float()
    return dequantize_groups(x, scale[blocks].flatten(1, 2))


def _attend(q, k, v, softmax_scale, first_pos):
    """q [n, Hq, D] at positions first_pos.., k/v [L, Hkv, D] float32 -> [n, Hq, D].

    Query i sees keys 0..first_pos + i (the causal mask aligned to the bottom right).
    """
    n, hq, _ = q.shape
    q_pos = torch.arange(n, device=q.device).unsqueeze(1) + first_pos
    k_pos = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=k_pos <= q_pos, scale=softmax_scale, enable_gqa=True,
    )  # [Hq, n, D]; GQA: query head h reads kv head h // (Hq // Hkv)
    return out.transpose(0, 1).to(q.dtype)
