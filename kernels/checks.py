"""The input checks both backends of an op make: the shapes, dtypes and devices that give the op its meaning.

The plain-torch references (the CPU backend) and the Triton wrappers call these same functions, so a bad input
gets the same error on either device, never a silent wrong answer on one of them. What only a kernel needs
(contiguous rows, a power-of-two head_dim or block_size, aligned blocks) each wrapper checks on top. With
EIGHTBIT_CHECK_METADATA=1 the metadata's values are range-checked too (metadata_checks), on both backends.
Plain torch only: a CPU-only install imports this without triton.
"""

import numbers

import torch

from eightbit.kernels import metadata_checks

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_K = (2**31 - 1) // (128 * 128)  # 131071: past it, a dot product of -128s wraps the int32 accumulator


def _tensors(name, **named):
    """Each named argument is a tensor (a TypeError naming it, not an AttributeError from deep inside)."""
    for what, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(x).__name__}")


def _floats(name, **named):
    """Each named argument is a float tensor."""
    _tensors(name, **named)
    for what, x in named.items():
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name}: {what} must be a float tensor, got {x.dtype}")


def softmax_scale(value, name):
    """A real number (the kernels take it as a launch argument, never as a tensor that would need a host sync)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: softmax_scale must be a number, got {type(value).__name__}")


def _same_device(tensors, dev, name):
    for x in tensors:
        if x is not None and x.device != dev:
            raise ValueError(f"{name}: all tensors must be on one device, found {x.device} and {dev}")


def _index_vector(x, length, what, name):
    if x.shape != (length,) or x.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: {what} must be an int32/int64 [{length}] tensor, got {x.dtype} {tuple(x.shape)}")


# --- row ops -------------------------------------------------------------------------------


def rms_norm(x, weight, residual):
    """Float x [..., H] and weight [H]; a float residual exactly x's shape (no broadcasting), on x's device."""
    extra = {} if residual is None else {"residual": residual}
    _floats("rms_norm", x=x, weight=weight, **extra)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension, got a scalar")
    h = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != h:
        raise ValueError(f"weight must have shape ({h},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    _same_device((weight, residual), x.device, "rms_norm")


def quant_per_token(x):
    """Float x [..., K]."""
    _floats("quant_per_token", x=x)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension, got a scalar")


def silu_mul(gate_up):
    """Float gate_up [..., 2I]: gate first, then up."""
    _floats("silu_mul", gate_up=gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got shape {tuple(gate_up.shape)}")


# --- the GEMM ------------------------------------------------------------------------------


def int8_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    """int8 x_q [M, K] and w_q [N, K], float32 scales of M and N elements, a float bias [N]. Returns (M, N, K)."""
    extra = {} if bias is None else {"bias": bias}
    _tensors("int8_gemm", x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale, **extra)
    if x_q.dtype != torch.int8 or w_q.dtype != torch.int8:
        raise TypeError(f"x_q and w_q must be int8, got {x_q.dtype} and {w_q.dtype}")
    if x_q.dim() != 2 or w_q.dim() != 2:
        raise ValueError(f"x_q must be [M, K] and w_q [N, K], got {tuple(x_q.shape)} and {tuple(w_q.shape)}")
    m, k = x_q.shape
    n, k2 = w_q.shape
    if k != k2:
        raise ValueError(f"K mismatch: x_q {tuple(x_q.shape)} vs w_q {tuple(w_q.shape)}")
    if k > MAX_K:
        raise ValueError(f"int8_gemm: K = {k} can overflow the int32 accumulator (K * 128 * 128 >= 2^31); "
                         f"at most {MAX_K}")
    for name, s, rows in (("x_scale", x_scale, m), ("w_scale", w_scale, n)):
        if s.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {s.dtype}")
        if s.numel() != rows:  # a single scale would broadcast
            raise ValueError(f"{name} must be a [{rows}] or [{rows}, 1] tensor, got {tuple(s.shape)}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != n:
            raise ValueError(f"bias must be a [{n}] tensor, got {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a float tensor, got {bias.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    _same_device((x_scale, w_q, w_scale, bias), x_q.device, "int8_gemm")
    return m, n, k


# --- the paged KV cache ----------------------------------------------------------------------


def v_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    """The stored shape of a V cache: int8 is key-minor (see kernels/reference.py's docstring)."""
    if dtype == torch.int8:
        return (num_blocks, num_kv_heads, head_dim, block_size)
    return (num_blocks, block_size, num_kv_heads, head_dim)


def v_cache_layout(k_cache, v_cache):
    """v_cache has the layout a k_cache of its shape asks for, and k_cache's dtype."""
    want = v_cache_shape(*k_cache.shape, v_cache.dtype)
    if tuple(v_cache.shape) != want or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must be {k_cache.dtype} {want} for a k_cache of shape {tuple(k_cache.shape)} "
                         f"(an int8 V cache is [num_blocks, Hkv, D, block_size]), got {v_cache.dtype} "
                         f"{tuple(v_cache.shape)}")


