"""FlashDecoding: paged, GQA-aware, split-K decode attention over the int8 (or float) KV cache.

Triton twin of reference.decode_attention: one query per sequence, q [B, Hq, D] at position
seq_lens[b] - 1, so it sees keys 0 .. seq_lens[b] - 1.

Stage 1, grid (Hkv, B, num_splits), one program per (kv head, sequence, context split):
  * The Q tile is the whole group of Hq / Hkv query heads sharing the kv head, padded to
    >= 16 rows so tl.dot can use the tensor cores; each K/V tile is therefore read from
    memory ONCE for the group (decode is bound by KV bytes, not arithmetic).
  * Split s covers keys [s * L, min((s + 1) * L, seq_len)) with L = seq_len / num_splits
    rounded up to BLOCK_N: computed in the kernel from seq_lens, so the launch grid depends on
    shapes only (CUDA-graph capturable) and short sequences still spread over all splits.
  * K/V tiles of BLOCK_N keys are gathered through the block table (a tile may span several
    pages); online softmax in base 2 (log2(e) folded into the scale). int8 tiles go into the
    dot converted exactly to q.dtype (every int8 value is exact in fp16/bf16) and the group scales are applied around it (below). The int8 V
    cache is key-minor (reference.py): for P·V each thread needs consecutive keys, which a
    token-major int8 tile could only give one byte per shared-memory load.
  * With one split the program writes the output directly; otherwise it writes its
    normalized partial output (fp32) and log2-sum-exp for stage 2.
Stage 2, grid (B, Hq), merges the splits: o = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max)
(attention_configs.REDUCE_CHUNKS: 4, 16 or 128 splits per step, the smallest that holds the count, on 1, 1 or 4
warps, with a running max: the count itself is not compiled in).
An empty split (seq_len shorter than its start) writes lse = -inf and contributes nothing.
(The Gluon kernel of decode_attention_hopper.py runs the same merge inside itself, in its last split to finish;
there an empty split writes nothing, and the merge reads only the splits with keys.)

num_splits (a run-time argument, so no recompile per value) comes from the shapes (batch x kv heads vs. the
multiprocessor count, and block_tables.shape[1] * page size) and the kernel that runs (this one, or from
DECODE_WS_MIN_PROGRAMS pairs on the Gluon kernel of decode_attention_hopper.py): see
attention_configs.decode_num_splits.
The kv head is the fastest grid axis, so programs reading neighbouring heads of one token
(whose scales share a 32-byte sector) run together.
"""

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from . import attention_configs, checks
from .attention_configs import REDUCE_CHUNK, REDUCE_CHUNKS, decode_config, decode_num_splits
from .launch import FastLauncher, sm_count
from .scratch import zeroed_scratch
from .prefill_attention import LOG2E, check_attention_inputs, compiled, float_dot, i8_to, per_step


@triton.jit
def page_index(n_start, offs_n, PAGE_SIZE: tl.constexpr):
    """(n_start + offs_n) // PAGE_SIZE for a tile start n_start that is a multiple of the tile
    length (both powers of two, so one divides the other): a scalar part plus a loop constant,
    instead of a signed division per key (2-3% faster decode on an H100;
    the same change made the bf16 prefill 2% slower, so prefill keeps n // PAGE_SIZE)."""
    return n_start // PAGE_SIZE + offs_n // PAGE_SIZE


@triton.jit
def page_offset(n_start, offs_n, PAGE_SIZE: tl.constexpr):
    """(n_start + offs_n) % PAGE_SIZE, on the same terms as page_index."""
    return n_start % PAGE_SIZE + offs_n % PAGE_SIZE


