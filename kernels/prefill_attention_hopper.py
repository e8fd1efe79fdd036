"""The Hopper (sm_90) kernel of prefill_attention over a bfloat16/float16 cache: warp-specialized, in Gluon.

Same contract, tile map and masking as the Triton kernel in prefill_attention.py; a different structure,
FlashAttention-3's. The work items are (128-query tile of one sequence, query head), heads fastest, and a
persistent grid of one program per SM walks them, each program every grid-th item. A program runs three
partitions that share a ring of STAGES shared-memory slots, and the ring runs on across items, so the next
item's first keys load while the math warps finish one.

* A producer warp copies everything by TMA: per item, key tile 0, then the Q tile (two 64-row halves, q viewed
  [T, Hq * D]; once both consumers have released the previous one), then the other key tiles. A key tile is its
  BLOCK_N // page pages of K, then of V, each page one copy through its block-table entry ([page, D] boxes of
  the cache viewed [num_blocks * page, Hkv * D]). K and V complete separate barriers, so S = Q K^T starts
  before V has landed. It waits for a slot's `empty` barrier before refilling it.
* Two consumer warp groups, query rows 0-63 and 64-127, each: S = Q K^T by wgmma (both operands in shared
  memory), the online softmax in base 2 in registers, O += P V by wgmma with P from registers; then both
  arrive on the slot's `empty` barrier. Inside a warp group, FlashAttention-3's overlap: S(j) and
  O += P(j-1) V(j-1) are issued together, so tile j's softmax runs while P V is on the tensor cores (this
  needs three ring slots: with two, the producer is one tile ahead and the overlap ran slower than none).
  The two warp groups run independently, so one's softmax also overlaps the other's tensor-core work.
  setmaxnreg moves registers from the producer (40) to them (232).

Keys past a sequence's end inside its last tile are copied with the rest of their page (TMA cannot mask rows),
and pages past the end as physical block 0. Their scores are masked to -inf, so their P is 0, but 0 * NaN is
NaN: a stale slot holding NaN or inf (a freed block that a broken request wrote) would poison P V. So on a
sequence's last, partial tile each consumer zeroes V's rows past the end in shared memory before P V. K needs
nothing (the mask replaces its scores).

Against the Triton kernel and SDPA (same process, H100, docs/benchmarks/attention.md, thirteenth session), causal,
16k tokens per call, d = 128, bfloat16: at 4k 546 TFLOP/s against 378 (Triton kernel), 611 (cuDNN) and 300 (flash);
at 1k 321 against 259, 478 and 272; at 512 no gain (195 against 194) with one program per item, where a
program's start and end dominated. The persistent grid then took 512 tokens from 195 to 270 and 1k from 320 to
394, mixed lengths U[100, 2000] 18 % up, and 4k–8k within 3 % either way.
At head_dim 64 (4 ring slots) the persistent kernel beat the Triton kernel at every length, 5 % at 256 tokens to
15 % at 4k; one program per item had been slower up to 4k.
prefill_attention takes it for every call ws_ok accepts (attention_configs.PREFILL_WS), and for long int8-cache
prefills on a 16-bit float copy of their blocks (kv_dequant.py). Gluon has no CPU interpreter: on the CPU, on other
GPUs, for short int8-cache prefills and for shapes ws_ok rejects, the Triton kernel runs. A CPU test compiles this
kernel for sm_90; GPU tests hold it to FlashAttention's accuracy rule.
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import attention_configs
from .launch import FastLauncher, is_sm90, sm_count

HALF_ROWS = 64  # query rows per consumer warp group (one wgmma row block)
TILE_M = 2 * HALF_ROWS  # query rows per program
BM_HALF = gl.constexpr(HALF_ROWS)
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
ZERO_ROWS = gl.constexpr(16)  # rows per step when a consumer zeroes V's tail
_GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
# A persistent grid of PROGRAMS_PER_SM programs per SM (one fits: 224 KB of shared memory) walks the work items,
# (query tile, head) with the heads fastest; None: one program per work item.
PROGRAMS_PER_SM = 1


@gluon.jit
def _tile(tile, tile_seq_ptr, tile_idx_ptr, cu_ptr, seq_lens_ptr, num_seqs, BN: gl.constexpr):
    """Query tile `tile` of the tile map (prefill_attention._tile_map): (sequence, first packed query row, query
    rows left, sequence length, position of the first query, key tiles to visit; 0 for a tile past the map)."""
    seq = gl.load(tile_seq_ptr + tile)
    live = seq < num_seqs
    seq = gl.minimum(seq, num_seqs - 1)
    m_tile = gl.load(tile_idx_ptr + tile)
    q_start = gl.load(cu_ptr + seq).to(gl.int32)
    n_q = gl.load(cu_ptr + seq + 1).to(gl.int32) - q_start
    seq_len = gl.load(seq_lens_ptr + seq).to(gl.int32)
    first_pos = seq_len - n_q + m_tile * 2 * BM_HALF
    last_pos = gl.minimum(first_pos + 2 * BM_HALF, seq_len)
    n_tiles = gl.where(live, gl.cdiv(last_pos, BN), 0)
    return seq, q_start + m_tile * 2 * BM_HALF, n_q - m_tile * 2 * BM_HALF, seq_len, first_pos, n_tiles


@gluon.jit
def _load_kv_tile(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, bt_row, pidx, j, c, seq_len, kvh,
                  STAGES: gl.constexpr):
    """Key tile j of a sequence, the c-th of this program, into ring slot c % STAGES: its pages of K, then of V."""
    BN: gl.constexpr = k_bufs.shape[1]
    D: gl.constexpr = k_bufs.shape[2]
    PAGE: gl.constexpr = k_desc.block_type.shape[0]
    NP: gl.constexpr = BN // PAGE
    slot = c % STAGES
    mbarrier.wait(kv_empty.index(slot), ((c // STAGES) & 1) ^ 1)
    pages = gl.load(bt_row + j * NP + pidx, mask=(j * BN + pidx * PAGE) < seq_len, other=0).to(gl.int32)
    mbarrier.expect(k_ready.index(slot), NP * k_desc.block_type.nbytes)
    for p in gl.static_range(NP):
        page = gl.sum(gl.where(pidx == p, pages, 0), axis=0)
        tma.async_copy_global_to_shared(k_desc, [page * PAGE, kvh * D], k_ready.index(slot),
                                        k_bufs.index(slot).slice(p * PAGE, PAGE))
    mbarrier.expect(v_ready.index(slot), NP * v_desc.block_type.nbytes)
    for p in gl.static_range(NP):
        page = gl.sum(gl.where(pidx == p, pages, 0), axis=0)
        tma.async_copy_global_to_shared(v_desc, [page * PAGE, kvh * D], v_ready.index(slot),
                                        v_bufs.index(slot).slice(p * PAGE, PAGE))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready, kv_empty,
              block_tables_ptr, tile_seq_ptr, tile_idx_ptr, cu_ptr, seq_lens_ptr, num_seqs, n_items, stride_bt,
              HQ: gl.constexpr, QPK: gl.constexpr, STAGES: gl.constexpr):
    """Walks this program's work items. For each: key tile 0, then (once the consumers are done with the last
    Q) the Q tile, then the other key tiles, each as soon as its ring slot is free."""
    BN: gl.constexpr = k_bufs.shape[1]
    D: gl.constexpr = k_bufs.shape[2]
    PAGE: gl.constexpr = k_desc.block_type.shape[0]
    NP: gl.constexpr = BN // PAGE
    pl: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    pidx = gl.arange(0, NP, layout=pl)
    c = 0  # key tiles issued by this program: the ring position
    t = 0  # Q tiles loaded by this program
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        h = w % HQ
        seq, row0, n_rows, seq_len, first_pos, n_tiles = _tile(w // HQ, tile_seq_ptr, tile_idx_ptr, cu_ptr,
                                                               seq_lens_ptr, num_seqs, BN)
        if n_tiles > 0:
            kvh = h // QPK
            bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
            _load_kv_tile(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, bt_row, pidx, 0, c, seq_len,
                          kvh, STAGES)
            mbarrier.wait(q_empty, (t & 1) ^ 1)
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row0, h * D], q_bar, q_bufs.index(0))
            tma.async_copy_global_to_shared(q_desc, [row0 + BM_HALF, h * D], q_bar, q_bufs.index(1))
            for j in range(1, n_tiles):
                _load_kv_tile(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, bt_row, pidx, j, c + j,
                              seq_len, kvh, STAGES)
            c += n_tiles
            t += 1


@gluon.jit
def _zero_tail(v_buf, valid):
    """Zero rows valid.. of a [BN, D] shared-memory V tile, 16-row chunks read, masked and written back. Both
    consumers do it to the same slot and each fences and syncs its own warps before its wgmma. They write the
    same bytes, so the order does not matter; the live rows of the boundary chunk are rewritten with their own
    values, possibly while the other warp group's wgmma reads them (the same bytes either way)."""
    BN: gl.constexpr = v_buf.shape[0]
    D: gl.constexpr = v_buf.shape[1]
    zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for c in gl.static_range(BN // ZERO_ROWS):
        if (c + 1) * ZERO_ROWS > valid:
            chunk = v_buf.slice(c * ZERO_ROWS, ZERO_ROWS)
            rows = c * ZERO_ROWS + gl.arange(0, ZERO_ROWS, layout=gl.SliceLayout(1, zl))
            x = chunk.load(zl)
            chunk.store(gl.where(gl.expand_dims(rows < valid, 1), x, gl.zeros([ZERO_ROWS, D], x.dtype, zl)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _scores_to_p(s, j, m_i, l_i, unmasked, q_pos, keys, seq_len, qk_scale, BN: gl.constexpr):
    """One key tile's online-softmax step in base 2: (P, new running max, new running sum, rescale factor)."""
    s = s * qk_scale
    if j >= unmasked:
        n = j * BN + keys
        s = gl.where((n <= q_pos) & (n < seq_len), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready, kv_empty, out_ptr, h, row0, n_rows, seq_len,
            first_pos, n_tiles, c, t, qk_scale, stride_ot, stride_oh, HALF: gl.constexpr, STAGES: gl.constexpr,
            S_L: gl.constexpr, O_L: gl.constexpr):
    """One work item for one warp group's 64 query rows (its key tiles are this program's c-th onwards, its Q
    the t-th). FlashAttention-3's overlap inside a warp group: S(j) = Q K_j^T and O += P(j-1) V(j-1) are issued
    together, and tile j's softmax runs while P V is on the tensor cores."""
    BN: gl.constexpr = k_bufs.shape[1]
    D: gl.constexpr = k_bufs.shape[2]
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    rows = HALF * BM_HALF + gl.arange(0, BM_HALF, layout=gl.SliceLayout(1, S_L))
    q_pos = gl.expand_dims(first_pos + rows, 1)
    keys = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, S_L)), 0)
    m_i = gl.full([BM_HALF], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BM_HALF], gl.float32, gl.SliceLayout(1, S_L))
    o = gl.zeros([BM_HALF, D], gl.float32, O_L)
    # key tiles wholly at or below this half's first row (at most the last key: past a chunk's end the rows
    # are not stored, but stale keys there must still be masked)
    unmasked = (gl.minimum(first_pos + HALF * BM_HALF, seq_len - 1) + 1) // BN
    mbarrier.wait(q_bar, t & 1)
    slot = c % STAGES
    mbarrier.wait(k_ready.index(slot), (c // STAGES) & 1)
    s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), gl.zeros([BM_HALF, BN], gl.float32, S_L),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, m_i, l_i, alpha = _scores_to_p(s, 0, m_i, l_i, unmasked, q_pos, keys, seq_len, qk_scale, BN)
    pa = gl.convert_layout(p.to(k_bufs.dtype), P_L)
    for j in range(1, n_tiles):
        slot = (c + j) % STAGES
        prev = (c + j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), ((c + j) // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), gl.zeros([BM_HALF, BN], gl.float32, S_L),
                          use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((c + j - 1) // STAGES) & 1)
        o = warpgroup_mma(pa, v_bufs.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p, m_i, l_i, alpha = _scores_to_p(s, j, m_i, l_i, unmasked, q_pos, keys, seq_len, qk_scale, BN)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        mbarrier.arrive(kv_empty.index(prev))
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        pa = gl.convert_layout(p.to(k_bufs.dtype), P_L)
    mbarrier.arrive(q_empty)  # every S = Q K^T of this item is done: the producer may load the next Q
    last = n_tiles - 1
    slot = (c + last) % STAGES
    mbarrier.wait(v_ready.index(slot), ((c + last) // STAGES) & 1)
    if (last + 1) * BN > seq_len:
        _zero_tail(v_bufs.index(slot), seq_len - last * BN)
    o = warpgroup_mma(pa, v_bufs.index(slot), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    mbarrier.arrive(kv_empty.index(slot))
    o = o / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, O_L)), 1)
    orow = HALF * BM_HALF + gl.arange(0, BM_HALF, layout=gl.SliceLayout(1, O_L))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    ptrs = out_ptr + gl.expand_dims((row0 + orow).to(gl.int64) * stride_ot + h * stride_oh, 1) + \
        gl.expand_dims(cols, 0)
    ok = gl.expand_dims(orow < n_rows, 1) & gl.expand_dims(cols < D, 0)
    gl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _consumer(q_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready, kv_empty, out_ptr, tile_seq_ptr,
              tile_idx_ptr, cu_ptr, seq_lens_ptr, num_seqs, n_items, qk_scale, stride_ot, stride_oh,
              HALF: gl.constexpr, HQ: gl.constexpr, STAGES: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):
    """Walks the same work items as the producer, in the same order."""
    BN: gl.constexpr = k_bufs.shape[1]
    c = 0
    t = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        seq, row0, n_rows, seq_len, first_pos, n_tiles = _tile(w // HQ, tile_seq_ptr, tile_idx_ptr, cu_ptr,
                                                               seq_lens_ptr, num_seqs, BN)
        if n_tiles > 0:
            _attend(q_bufs.index(HALF), k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready, kv_empty, out_ptr,
                    w % HQ, row0, n_rows, seq_len, first_pos, n_tiles, c, t, qk_scale, stride_ot, stride_oh, HALF,
                    STAGES, S_L, O_L)
            c += n_tiles
            t += 1


# (see prefill_attention._prefill_kernel: mixed steps pass views at any offset)
@gluon.jit(do_not_specialize=["num_seqs", "n_items", "stride_bt"],
           do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "cu_ptr"])
def _prefill_ws_kernel(q_desc, k_desc, v_desc, out_ptr, block_tables_ptr, tile_seq_ptr, tile_idx_ptr, cu_ptr,
                       seq_lens_ptr, qk_scale, num_seqs, n_items, stride_ot, stride_oh, stride_bt,
                       HQ: gl.constexpr, QPK: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                       S_L: gl.constexpr, O_L: gl.constexpr, KV_LAYOUT: gl.constexpr):
    D: gl.constexpr = q_desc.block_type.shape[1]
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BM_HALF, D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], KV_LAYOUT)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], KV_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)  # both consumers
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)  # both consumers
    gl.warp_specialize([
        (_consumer, (q_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready, kv_empty, out_ptr, tile_seq_ptr,
                     tile_idx_ptr, cu_ptr, seq_lens_ptr, num_seqs, n_items, qk_scale, stride_ot, stride_oh, 0, HQ,
                     STAGES, S_L, O_L)),
        (_consumer, (q_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready, kv_empty, out_ptr, tile_seq_ptr,
                     tile_idx_ptr, cu_ptr, seq_lens_ptr, num_seqs, n_items, qk_scale, stride_ot, stride_oh, 1, HQ,
                     STAGES, S_L, O_L)),
        (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready, kv_empty,
                     block_tables_ptr, tile_seq_ptr, tile_idx_ptr, cu_ptr, seq_lens_ptr, num_seqs, n_items,
                     stride_bt, HQ, QPK, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


_launch_kernel = FastLauncher(_prefill_ws_kernel)


def ws_ok(q, k_cache, v_cache):
    """For compiled CUDA tensors that prefill_attention has checked: a float cache of q's dtype, contiguous with
    16-byte aligned bases (TMA's rules), and what shape_ok asks."""
    return (k_cache.dtype == q.dtype and shape_ok(q, k_cache.shape)
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (k_cache, v_cache)))


def shape_ok(q, cache_shape):
    """sm_90, a bfloat16/float16 q (contiguous, 16-byte aligned), a head_dim in attention_configs.PREFILL_WS, and
    power-of-two pages of 8 keys or more that tile BLOCK_N, for a float cache of cache_shape."""
    if not attention_configs.PREFILL_WS_ENABLED or not is_sm90(q.device):
        return False
    nb, page, hkv, d = cache_shape
    cfg = attention_configs.PREFILL_WS.get(d)
    return (cfg is not None and q.dtype in _GL and page >= 8 and page & (page - 1) == 0
            and cfg["BLOCK_N"] % page == 0 and nb * page < 2**31 and q.is_contiguous() and q.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=None)
def _layouts(bn, d, dtype):
    """(Q tile, K/V tile) shared layouts and the (S, O) wgmma accumulator layouts of one consumer warp group."""
    dt = _GL[dtype]
    s_l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, bn, 16])
    o_l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, d, 16])
    return (gl.NVMMASharedLayout.get_default_for([HALF_ROWS, d], dt), gl.NVMMASharedLayout.get_default_for([bn, d], dt),
            s_l, o_l)