def cache(k_cache, v_cache, k_scale, v_scale, name):
    """k_cache [num_blocks, block_size, Hkv, D]; V to match; scales [num_blocks, block_size, Hkv, D // G] of one
    float dtype for an int8 cache, none for a float cache. Returns (quant, group size G)."""
    scales = {k: x for k, x in (("k_scale", k_scale), ("v_scale", v_scale)) if x is not None}
    _tensors(name, k_cache=k_cache, v_cache=v_cache, **scales)
    if k_cache.dim() != 4:
        raise ValueError(f"{name}: k_cache must be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    v_cache_layout(k_cache, v_cache)
    d = k_cache.shape[3]
    quant = k_cache.dtype == torch.int8
    if not quant:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{name}: a {k_cache.dtype} cache takes no scales (pass None)")
        if not k_cache.dtype.is_floating_point:
            raise ValueError(f"{name}: the cache must be int8 or a float dtype, got {k_cache.dtype}")
        return False, d
    if k_scale is None or v_scale is None:
        raise ValueError(f"{name}: an int8 cache needs k_scale and v_scale")
    if k_scale.shape != v_scale.shape or k_scale.dim() != 4 or k_scale.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"{name}: scales must be [num_blocks, block_size, Hkv, D // G] matching the cache, "
                         f"got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
    ng = k_scale.shape[3]
    if ng == 0 or d % ng:
        raise ValueError(f"{name}: D // G = {ng} groups must divide head_dim {d}")
    if k_scale.dtype != v_scale.dtype or not k_scale.dtype.is_floating_point:
        raise ValueError(f"{name}: scales must share one float dtype, got {k_scale.dtype} and {v_scale.dtype}")
    return True, d // ng


def kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """Float k and v [T, Hkv, D] to a cache of the same Hkv and D, slot_mapping [T]. Returns quant."""
    _floats("kv_write", k=k, v=v)
    _tensors("kv_write", slot_mapping=slot_mapping)
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"kv_write: k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    quant, _ = cache(k_cache, v_cache, k_scale, v_scale, "kv_write")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"kv_write: cache heads/head_dim {tuple(k_cache.shape[2:])} do not match k's "
                         f"{tuple(k.shape[1:])}")
    _index_vector(slot_mapping, k.shape[0], "slot_mapping", "kv_write")
    _same_device((v, k_cache, v_cache, k_scale, v_scale, slot_mapping), k.device, "kv_write")
    if metadata_checks.active(k.device):
        metadata_checks.check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1], "kv_write")
    return quant


def rope(q, k, positions, cos_sin_cache):
    """q [T, Hq, D] of k's dtype, positions [T], a float cos_sin_cache [max_pos, D] (cos | sin)."""
    _tensors("rope_kv_write", q=q, positions=positions)
    _floats("rope_kv_write", cos_sin_cache=cos_sin_cache)
    t, _, d = k.shape
    if q.dim() != 3 or q.shape[0] != t or q.shape[2] != d:
        raise ValueError(f"rope_kv_write: q must be [T={t}, Hq, D={d}], got {tuple(q.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"rope_kv_write: q is {q.dtype} but k is {k.dtype}")
    _index_vector(positions, t, "positions", "rope_kv_write")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d:
        raise ValueError(f"rope_kv_write: cos_sin_cache must be [max_pos, D={d}] (cos | sin), "
                         f"got {tuple(cos_sin_cache.shape)}")
    _same_device((q, positions, cos_sin_cache), k.device, "rope_kv_write")
    if metadata_checks.active(k.device):
        metadata_checks.check_positions(positions, cos_sin_cache.shape[0], "rope_kv_write")


# --- attention -----------------------------------------------------------------------------


def attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, name):
    """q [tokens, Hq, D] in a float dtype (float64 too: the reference is the GPU tests' float64 oracle) over a
    cache of the same D whose Hkv divides Hq; block_tables [B, width] and seq_lens [B] of int32/int64. Returns
    (quant, group size G)."""
    _tensors(name, q=q, block_tables=block_tables, seq_lens=seq_lens)
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [tokens, Hq, D], got {tuple(q.shape)}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"{name}: q must be a float tensor, got {q.dtype}")
    quant, group = cache(k_cache, v_cache, k_scale, v_scale, name)
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"{name}: cache head_dim {k_cache.shape[3]} != q's {d}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{name}: {hq} query heads are not a multiple of {hkv} kv heads")
    if block_tables.dim() != 2 or block_tables.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: block_tables must be an int32/int64 [B, max_blocks] tensor, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    _index_vector(seq_lens, block_tables.shape[0], "seq_lens", name)
    _same_device((k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens), q.device, name)
    if metadata_checks.active(q.device):
        metadata_checks.check_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1], name)
    return quant, group


def prefill_queries(q, cu_seqlens_q, seq_lens):
    """cu_seqlens_q [B + 1] of int32/int64 on q's device."""
    _tensors("prefill_attention", cu_seqlens_q=cu_seqlens_q)
    b = seq_lens.shape[0]
    _index_vector(cu_seqlens_q, b + 1, "cu_seqlens_q", "prefill_attention")
    _same_device((cu_seqlens_q,), q.device, "prefill_attention")
    if metadata_checks.active(q.device):
        metadata_checks.check_queries(cu_seqlens_q, seq_lens, q.shape[0], "prefill_attention")


def decode_batch(q, block_tables):
    """One block table row per query row."""
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"decode_attention: block_tables has {block_tables.shape[0]} rows for batch {q.shape[0]}")
