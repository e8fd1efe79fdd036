"""FlashAttention-2 style causal varlen prefill over the paged (int8 or float) KV cache.

Triton twin of reference.prefill_attention. The queries of B sequences are packed back to
back (cu_seqlens_q); sequence b's n queries are its LAST n tokens, so query i sits at
position p_i = seq_lens[b] - n + i and sees keys 0..p_i. Every key and value, the earlier
context and the chunk's own, is read from the cache through the block table (kv_write has
already stored the chunk), so chunked prefill and prefix-cache hits are the same launch.

Algorithm, one program per (query head, BLOCK_M query tile of one sequence):
  * Q tile [BLOCK_M, D] stays in registers; K/V tiles of BLOCK_N keys are gathered through
    the block table (a tile may span several pages: slot = table[n // PAGE] * PAGE + n % PAGE).
  * int8 cache: the dots run in float16. The tile is converted exactly (i8_to) and multiplied
    by its per-(token, head, group) fp16 scales (reshaped [BLOCK_N, D/G, G]); q is scaled into
    fp16 range by a power of two (dot_operand). V is stored key-minor (reference.py), so its
    tile is read as [D, BLOCK_N], a page's keys adjacent.
  * Online softmax in base 2: scores are scaled by softmax_scale * log2(e) once, so exp2 is
    the only transcendental; the running max m, sum l and output acc are rescaled per tile.
  * Causal: tiles wholly at or below the tile's first query position run without a mask;
    only the diagonal tiles (up to the last query's position) mask; tiles wholly above the
    diagonal are never visited.
  * GQA: query head h reads kv head h // (Hq // Hkv).
Tiles are handed out longest-first within each sequence (the last query tile sees the most
keys), via a small tile -> (sequence, tile) map built on the device with no host sync, once
per step (see _tile_map).

On sm_90 a float cache at the head_dims of attention_configs.PREFILL_WS runs the warp-specialized Gluon kernel
of prefill_attention_hopper.py instead (same contract and tile map), and so does a long int8-cache prefill, on
a copy of its blocks in q's 16-bit dtype made by kv_dequant.py (`_hopper_operands` decides).

Requirements: q [T, Hq, D] float16/bfloat16/float32 with a contiguous last dim; power-of-two
head_dim; block_tables int32/int64 [B, max_blocks]; cu_seqlens_q [B+1] and seq_lens [B]
int32/int64 on the same device; caches as in reference.py (K and float V head_dim-contiguous,
int8 V key-minor).
"""

import torch
import triton
import triton.language as tl

from . import attention_configs, checks
from .attention_configs import prefill_config
from .launch import FastLauncher, interpreting

LOG2E = 1.4426950408889634

# int8 -> float16 for four values packed in a 32-bit register, as two f16x2 registers (also used by the Gluon
# decode kernel): flip the sign bits, byte-permute each value under the exponent of 1024 so the fp16 reads
# 1152 + x, subtract 1152 two at a time
I8_TO_F16_PTX = tl.constexpr("""{
    .reg .b32 t, hi, c;
    xor.b32 t, $2, 0x80808080;
    mov.b32 hi, 0x64646464;
    mov.b32 c, 0x64806480;
    prmt.b32 $0, t, hi, 0x5140;
    prmt.b32 $1, t, hi, 0x7362;
    sub.f16x2 $0, $0, c;
    sub.f16x2 $1, $1, c;
    }""")


@triton.jit
def i8_to(x, DTYPE: tl.constexpr, COMPILED: tl.constexpr):
    """int8 -> DTYPE, exact. Compiled: to float16 four values per 32-bit register in five
    instructions (flip the sign bits, byte-permute each value under the exponent of 1024 so the
    fp16 reads 1152 + x, subtract 1152 two at a time); to bfloat16 Triton's own byte-permute
    lowering (eight per four); to float32 through bfloat16 (a shift more). The CPU interpreter
    runs no PTX and gets bfloat16 wrong, so it goes through float32."""
    if COMPILED and DTYPE == tl.float16:
        return tl.inline_asm_elementwise(asm=I8_TO_F16_PTX, constraints="=r,=r,r", args=[x], dtype=tl.float16,
                                         is_pure=True, pack=4)
    elif COMPILED:
        return x.to(tl.bfloat16).to(DTYPE)
    else:
        return x.to(tl.float32).to(DTYPE)