def _descriptor(t2, block, layout):
    return TensorDescriptor(t2, list(t2.shape), list(t2.stride()), list(block), layout)


def launch_ws(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, qk_scale, out, tile_map):
    """Launch over the tile map of TILE_M-query tiles (prefill_attention._tile_map); out: contiguous like q."""
    t, hq, d = q.shape
    nb, page, hkv, _ = k_cache.shape
    cfg = attention_configs.PREFILL_WS[d]
    bn = cfg["BLOCK_N"]
    q_layout, kv_layout, s_l, o_l = _layouts(bn, d, q.dtype)
    bound, tile_seq, tile_idx = tile_map
    n_items = hq * bound
    grid = min(n_items, sm_count(q.device) * PROGRAMS_PER_SM) if PROGRAMS_PER_SM else n_items
    _launch_kernel((grid,), dict(
        q_desc=_descriptor(q.view(t, hq * d), (HALF_ROWS, d), q_layout),
        k_desc=_descriptor(k_cache.view(nb * page, hkv * d), (page, d), kv_layout),
        v_desc=_descriptor(v_cache.view(nb * page, hkv * d), (page, d), kv_layout),
        out_ptr=out, block_tables_ptr=block_tables, tile_seq_ptr=tile_seq, tile_idx_ptr=tile_idx,
        cu_ptr=cu_seqlens_q, seq_lens_ptr=seq_lens, qk_scale=qk_scale, num_seqs=block_tables.shape[0],
        n_items=n_items, stride_ot=out.stride(0), stride_oh=out.stride(1), stride_bt=block_tables.stride(0),
        HQ=hq, QPK=hq // hkv, BN=bn, STAGES=cfg["STAGES"], S_L=s_l, O_L=o_l, KV_LAYOUT=kv_layout,
    ), num_warps=4)
    return out