@triton.jit(do_not_specialize=["num_splits", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])  # see _prefill_kernel
def _decode_kernel(
    # pointers
    q_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
    # scalars
    qk_scale, num_splits,
    # strides (elements)
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cp, stride_ch, stride_vb, stride_vh, stride_sb, stride_sp, stride_sh, stride_bt,
    # sizes and modes
    QPK: tl.constexpr, QPK_PAD: tl.constexpr, HQ: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, QUANT: tl.constexpr, COMPILED: tl.constexpr,
):
    kvh = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    # int8 cache: the Q tile is "group-expanded": row (r, g) holds query head r's group g of
    # head_dim (the other groups zeroed), NG = D / G rows per head. One dot with the raw int8
    # K tile (converted exactly to q.dtype) then gives every per-group partial score
    # q_{r,g} . k_{t,g}; the group scales are applied to those [ROWS, BLOCK_N] partials (D/G
    # multiplies per key instead of D) and summed over g. For V, row (r, g) of P is p * s_v[:, g]
    # and the [ROWS, D] accumulator row (r, g) is only read at its own group's columns at the
    # end. With 4 query heads per kv head and 4 groups that is 16 rows: the padding the
    # tensor-core dot needed anyway. A float cache is the special case NG = 1, no scales.
    NG: tl.constexpr = HEAD_DIM // GROUP if QUANT else 1
    ROWS: tl.constexpr = QPK_PAD * NG
    ri = tl.arange(0, ROWS)
    r_of = ri // NG
    heads_x = kvh * QPK + r_of
    cols = tl.arange(0, HEAD_DIM)
    q_mask = (r_of < QPK)[:, None]
    if QUANT:
        q_mask = q_mask & ((cols[None, :] // GROUP) == (ri % NG)[:, None])
    q = tl.load(q_ptr + b * stride_qb + heads_x[:, None] * stride_qh + cols[None, :], mask=q_mask, other=0.0)
    gi = tl.arange(0, NG)

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + b * stride_bt
    kv_head_off = kvh.to(tl.int64) * stride_ch
    v_head_off = kvh.to(tl.int64) * stride_vh
    scale_head_off = kvh.to(tl.int64) * stride_sh
    RUN: tl.constexpr = min(PAGE_SIZE, BLOCK_N, 16)  # keys contiguous and aligned in int8 V (tiles start at multiples of BLOCK_N)
    m_i = tl.full([QPK_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QPK_PAD], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    # the block-table entries of the next tile are loaded one iteration ahead, so each
    # iteration waits for one memory round trip (K/V), not two (table, then K/V)
    n = start + offs_n
    blk = tl.load(bt_row + page_index(start, offs_n, PAGE_SIZE), mask=n < end, other=0)
    for n_start in range(start, end, BLOCK_N):
        n = n_start + offs_n
        in_range = n < end
        blk64 = blk.to(tl.int64)
        blk = tl.load(bt_row + page_index(n_start + BLOCK_N, offs_n, PAGE_SIZE), mask=n + BLOCK_N < end, other=0)
        page_off = page_offset(n_start, offs_n, PAGE_SIZE)
        slot_off = blk64 * stride_cb + page_off * stride_cp + kv_head_off
        k_raw = tl.load(k_cache_ptr + slot_off[:, None] + cols[None, :], mask=in_range[:, None], other=0)
        if QUANT:
            # int8 V is key-minor ([blocks, Hkv, D, PAGE]): load [D, BLOCK_N] with a page's keys
            # adjacent (the hints let it be vector copies) and unmasked (a per-key mask would stop
            # them; keys past the end read valid memory, hold no NaN, and have scale 0 and p 0)
            v_off = tl.max_contiguous(tl.multiple_of(blk64 * stride_vb + page_off, RUN), RUN)
            v_raw = tl.trans(tl.load(v_cache_ptr + v_head_off + v_off[None, :] + cols[:, None] * PAGE_SIZE))
        else:
            v_raw = tl.load(v_cache_ptr + slot_off[:, None] + cols[None, :], mask=in_range[:, None], other=0)
        if QUANT:
            scale_off = blk64 * stride_sb + page_off * stride_sp + scale_head_off
            s_ptrs = scale_off[None, :] + gi[:, None]  # [NG, BLOCK_N]
            sk = tl.load(k_scale_ptr + s_ptrs, mask=in_range[None, :], other=0.0).to(tl.float32) * qk_scale
            sv = tl.load(v_scale_ptr + s_ptrs, mask=in_range[None, :], other=0.0).to(tl.float32)
            part = float_dot(q, tl.trans(i8_to(k_raw, q.dtype, COMPILED)), None)  # [ROWS, BLOCK_N]
            qk = tl.sum(tl.reshape(part, (QPK_PAD, NG, BLOCK_N)) * sk[None, :, :], 1)
        else:
            qk = float_dot(q, tl.trans(k_raw.to(q.dtype)), None) * qk_scale
        qk = tl.where(in_range[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if QUANT:
            p_x = tl.reshape(p[:, None, :] * sv[None, :, :], (ROWS, BLOCK_N))
            alpha_x = tl.reshape(tl.broadcast_to(alpha[:, None], (QPK_PAD, NG)), (ROWS,))
            acc = acc * alpha_x[:, None]
            acc = float_dot(p_x.to(q.dtype), i8_to(v_raw, q.dtype, COMPILED), acc)
        else:
            acc = acc * alpha[:, None]
            acc = float_dot(p.to(q.dtype), v_raw.to(q.dtype), acc)

    if QUANT:  # row (r, g) of acc is valid at group g's columns only
        own = (ri % NG)[:, None] == (cols[None, :] // GROUP)
        acc = tl.sum(tl.reshape(tl.where(own, acc, 0.0), (QPK_PAD, NG, HEAD_DIM)), 1)
    rows = tl.arange(0, QPK_PAD)
    heads = kvh * QPK + rows
    row_ok = rows < QPK
    if not SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (a padded batch slot) -> zeros
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + cols[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        nonempty = l_i > 0
        o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        # partials laid out [B, HQ, num_splits, HEAD_DIM] and [B, HQ, num_splits]
        row_base = (b * HQ + heads) * num_splits + split
        tl.store(part_out_ptr + row_base[:, None] * HEAD_DIM + cols[None, :], o, mask=row_ok[:, None])
        tl.store(part_lse_ptr + row_base, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_ob, stride_oh,
    HQ: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
):
    """Merge the splits CHUNK at a time with a running max, so one compiled kernel serves every split
    count; CHUNK takes one of a few sizes (REDUCE_CHUNKS), all compiled at the first split call (_reduce)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, HEAD_DIM)
    base = (b * HQ + h) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    wsum = tl.zeros([], tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        live = s < num_splits
        # both loads go out together (an empty split stored o = 0, so its weight 0 needs no mask)
        lse = tl.load(part_lse_ptr + base + s, mask=live, other=float("-inf"))
        o = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + cols[None, :], mask=live[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # every split so far empty (seq_len 0)
        w = tl.math.exp2(lse - m_ref)
        rescale = tl.math.exp2(m - m_ref)
        acc = acc * rescale + tl.sum(o * w[:, None], 0)
        wsum = wsum * rescale + tl.sum(w, 0)
        m = m_new
    res = acc / tl.where(wsum > 0, wsum, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + cols, res.to(out_ptr.dtype.element_ty))


_launch_decode = FastLauncher(_decode_kernel)
_launch_reduce = FastLauncher(_decode_reduce_kernel)


def num_splits_for(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens):
    """The split count decode_attention will use for these inputs."""
    quant, group = check_attention_inputs(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                                          "decode_attention")
    ws = quant and _ws_ok(q, k_cache, v_cache, k_scale, v_scale, block_tables, group)
    return _split_count(q, k_cache, block_tables, ws)


def _split_count(q, k_cache, block_tables, ws):
    """From shapes only (graph-safe), for the kernel that runs (ws: the Gluon one): see decode_num_splits."""
    pps = attention_configs.DECODE_WS_PROGRAMS_PER_SM if ws else None
    return decode_num_splits(q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1],
                             sm_count(q.device), pps)


def decode_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, softmax_scale):
    """One query per sequence: q [B, Hq, D] at position seq_lens[b] - 1. Returns a new [B, Hq, D].

    Graph-safe: nothing here reads tensor values on the host; the split count comes from shapes.
    A sequence with seq_len 0 (a padded batch slot) gets zeros.
    """
    return decode_attention_splits(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                                   softmax_scale, None)


def decode_attention_splits(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, softmax_scale,
                            num_splits=None):
    """decode_attention with the split count forced (None = the shape-based choice); for tests and benchmarks."""
    quant, group = check_attention_inputs(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                                          "decode_attention")
    checks.decode_batch(q, block_tables)
    checks.softmax_scale(softmax_scale, "decode_attention")
    bsz, hq, d = q.shape
    out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    ws = quant and _ws_ok(q, k_cache, v_cache, k_scale, v_scale, block_tables, group)
    splits = int(num_splits) if num_splits else _split_count(q, k_cache, block_tables, ws)
    if splits > 1:
        part_out = torch.empty((bsz, hq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz, hq, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    if ws:
        from .decode_attention_hopper import launch_ws

        fused = 1 < splits <= attention_configs.DECODE_WS_MERGE_IN_KERNEL_MAX_SPLITS
        counters = _merge_counters(q.device, bsz * k_cache.shape[2]) if fused else None
        order, settled = _work_order(seq_lens, block_tables)
        launch_ws(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, float(softmax_scale) * LOG2E, out,
                  part_out, part_lse, splits, group, order, counters, early=settled)
        return out if fused else _reduce(part_out, part_lse, out, splits)
    hkv = k_cache.shape[2]
    qpk = hq // hkv
    cfg = decode_config(d, k_cache.dtype)
    bn = cfg.pop("BLOCK_N")
    ks = k_scale if quant else k_cache
    vs = v_scale if quant else v_cache
    # rows of the (group-expanded, for int8) Q tile: QPK_PAD * (D / G) >= 16 for tl.dot
    ng = d // group if quant else 1
    qpk_pad = max(triton.next_power_of_2(qpk), triton.cdiv(16, ng))
    _launch_decode((hkv, bsz, splits), dict(
        q_ptr=q, out_ptr=out, part_out_ptr=part_out, part_lse_ptr=part_lse, k_cache_ptr=k_cache, v_cache_ptr=v_cache,
        k_scale_ptr=ks, v_scale_ptr=vs, block_tables_ptr=block_tables, seq_lens_ptr=seq_lens,
        qk_scale=float(softmax_scale) * LOG2E, num_splits=splits,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_ob=out.stride(0), stride_oh=out.stride(1),
        stride_cb=k_cache.stride(0), stride_cp=k_cache.stride(1), stride_ch=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vh=v_cache.stride(1 if quant else 2), stride_sb=ks.stride(0), stride_sp=ks.stride(1), stride_sh=ks.stride(2), stride_bt=block_tables.stride(0),
        QPK=qpk, QPK_PAD=qpk_pad, HQ=hq, HEAD_DIM=d, GROUP=group,
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=bn, SPLIT=splits > 1, QUANT=quant, COMPILED=compiled(),
    ), **cfg)
    return _reduce(part_out, part_lse, out, splits)


_last_order = [None]  # the memo of _work_order (prefill_attention.per_step)
_last_tables = [None]  # the block tables of the latest call (the same memo, holding nothing)
_counters = {}  # device -> the merge counters of the Gluon kernel (kernels/scratch.py)


def _work_order(seq_lens, block_tables):
    """The order in which the Gluon kernel takes the sequences (int32 indices on the device, no host sync):
    longest first (attention_configs.DECODE_LONGEST_FIRST), so the grid starts the longest work items first.
    Built once per step (per_step). Results never depend on it: a stale order is still a permutation of the
    batch, and every work item is computed alone. (Its lengths beside it would save the kernel one dependent
    load, 0.1-0.5 us a call (attention.md, sixteenth session), but a stale copy of them would be wrong results.)

    Returns (order, settled). settled: the previous call, on the same stream, took these same seq_lens and
    block_tables, unchanged (per_step's contract), and the order was built then. Then that call's kernel ran after
    everything that wrote them, and the Gluon kernel may read them, and the order, before its PDL wait
    (decode_attention_hopper.EARLY_INDICES): a kernel after it on the stream starts only once it has waited
    (pdl.py). At a step's first layer the order's own kernel runs just before, so that call waits first. Under
    CUDA-graph capture the flag is taken in capture order and kept by the graph; a replay runs the same kernels in
    the same order, after the copies that refresh its buffers, which complete before its first kernel starts."""
    longest_first = attention_configs.DECODE_LONGEST_FIRST
    misses = []  # per_step calls its build function only on a miss

    def build_order():
        misses.append(seq_lens)
        return _order(seq_lens, longest_first)

    order = per_step(_last_order, seq_lens, (longest_first,), build_order)
    per_step(_last_tables, block_tables, (_stream_of(block_tables),), lambda: misses.append(block_tables))
    return order, not misses


def _stream_of(t):
    """The stream a CUDA tensor's kernels are launched on now (None on the CPU): only stream order makes the
    previous call's kernel run before this one. Triton's lookup, the one its launches use: 0.2 us a call on the
    H200 machine against 7 us for torch.cuda.current_stream, which builds a Stream object (attention.md,
    forty-sixth session)."""
    return driver.active.get_current_stream(t.get_device()) if t.is_cuda else None


def _order(seq_lens, longest_first):
    if longest_first:
        return torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    return torch.arange(seq_lens.shape[0], dtype=torch.int32, device=seq_lens.device)


def _merge_counters(device, n):
    """Zeroed int32 counters, one per (sequence, kv head), for the Gluon kernel's merge of its splits; each launch
    leaves them zero (kernels/scratch.py). 65,536 at least: a decode graph never has to grow them."""
    return zeroed_scratch(_counters, device, n, 1 << 16, "decode_attention: the split merge counters")


_merge_warmed = set()  # (device, dtype, Hq, D) whose every merge chunk has been launched once


def _reduce(part_out, part_lse, out, splits):
    """Stage 2: merge the splits' partials into out (nothing to do for one split). The chunk fits the split
    count (attention_configs.REDUCE_CHUNKS). The first split call of a shape launches every chunk, each
    computing the same out, so that a later call with another split count (an eager mixed step's narrower
    block table, a new batch size) compiles nothing mid-run."""
    if splits > 1:
        bsz, hq, d = out.shape
        chunks = [merge_chunk(splits)]
        key = (out.device, out.dtype, hq, d)
        if key not in _merge_warmed and not (out.is_cuda and torch.cuda.is_current_stream_capturing()):
            _merge_warmed.add(key)
            chunks = sorted({merge_chunk(c) for c in REDUCE_CHUNKS} - set(chunks)) + chunks
        for chunk in chunks:
            _launch_reduce((bsz, hq), dict(
                part_out_ptr=part_out, part_lse_ptr=part_lse, out_ptr=out, num_splits=splits,
                stride_ob=out.stride(0), stride_oh=out.stride(1),
                HQ=hq, HEAD_DIM=d, CHUNK=chunk,
            ), **REDUCE_CHUNKS.get(chunk, REDUCE_CHUNKS[attention_configs.REDUCE_CHUNK]))
    return out


def merge_chunk(splits):
    """Splits the merge kernel takes per step: the smallest of REDUCE_CHUNKS (ascending) that holds them, at most
    REDUCE_CHUNK (more splits loop)."""
    return min(REDUCE_CHUNK, next((c for c in REDUCE_CHUNKS if c >= splits), REDUCE_CHUNK))


def _ws_ok(q, k_cache, v_cache, k_scale, v_scale, block_tables, group):
    """Whether the warp-specialized Hopper kernel (decode_attention_hopper.py) takes this call: compiled CUDA
    tensors, enough (sequence, kv head) pairs (attention_configs.DECODE_WS_MIN_PROGRAMS), and what ws_ok asks."""
    if not q.is_cuda or not compiled() or q.shape[0] * k_cache.shape[2] < attention_configs.DECODE_WS_MIN_PROGRAMS:
        return False
    from .decode_attention_hopper import ws_ok

    return ws_ok(q, k_cache, v_cache, k_scale, v_scale, block_tables, group)