@triton.jit
def float_dot(a, b, acc):
    """tl.dot at its inputs' own precision. Triton runs float32 inputs as TF32 by default (10-bit mantissas:
    attention 3e-3 off on an H200), which a float32 model does not expect; 16-bit inputs are unaffected."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def dot_operand(q, qk_scale, QUANT: tl.constexpr):
    """The Q tile as the dots over the cache take it, and qk_scale to match. Over an int8 cache a
    16-bit q becomes float16 (int8 -> fp16 is the cheap conversion, and exact), divided by a power
    of two above its largest magnitude: exact, and in range whatever q's; qk_scale takes the power
    back. A float32 q (tests, CPU) stays float32; a float cache is read in q's dtype."""
    if QUANT and q.dtype != tl.float32:
        amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
        unit = (amax.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True) * 2.0  # 2^(floor(log2 amax)+1)
        unit = tl.where(unit > 0, unit, 1.0)
        return (q.to(tl.float32) / unit).to(tl.float16), qk_scale * unit
    else:
        return q, qk_scale


@triton.jit
def _load_scales(scale_ptr, scale_off, row_mask, NG: tl.constexpr, MASKED: tl.constexpr):
    """The [BLOCK_N, NG] group scales of the keys at scale_off."""
    sptrs = scale_ptr + scale_off[:, None] + tl.arange(0, NG)[None, :]
    if MASKED:
        return tl.load(sptrs, mask=row_mask[:, None], other=0.0)
    else:
        return tl.load(sptrs)


@triton.jit
def _load_kv_raw(
    cache_ptr, scale_ptr, slot_off, scale_off, cols, row_mask,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr, MASKED: tl.constexpr,
):
    """The stored [BLOCK_N, HEAD_DIM] tile at the given slot offsets and its [BLOCK_N, D/G] scales
    (int8 cache; for a float cache the tile is returned twice)."""
    ptrs = cache_ptr + slot_off[:, None] + cols[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=row_mask[:, None], other=0)
    else:
        x = tl.load(ptrs)
    if QUANT:
        return x, _load_scales(scale_ptr, scale_off, row_mask, HEAD_DIM // GROUP, MASKED)
    else:
        return x, x


@triton.jit
def _dequant_tile(x, s, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr,
                  OUT_DTYPE: tl.constexpr, COMPILED: tl.constexpr):
    if QUANT:  # OUT_DTYPE is float16 or float32 (dot_operand); one rounding, the product's
        NG: tl.constexpr = HEAD_DIM // GROUP
        BN: tl.constexpr = x.shape[0]
        xf = tl.reshape(i8_to(x, OUT_DTYPE, COMPILED), (BN, NG, GROUP)) * s.to(OUT_DTYPE)[:, :, None]
        return tl.reshape(xf, (BN, HEAD_DIM))
    else:
        return x.to(OUT_DTYPE)


@triton.jit
def _load_kv_tile(
    cache_ptr, scale_ptr, slot_off, scale_off, cols, row_mask,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr, MASKED: tl.constexpr,
    OUT_DTYPE: tl.constexpr, COMPILED: tl.constexpr,
):
    """[BLOCK_N, HEAD_DIM] keys or values at the given slot offsets, dequantized to OUT_DTYPE."""
    x, s = _load_kv_raw(cache_ptr, scale_ptr, slot_off, scale_off, cols, row_mask, HEAD_DIM, GROUP, QUANT, MASKED)
    return _dequant_tile(x, s, HEAD_DIM, GROUP, QUANT, OUT_DTYPE, COMPILED)


@triton.jit
def _load_v_key_minor(
    v_ptr, scale_ptr, page_base, page_off, scale_off, cols, row_mask,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    OUT_DTYPE: tl.constexpr, COMPILED: tl.constexpr,
):
    """[BLOCK_N, HEAD_DIM] values from the key-minor int8 V cache ([blocks, Hkv, D, PAGE];
    page_base = the key's block offset + the head's), dequantized to OUT_DTYPE.

    Loaded as [D, BLOCK_N] with a page's keys adjacent. The load is not masked: a mask per key
    would stop the vector loads, and the keys past the end read valid memory (the rest of the
    last page, or block 0 where the table load was masked); int8 holds no NaN, and those keys'
    scales load as 0 and their probabilities are 0."""
    BN: tl.constexpr = page_off.shape[0]
    RUN: tl.constexpr = min(PAGE_SIZE, BN, 16)  # keys contiguous and RUN-aligned (tiles start at multiples of BN)
    off = tl.max_contiguous(tl.multiple_of(page_base + page_off, RUN), RUN)
    x = tl.load(v_ptr + off[None, :] + cols[:, None] * PAGE_SIZE)  # [D, BN]
    NG: tl.constexpr = HEAD_DIM // GROUP
    s = _load_scales(scale_ptr, scale_off, row_mask, NG, MASKED)
    xf = tl.reshape(i8_to(x, OUT_DTYPE, COMPILED), (NG, GROUP, BN)) * tl.trans(s.to(OUT_DTYPE))[:, None, :]
    return tl.trans(tl.reshape(xf, (HEAD_DIM, BN)))


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, n_start, offs_n, q_pos, seq_len, qk_scale,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row_ptr,
    stride_cb, stride_cp, kv_head_off, stride_vb, v_head_off, stride_sb, stride_sp, scale_head_off, cols,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr, MASKED: tl.constexpr, COMPILED: tl.constexpr,
):
    """One online-softmax step over keys n_start .. n_start + BLOCK_N."""
    n = n_start + offs_n
    in_seq = n < seq_len
    if MASKED:
        blk = tl.load(bt_row_ptr + n // PAGE_SIZE, mask=in_seq, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + n // PAGE_SIZE).to(tl.int64)
    page_off = n % PAGE_SIZE
    slot_off = blk * stride_cb + page_off * stride_cp + kv_head_off
    scale_off = blk * stride_sb + page_off * stride_sp + scale_head_off
    k = _load_kv_tile(k_cache_ptr, k_scale_ptr, slot_off, scale_off, cols, in_seq,
                      HEAD_DIM, GROUP, QUANT, MASKED, q.dtype, COMPILED)
    qk = float_dot(q, tl.trans(k), None) * qk_scale
    if MASKED:
        keep = (n[None, :] <= q_pos[:, None]) & in_seq[None, :]
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT:
        v = _load_v_key_minor(v_cache_ptr, v_scale_ptr, blk * stride_vb + v_head_off, page_off, scale_off, cols,
                              in_seq, HEAD_DIM, GROUP, PAGE_SIZE, MASKED, q.dtype, COMPILED)
    else:
        v = _load_kv_tile(v_cache_ptr, v_scale_ptr, slot_off, scale_off, cols, in_seq,
                          HEAD_DIM, GROUP, QUANT, MASKED, q.dtype, COMPILED)
    acc = acc * alpha[:, None]
    acc = float_dot(p.to(q.dtype), v, acc)
    return acc, m_new, l_i


# (a mixed step passes block_tables[nd:] and seq_lens[nd:], views at any offset: no alignment
# specialization for them, or each new offset alignment would compile another variant mid-run)
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _prefill_kernel(
    # pointers
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, cu_seqlens_ptr, seq_lens_ptr, tile_seq_ptr, tile_idx_ptr,
    # scalars
    qk_scale, num_seqs,
    # strides (elements)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cp, stride_ch, stride_vb, stride_vh, stride_sb, stride_sp, stride_sh, stride_bt,
    # sizes and modes
    QPK: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, COMPILED: tl.constexpr,
):
    h = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    if seq >= num_seqs:
        return
    m_tile = tl.load(tile_idx_ptr + tile)
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    n_q = (tl.load(cu_seqlens_ptr + seq + 1) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx = seq_len - n_q  # position of the sequence's first query

    kvh = h // QPK
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_q
    q_pos = ctx + offs_m
    q_ptrs = q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + cols[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    q, qk_scale = dot_operand(q, qk_scale, QUANT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kvh.to(tl.int64) * stride_ch
    v_head_off = kvh.to(tl.int64) * stride_vh
    scale_head_off = kvh.to(tl.int64) * stride_sh

    first_pos = ctx + m_tile * BLOCK_M
    last_pos = tl.minimum(first_pos + BLOCK_M, seq_len)  # exclusive: keys < last_pos
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # tiles [0, full_end) need no mask
    for n_start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, n_start, offs_n, q_pos, seq_len, qk_scale,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row,
            stride_cb, stride_cp, kv_head_off, stride_vb, v_head_off, stride_sb, stride_sp, scale_head_off, cols,
            HEAD_DIM, GROUP, PAGE_SIZE, QUANT, False, COMPILED)
    for n_start in range(full_end, last_pos, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, n_start, offs_n, q_pos, seq_len, qk_scale,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row,
            stride_cb, stride_cp, kv_head_off, stride_vb, v_head_off, stride_sb, stride_sp, scale_head_off, cols,
            HEAD_DIM, GROUP, PAGE_SIZE, QUANT, True, COMPILED)

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + cols[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def compiled():
    """The kernels' COMPILED flag: False under the CPU interpreter, which cannot run inline PTX."""
    return not interpreting()


def check_attention_inputs(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, name):
    """checks.attention, then what the prefill and decode kernels need on top. Returns (quant, group_size)."""
    quant, group = checks.attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, name)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: q must be float16/bfloat16/float32, got {q.dtype}")
    d, page = q.shape[2], k_cache.shape[1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"{name}: head_dim must be a power of two >= 16, got {d}")
    if quant:  # int8 V (key-minor): each block contiguous and 16-aligned (the kernels' vector-load hints)
        v_ok = v_cache.stride()[1:] == (d * page, page, 1) and v_cache.stride(0) % 16 == 0
    else:  # a float V is read with K's offsets
        v_ok = v_cache.stride() == k_cache.stride()
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1 or not v_ok:
        raise ValueError(f"{name}: q and k_cache need a contiguous head_dim, and v_cache "
                         f"{'contiguous, 16-aligned blocks' if quant else 'the strides of k_cache'}")
    if page & (page - 1):  # the kernels split a key index into (page, offset) by shifts and masks
        raise ValueError(f"{name}: the cache needs a power-of-two block_size, got {page}")
    if quant:
        ng = k_scale.shape[3]
        if ng & (ng - 1):
            raise ValueError(f"{name}: D // G = {ng} must be a power of two")
        if k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1:
            raise ValueError(f"{name}: k_scale and v_scale must share one layout with a contiguous last dim, "
                             f"got strides {k_scale.stride()} and {v_scale.stride()}")
    if block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables' rows must be contiguous, got strides {block_tables.stride()}")
    if not seq_lens.is_contiguous():
        raise ValueError(f"{name}: seq_lens must be a contiguous int32/int64 [B], got strides {seq_lens.stride()}")
    return quant, group


_launch_prefill = FastLauncher(_prefill_kernel)
_last_tile_map = [None]  # the memo of _tile_map: (cu_seqlens_q, its key, map) of the latest call


def per_step(slot, t, extra, build):
    """build() once per step instead of once per layer: every layer of a step passes the same tensor t.

    slot ([None] at first) keeps (t, key, value) of the latest call. It holds the tensor itself, so its id
    cannot be reused, and, outside inference mode, its version counter, so an in-place change misses.
    extra: anything else the value depends on. Contract: an inference-mode t (no version counter) is not
    changed in place between calls (the engine builds new step tensors, or new views, every step)."""
    key = (None if t.is_inference() else t._version, *extra)
    memo = slot[0]
    if memo is not None and memo[0] is t and memo[1] == key:
        return memo[2]
    value = build()
    slot[0] = (t, key, value)
    return value


def _tile_map(cu_seqlens_q, t, bm):
    """Program -> (sequence, query tile), longest tile of each sequence first; no host sync. The map (seven
    small device ops, ~0.1 ms of launches) is built once per step (per_step)."""
    return per_step(_last_tile_map, cu_seqlens_q, (t, bm), lambda: _build_tile_map(cu_seqlens_q, t, bm))


def _build_tile_map(cu_seqlens_q, t, bm):
    b = cu_seqlens_q.shape[0] - 1
    n_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int32)
    tiles = (n_q + bm - 1) // bm
    ends = torch.cumsum(tiles, 0, dtype=torch.int32)
    bound = triton.cdiv(t, bm) + b
    pid = torch.arange(bound, device=cu_seqlens_q.device, dtype=torch.int32)
    tile_seq = torch.searchsorted(ends, pid, right=True).to(torch.int32)
    sc = tile_seq.clamp(max=b - 1).long()
    tile_idx = (ends[sc] - 1 - pid).to(torch.int32)
    return bound, tile_seq, tile_idx


def prefill_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens, softmax_scale):
    """Causal varlen attention of packed queries (each sequence's last tokens) over the paged cache.

    Returns a new [T, Hq, D] tensor in q.dtype; its rows past cu_seqlens_q[-1] are not written. See the module
    docstring for the layout rules.
    """
    quant, group = check_attention_inputs(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                                          "prefill_attention")
    checks.prefill_queries(q, cu_seqlens_q, seq_lens)
    checks.softmax_scale(softmax_scale, "prefill_attention")
    if not cu_seqlens_q.is_contiguous():
        raise ValueError(f"prefill_attention: cu_seqlens_q must be a contiguous int32/int64 [B+1], got strides "
                         f"{cu_seqlens_q.stride()}")
    b = block_tables.shape[0]
    t, hq, d = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0 or b == 0:
        return out
    hopper = _hopper_operands(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, quant)
    if hopper is not None:
        from .prefill_attention_hopper import TILE_M, launch_ws

        return launch_ws(q, *hopper, cu_seqlens_q, seq_lens, float(softmax_scale) * LOG2E, out,
                         _tile_map(cu_seqlens_q, t, TILE_M))
    cfg = prefill_config(d, k_cache.dtype, t // b)
    bm, bn = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    bound, tile_seq, tile_idx = _tile_map(cu_seqlens_q, t, bm)
    hkv = k_cache.shape[2]
    ks = k_scale if quant else k_cache
    vs = v_scale if quant else v_cache
    _launch_prefill((hq, bound), dict(
        q_ptr=q, out_ptr=out, k_cache_ptr=k_cache, v_cache_ptr=v_cache, k_scale_ptr=ks, v_scale_ptr=vs,
        block_tables_ptr=block_tables, cu_seqlens_ptr=cu_seqlens_q, seq_lens_ptr=seq_lens,
        tile_seq_ptr=tile_seq, tile_idx_ptr=tile_idx,
        qk_scale=float(softmax_scale) * LOG2E, num_seqs=b,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_cb=k_cache.stride(0), stride_cp=k_cache.stride(1), stride_ch=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vh=v_cache.stride(1 if quant else 2),
        stride_sb=ks.stride(0), stride_sp=ks.stride(1), stride_sh=ks.stride(2),
        stride_bt=block_tables.stride(0),
        QPK=hq // hkv, HEAD_DIM=d, GROUP=group, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=bm, BLOCK_N=bn, QUANT=quant, COMPILED=compiled(),
    ), **cfg)
    return out


def _hopper_operands(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, quant):
    """(K cache, V cache, block table) for the warp-specialized Hopper kernel (prefill_attention_hopper.py), or
    None when the Triton kernel runs: a float cache as it is, where that kernel's ws_ok takes it; an int8 cache as
    a dequantized copy of its blocks in q's dtype (kv_dequant.py), where _int8_via_float says so and the copy fits in
    memory (out of memory, the Triton kernel reads the int8 cache itself)."""
    if not q.is_cuda or not compiled():
        return None
    if not quant:
        from .prefill_attention_hopper import ws_ok

        return (k_cache, v_cache, block_tables) if ws_ok(q, k_cache, v_cache) else None
    if not _int8_via_float(q, k_cache, block_tables):
        return None
    from .kv_dequant import dequantize_blocks

    try:
        return dequantize_blocks(k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, q.dtype)
    except torch.cuda.OutOfMemoryError:
        return None


def _int8_via_float(q, k_cache, block_tables):
    """Whether an int8-cache prefill runs as a dequantized float copy of its blocks (kv_dequant.py) through the
    Hopper kernel: enough query tokens per sequence on average, or a long context (block_tables' width: the
    engine passes only the prefill sequences' columns), a small enough copy (attention_configs), a copy that the
    Hopper kernel takes, and no CUDA-graph capture (a captured table is max_model_len wide whatever the context,
    and the graphs' memory pool is kept small)."""
    if not attention_configs.PREFILL_INT8_VIA_FLOAT or torch.cuda.is_current_stream_capturing():
        return False
    b, width = block_tables.shape
    _, page, hkv, d = k_cache.shape
    copy_bytes = 2 * b * width * page * hkv * d * q.element_size()
    enough = (q.shape[0] >= b * attention_configs.PREFILL_INT8_VIA_FLOAT_MIN_TOKENS
              or width * page >= attention_configs.PREFILL_INT8_VIA_FLOAT_MIN_CONTEXT)
    if not enough or copy_bytes > attention_configs.PREFILL_INT8_VIA_FLOAT_MAX_BYTES:
        return False
    from .prefill_attention_hopper import shape_ok

    return shape_ok(q, (b * width, page, hkv, d))
