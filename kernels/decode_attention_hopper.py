"""The Hopper (sm_90) kernel of decode_attention over an int8 cache: warp-specialized, written in Gluon.

Same contract and the same key range per split as the Triton kernel in decode_attention.py (with more
splits than attention_configs.DECODE_WS_MERGE_IN_KERNEL_MAX_SPLITS the partials go to the same merge kernel), a
different structure. The work items are the Triton kernel's programs — (kv head,
sequence, context split) — and each program walks every grid-th of them (_grid_size: one item per program up to two
rounds of the resident programs, else a persistent grid of those, its odd rounds walked in reverse, _snake_item):

* a producer warp walks the items' keys in tiles of CONSUMERS pages and fills a ring of STAGES
  shared-memory slots: each page's K ([page, D], token-major) and V ([D, page], key-minor) by TMA, one
  copy each, and the tile's K and V group scales by cp.async (8 bytes per key: too narrow for TMA).
  A V page of one head is D * page contiguous bytes; it is copied as a box of 128-byte rows (16 rows at
  D = 128) rather than as D rows of 16 bytes, into the same bytes of its unswizzled buffer. With the narrow
  box (probably a copy-engine request per 16-byte row) the kernel read 58-86 % of the copy bandwidth at
  batch >= 16, with the wide one 64-97 % (H100, attention.md, fourteenth session).
  It waits on the slot's `empty` barrier; the copies complete its `ready` barrier. The ring runs on
  across items, so the next item's pages load while the math warps finish one. A tile's page numbers
  (block-table entries) are loaded one tile ahead, so a freed slot's copies start without a global load
  in between: 2-4 points more of the copy bandwidth on an H200, 0-2 on an H100 (attention.md, eleventh
  session; there more ring slots gained nothing, while on an H200 three beat two: STAGES below);
* a partition of CONSUMERS (4) warps does the math; every tensor there has a leading "warp" axis and warp w
  takes page w of each tile with its own online softmax, so nothing crosses warps until the end. Each warp
  waits for a slot and gives it back by itself (the slot's `empty` barrier counts the four warps), so a warp
  that finishes its page early goes on to the next slot (WARP_RELEASE). Each warp runs the Triton kernel's
  math on mma.sync tensor cores: the group-expanded Q tile (row (r, g) = query head r's group g), the page's K converted
  exactly from int8 to float16, per-group partial scores scaled and summed, P scaled by the V group
  scales, V converted the same way;
* at the end of an item the warps' (max, sum, output) are merged and the output written, or the split's
  normalized partial and log-sum-exp. With several splits the kernel merges them itself: each split's program
  counts its arrival on a counter per (sequence, kv head), and the last to arrive reads the partials back
  from L2 and writes the output (the split-K scheme of int8_gemm), up to
  attention_configs.DECODE_WS_MERGE_IN_KERNEL_MAX_SPLITS splits (64). The split count comes from the
  longest possible context, so at short contexts most splits are empty: they store nothing, only count, and
  the merge reads just the splits with keys. That saves the merge kernel's launch and its own load round trip:
  1.0-1.7 us a call at batch 2-16 (H100, attention.md, sixteenth session), 0.9-2.2 us at batch 1 (nineteenth).

Work items are taken kv head fastest, then sequences longest first (decode_attention._work_order), then
splits: a greedy longest-first schedule, since the hardware starts programs in order as SMs free up. A persistent
grid walks its rounds alternately forwards and backwards, so the program that got a round's longest item gets the
next round's shortest.

On sm_90 the kernel is launched with programmatic dependent launch (kernels/pdl.py): its programs may be
scheduled and set up (barriers, descriptors) while kv_write, which allows it, still runs; both partitions wait
for it before any read whose value matters. In the chain (pdl.CHAIN) the producer first pulls its program's
first tile of pages into L2 (_prefetch_first_tiles: hints only, from indices that may be stale), so the first
copies after the wait come from L2. Where the work order, lengths and block tables were complete before the kernel
just before us started (every layer of a step after the first), and each program has one work item (no persistent
grid), both partitions load their first work item's indices before the wait instead (EARLY_INDICES), the producer
prefetches from them, and its first copies start as soon as the wait returns. Once a program's producer has
issued its last copy it allows the kernel after us (quant_per_token, which waits for our output) to be scheduled.

Against the Triton kernel (same process, H100, docs/benchmarks/attention.md, ninth and eleventh sessions) it
reads as much of the copy bandwidth or more at every batch and context, with its own split count (one round
of work items for its two resident programs per SM): up to 10 points more at uniform contexts, more with the
engine's mixed lengths. So decode_attention takes it for every call it can run
(attention_configs.DECODE_WS_MIN_PROGRAMS).
Gluon has no CPU interpreter: on the CPU, on other GPUs and for shapes ws_ok rejects, the Triton kernel runs.
A CPU test compiles this kernel for sm_90; GPU tests hold it to FlashAttention's accuracy rule and to the Triton kernel.
"""

import functools
import re
import warnings

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from eightbit.kernels.attention_configs import DECODE_WS_PROGRAMS_PER_SM
from eightbit.kernels.launch import FastLauncher, is_sm90, sm_count
from eightbit.kernels.pdl import chain_enabled, pdl_enabled
from eightbit.kernels.prefill_attention import I8_TO_F16_PTX

CONSUMERS = gl.constexpr(4)
PREFETCH_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [2, 16], [1, 1], [1, 0]))  # [page, row or line], one warp
PRODUCER_REGS = gl.constexpr(40)
# mma.sync m16n8k16 with one warp per index of the leading axis (each warp owns one page of a tile)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))


@gluon.jit
def _i8_to_f16(x):
    """int8 -> float16, exact: four values in five instructions (prefill_attention.I8_TO_F16_PTX)."""
    return gl.inline_asm_elementwise(asm=I8_TO_F16_PTX, constraints="=r,=r,r", args=[x], dtype=gl.float16,
                                     is_pure=True, pack=4)


@gluon.jit
def _wait_slot(ready, ready_off, slot, phase, WARP_RELEASE: gl.constexpr):
    """Wait for the slot's copies (ready[slot] completing the given phase). With WARP_RELEASE each thread waits by
    itself, on the barrier addressed by its shared-memory offset in inline PTX, because Gluon's wait comes with a
    barrier across the partition's warps (module docstring)."""
    if not WARP_RELEASE:
        mbarrier.wait(ready.index(slot), phase)
        return
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred done;\n\t.reg .b32 bar;\n\tmov.u32 bar, global_smem;\n\tadd.u32 bar, bar, $1;\n"
        "\twait_slot:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [bar], $2;\n\t@!done bra.uni wait_slot;\n"
        "\tmov.u32 $0, 0;\n\t}",
        "=r,r,r", [ready_off + slot * 8, phase], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release_slot(empty, empty_off, slot, WARP_RELEASE: gl.constexpr):
    """Give the slot back to the producer. With WARP_RELEASE each warp does so once all its lanes are done
    (bar.warp.sync also orders their shared-memory reads before lane 0's arrival, a release): lane 0 arrives on
    empty[slot], which counts CONSUMERS arrivals. Without it, every warp has read the slot before one arrival."""
    if not WARP_RELEASE:
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot))
        return
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred lead;\n\t.reg .b32 bar, lane;\n\tbar.warp.sync -1;\n\tmov.u32 lane, %laneid;\n"
        "\tsetp.eq.u32 lead, lane, 0;\n\tmov.u32 bar, global_smem;\n\tadd.u32 bar, bar, $1;\n"
        "\t@lead mbarrier.arrive.shared::cta.b64 _, [bar];\n\tmov.u32 $0, 0;\n\t}",
        "=r,r", [empty_off + slot * 8], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_for_previous_kernel(PDL: gl.constexpr):
    """Launched with PDL (kernels/pdl.py): block until the kernel before us has completed and its writes are
    visible (the primitive pdl.wait_for_previous_kernel uses). Both partitions call it before any read whose
    value matters: the kernel just before us may be kv_write (q, the cache) or, at a step's first layer, the one
    that wrote the work order (decode_attention._work_order). Before it come only the producer's prefetch hints
    and, with EARLY_INDICES, the first work item's indices, whose writes completed before that kernel started."""
    if PDL:
        gdc_wait()


@gluon.jit
def _prefetch_l2_if(ptrs, live):
    """prefetch.global.L2 of the 128-byte line of each pointer whose live flag is set (Gluon's twin of
    pdl.prefetch_l2, with a predicate): a hint, so it is correct whatever the line holds."""
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r", [ptrs, live.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_first_tiles(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, order_ptr, batch,
                          num_splits, num_blocks, bt_width, stride_sb, stride_sp, stride_sh, stride_bt,
                          HKV: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr, TILES: gl.constexpr):
    """Before the PDL wait, in the producer warp: pull the K and V pages (and their scales) of this program's first
    TILES tiles into L2, so that its first copies after the wait find them there. The kernel before us may still
    be writing the work order, and the cache at the newest keys, so everything read here is a hint: loaded
    around L1 (.cg, so the loads after the wait cannot hit a stale line) and clamped into its tensor, so every
    address stays valid; the copies after the wait read the real values, from L2 where the kernel before us
    wrote them (L2 is where every SM's writes meet)."""
    TILE: gl.constexpr = CONSUMERS * PAGE
    item = gl.program_id(0)
    kvh = item % HKV
    b = gl.load(order_ptr + (item // HKV) % batch, cache_modifier=".cg")
    b = gl.minimum(gl.maximum(b, 0), batch - 1).to(gl.int64)
    seq_len = gl.load(seq_lens_ptr + b, cache_modifier=".cg").to(gl.int32)
    seq_len = gl.minimum(gl.maximum(seq_len, 0), bt_width * PAGE)
    start, end, _ = _split_range(seq_len, item // (HKV * batch), num_splits, TILE)
    pages = gl.arange(0, CONSUMERS, layout=gl.SliceLayout(1, PREFETCH_LAYOUT))
    for t in gl.static_range(TILES):
        col = (start + t * TILE) // PAGE + pages  # < bt_width, since seq_len is clamped
        live = col * PAGE < end  # pages past the end get nothing, else every empty split would hit page 0's lines
        page = gl.load(block_tables_ptr + b * stride_bt + col, mask=live, other=0, cache_modifier=".cg")
        _prefetch_pages(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, page, live, kvh, num_blocks, stride_sb, stride_sp,
                        stride_sh, HKV, PAGE, D)


@gluon.jit
def _prefetch_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, p0, p1, p2, p3, start, end, kvh, num_blocks, stride_sb,
                   stride_sp, stride_sh, HKV: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr):
    """_prefetch_pages of the tile at start whose page numbers p0..p3 are already loaded (_tile_pages)."""
    pages = gl.arange(0, CONSUMERS, layout=gl.SliceLayout(1, PREFETCH_LAYOUT))
    page = gl.where(pages == 0, p0, gl.where(pages == 1, p1, gl.where(pages == 2, p2, p3)))
    _prefetch_pages(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, page, start + pages * PAGE < end, kvh, num_blocks,
                    stride_sb, stride_sp, stride_sh, HKV, PAGE, D)


@gluon.jit
def _prefetch_pages(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, page, live, kvh, num_blocks, stride_sb, stride_sp,
                    stride_sh, HKV: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr):
    """prefetch.global.L2 of the K and V lines and scales of this kv head in the pages `page` ([CONSUMERS],
    clamped into the cache) whose live flag is set."""
    VL: gl.constexpr = D * PAGE // 128  # a V page is D * PAGE contiguous bytes
    rows = gl.expand_dims(gl.arange(0, PAGE, layout=gl.SliceLayout(0, PREFETCH_LAYOUT)), 0)
    lines = gl.expand_dims(gl.arange(0, VL, layout=gl.SliceLayout(0, PREFETCH_LAYOUT)), 0)
    page = gl.expand_dims(gl.minimum(gl.maximum(page, 0), num_blocks - 1).to(gl.int64), 1)
    page_live = gl.expand_dims(live, 1)
    row_live = gl.broadcast(page_live, rows)[0]
    # a K row (one key of this head) is D bytes: its first and last byte cover its one or two lines
    k_row = k_ptr + (page * PAGE + rows) * (HKV * D) + kvh * D
    _prefetch_l2_if(k_row, row_live)
    _prefetch_l2_if(k_row + (D - 1), row_live)
    _prefetch_l2_if(v_ptr + (page * HKV + kvh) * (D * PAGE) + lines * 128, gl.broadcast(page_live, lines)[0])
    # the scales: NG values per key; neighbouring keys share lines, which the memory system merges
    s_off = page * stride_sb + rows * stride_sp + kvh * stride_sh
    _prefetch_l2_if(k_scale_ptr + s_off, row_live)
    _prefetch_l2_if(v_scale_ptr + s_off, row_live)


@gluon.jit
def _snake_item(pos, total, grid):
    """The work item at a program's position pos = program id + r * grid (r: its round) of the items 0..total-1:
    rounds of grid items, odd rounds in reverse (a round's n items go to programs n - 1, ..., 0). With the items
    sorted longest first, a program that got a long item in one round gets a short one in the next."""
    r = pos // grid
    n = gl.minimum(grid, total - r * grid)
    return gl.where(r % 2 == 1, r * grid + n - 1 - (pos - r * grid), pos)


@gluon.jit
def _split_range(seq_len, split, num_splits, TILE: gl.constexpr):
    """[start, end) of a split's keys (the Triton kernel's split rule, splits rounded to whole tiles), and how
    many of the sequence's splits have keys: the split count comes from the longest possible context, so at
    short contexts most splits are empty."""
    per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), TILE) * TILE
    start = split * per_split
    return start, gl.minimum(start + per_split, seq_len), gl.cdiv(seq_len, gl.maximum(per_split, 1))


@gluon.jit
def _work_item(item, order_ptr, seq_lens_ptr, batch, num_splits, HKV: gl.constexpr, TILE: gl.constexpr,
               CACHE: gl.constexpr):
    """Work item -> (kv head, sequence, split, first key, end key, splits with keys): kv head fastest, sequences
    longest first (order_ptr: the batch's indices by descending length), split by _split_range. CACHE: the loads'
    cache modifier (".cg" before the PDL wait: from L2, where every SM's writes meet)."""
    kvh = item % HKV
    b = gl.load(order_ptr + (item // HKV) % batch, cache_modifier=CACHE).to(gl.int64)
    split = item // (HKV * batch)
    seq_len = gl.load(seq_lens_ptr + b, cache_modifier=CACHE).to(gl.int32)
    start, end, live_splits = _split_range(seq_len, split, num_splits, TILE)
    return kvh, b, split, start, end, live_splits


@gluon.jit
def _producer(k_desc, v_desc, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, order_ptr,
              k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty, batch, num_splits, num_blocks, bt_width, stride_sb,
              stride_sp, stride_sh, stride_bt, HKV: gl.constexpr, NG: gl.constexpr, STAGES: gl.constexpr,
              PDL: gl.constexpr, TRIGGER: gl.constexpr, PREFETCH_TILES: gl.constexpr,
              EARLY_INDICES: gl.constexpr):
    PAGE: gl.constexpr = k_desc.block_type.shape[1]
    D: gl.constexpr = k_desc.block_type.shape[2]
    TILE: gl.constexpr = CONSUMERS * PAGE
    # the tile's scales [CONSUMERS, PAGE, NG]: a thread copies one key's NG scales (8 bytes for NG = 4)
    sl: gl.constexpr = gl.BlockedLayout([1, 1, NG], [2, 16, 1], [1, 1, 1], [2, 1, 0])
    keys_2d = gl.expand_dims(gl.arange(0, CONSUMERS, layout=gl.SliceLayout(1, gl.SliceLayout(2, sl))) * PAGE, 1) + \
        gl.expand_dims(gl.arange(0, PAGE, layout=gl.SliceLayout(0, gl.SliceLayout(2, sl))), 0)
    keys_3d = gl.expand_dims(keys_2d, 2)
    groups = gl.expand_dims(gl.expand_dims(gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(1, sl))), 0), 1)
    nbytes: gl.constexpr = CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    page_of_key = keys_3d // PAGE  # which of the tile's pages a scale thread copies from
    # the L2 prefetch before the wait: in the chain only (EIGHTBIT_PDL_CHAIN=0: the old launches); an early start
    # prefetches its first tile (the one PREFETCH_TILES asks for) from its own indices below
    PREFETCH: gl.constexpr = PDL and TRIGGER and PREFETCH_TILES > 0
    if PREFETCH and not EARLY_INDICES:
        _prefetch_first_tiles(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, order_ptr,
                              batch, num_splits, num_blocks, bt_width, stride_sb, stride_sp, stride_sh, stride_bt,
                              HKV, PAGE, D, PREFETCH_TILES)
    if EARLY_INDICES:  # one item a program (launch_ws): its keys and page numbers before the wait, copies right after
        kvh, b, split, start, end, _ = _work_item(gl.program_id(0), order_ptr, seq_lens_ptr, batch, num_splits, HKV,
                                                  TILE, ".cg")
        bt_row = block_tables_ptr + b * stride_bt
        p0, p1, p2, p3 = _tile_pages(bt_row, start, end, PAGE, ".cg")
        if PREFETCH:  # its first tile's lines into L2 while we wait
            _prefetch_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, p0, p1, p2, p3, start, end, kvh, num_blocks,
                           stride_sb, stride_sp, stride_sh, HKV, PAGE, D)
        _wait_for_previous_kernel(PDL)
        _produce_item(k_desc, v_desc, k_scale_ptr, v_scale_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty,
                      gl.to_tensor(0), kvh, bt_row, start, end, p0, p1, p2, p3, keys_3d, groups, page_of_key,
                      stride_sb, stride_sp, stride_sh, HKV, NG, STAGES, D, PAGE, nbytes)
    else:
        _wait_for_previous_kernel(PDL)
        it = 0  # tiles so far, over all of this program's work items (the ring runs on across items)
        total = HKV * batch * num_splits
        for pos in range(gl.program_id(0), total, gl.num_programs(0)):
            item = _snake_item(pos, total, gl.num_programs(0))
            kvh, b, split, start, end, _ = _work_item(item, order_ptr, seq_lens_ptr, batch, num_splits, HKV, TILE, "")
            bt_row = block_tables_ptr + b * stride_bt
            # the tile's page numbers are loaded one tile ahead: their latency (a global load) stays off the
            # path from a freed slot to its copies
            p0, p1, p2, p3 = _tile_pages(bt_row, start, end, PAGE, "")
            it = _produce_item(k_desc, v_desc, k_scale_ptr, v_scale_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, ready,
                               empty, it, kvh, bt_row, start, end, p0, p1, p2, p3, keys_3d, groups, page_of_key,
                               stride_sb, stride_sp, stride_sh, HKV, NG, STAGES, D, PAGE, nbytes)
    if TRIGGER:  # every copy is issued: the kernel after us (which waits for our output) may be scheduled
        gdc_launch_dependents()


@gluon.jit
def _produce_item(k_desc, v_desc, k_scale_ptr, v_scale_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty, it, kvh,
                  bt_row, start, end, p0, p1, p2, p3, keys_3d, groups, page_of_key, stride_sb, stride_sp, stride_sh,
                  HKV: gl.constexpr, NG: gl.constexpr, STAGES: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                  nbytes: gl.constexpr):
    """One work item's tiles into the ring from position it on (p0..p3: its first tile's page numbers); returns
    the ring position after them."""
    TILE: gl.constexpr = CONSUMERS * PAGE
    for tile_start in range(start, end, TILE):
        n0, n1, n2, n3 = _tile_pages(bt_row, tile_start + TILE, end, PAGE, "")
        slot = it % STAGES
        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        keys = tile_start + keys_3d
        s_live = keys < end
        blk = gl.where(page_of_key == 0, p0, gl.where(page_of_key == 1, p1, gl.where(page_of_key == 2, p2, p3)))
        s_off = gl.multiple_of(blk.to(gl.int64) * stride_sb + (keys % PAGE) * stride_sp + kvh * stride_sh,
                               [1, 1, NG]) + groups
        s_ptrs = gl.max_contiguous(gl.multiple_of(s_off, [1, 1, NG]), [1, 1, NG])  # strides are multiples of NG
        async_copy.async_copy_global_to_shared(ks_bufs.index(slot), k_scale_ptr + s_ptrs, mask=s_live)
        async_copy.async_copy_global_to_shared(vs_bufs.index(slot), v_scale_ptr + s_ptrs, mask=s_live)
        async_copy.mbarrier_arrive(bar)  # keys past the end get scale 0 (masked copies write zeros)
        mbarrier.expect(bar, nbytes)
        _copy_page(k_desc, v_desc, k_bufs, v_bufs, slot, bar, p0, 0, kvh, HKV, D)
        _copy_page(k_desc, v_desc, k_bufs, v_bufs, slot, bar, p1, 1, kvh, HKV, D)
        _copy_page(k_desc, v_desc, k_bufs, v_bufs, slot, bar, p2, 2, kvh, HKV, D)
        _copy_page(k_desc, v_desc, k_bufs, v_bufs, slot, bar, p3, 3, kvh, HKV, D)
        p0, p1, p2, p3 = n0, n1, n2, n3
        it += 1
    return it


@gluon.jit
def _tile_pages(bt_row, tile_start, end, PAGE: gl.constexpr, CACHE: gl.constexpr):
    """The block-table entries of a tile's CONSUMERS (4) pages; 0 for pages past the end (copied, unused).
    CACHE: as in _work_item."""
    gl.static_assert(CONSUMERS == 4)
    first = tile_start // PAGE
    return (gl.load(bt_row + first, mask=tile_start < end, other=0, cache_modifier=CACHE),
            gl.load(bt_row + first + 1, mask=tile_start + PAGE < end, other=0, cache_modifier=CACHE),
            gl.load(bt_row + first + 2, mask=tile_start + 2 * PAGE < end, other=0, cache_modifier=CACHE),
            gl.load(bt_row + first + 3, mask=tile_start + 3 * PAGE < end, other=0, cache_modifier=CACHE))


@gluon.jit
def _copy_page(k_desc, v_desc, k_bufs, v_bufs, slot, bar, page, p: gl.constexpr, kvh, HKV: gl.constexpr,
               D: gl.constexpr):
    """One page's K and V of this kv head by TMA into consumer p's part of the slot."""
    tma.async_copy_global_to_shared(k_desc, [page, 0, kvh * D], bar, k_bufs.index(slot).slice(p, 1))
    # V: the page's D x page bytes as rows of 128 bytes, into the same bytes of the buffer (module docstring)
    vbox: gl.constexpr = v_desc.block_type.shape
    tma.async_copy_global_to_shared(v_desc, [page * HKV + kvh, 0, 0], bar,
                                    v_bufs.index(slot).slice(p, 1)._reinterpret(gl.int8, vbox, v_desc.layout))


@gluon.jit
def _consumer(q_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty, ready_off, empty_off, out_ptr, part_out_ptr,
              part_lse_ptr, count_ptr, seq_lens_ptr, order_ptr, qk_scale, batch, num_splits, stride_qb, stride_qh,
              stride_ob, stride_oh, QPK: gl.constexpr, QPK_PAD: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
              NG: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, MERGE: gl.constexpr, KW: gl.constexpr,
              PDL: gl.constexpr, WARP_RELEASE: gl.constexpr, EARLY_INDICES: gl.constexpr):
    """CONSUMERS warps walking the same work items as the producer; every tensor's leading axis is the warp
    (warp w owns page w of each tile), so everything but the merge at the end of an item stays in one warp."""
    TILE: gl.constexpr = CONSUMERS * k_bufs.shape[2]
    if EARLY_INDICES:  # one item a program (launch_ws): its indices before the wait; only q, which kv_write writes,
        # must come after it
        kvh, b, split, start, end, live_splits = _work_item(gl.program_id(0), order_ptr, seq_lens_ptr, batch,
                                                            num_splits, HKV, TILE, ".cg")
        _wait_for_previous_kernel(PDL)
        _consume_item(q_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty, ready_off, empty_off, out_ptr,
                      part_out_ptr, part_lse_ptr, count_ptr, qk_scale, kvh, b, split, start, end, live_splits,
                      gl.to_tensor(0), num_splits, stride_qb, stride_qh, stride_ob, stride_oh, QPK, QPK_PAD, HQ, HKV,
                      NG, STAGES, SPLIT, MERGE, KW, WARP_RELEASE)
    else:
        _wait_for_previous_kernel(PDL)
        it = 0
        total = HKV * batch * num_splits
        for pos in range(gl.program_id(0), total, gl.num_programs(0)):
            item = _snake_item(pos, total, gl.num_programs(0))
            kvh, b, split, start, end, live_splits = _work_item(item, order_ptr, seq_lens_ptr, batch, num_splits,
                                                                HKV, TILE, "")
            it = _consume_item(q_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty, ready_off, empty_off, out_ptr,
                               part_out_ptr, part_lse_ptr, count_ptr, qk_scale, kvh, b, split, start, end,
                               live_splits, it, num_splits, stride_qb, stride_qh, stride_ob, stride_oh, QPK, QPK_PAD,
                               HQ, HKV, NG, STAGES, SPLIT, MERGE, KW, WARP_RELEASE)


@gluon.jit
def _consume_item(q_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty, ready_off, empty_off, out_ptr, part_out_ptr,
                  part_lse_ptr, count_ptr, qk_scale, kvh, b, split, start, end, live_splits, it, num_splits, stride_qb,
                  stride_qh, stride_ob, stride_oh, QPK: gl.constexpr, QPK_PAD: gl.constexpr, HQ: gl.constexpr,
                  HKV: gl.constexpr, NG: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, MERGE: gl.constexpr,
                  KW: gl.constexpr, WARP_RELEASE: gl.constexpr):
    """One work item's keys, tiles it, it + 1, ... of the ring; returns the ring position after them."""
    PAGE: gl.constexpr = k_bufs.shape[2]
    D: gl.constexpr = k_bufs.shape[3]
    GROUP: gl.constexpr = D // NG
    ROWS: gl.constexpr = QPK_PAD * NG
    W: gl.constexpr = CONSUMERS
    TILE: gl.constexpr = W * PAGE
    # the group-expanded Q tile as the QK dot's A operand (one copy per warp), float16 divided by a
    # power of two above |q| (exact, in range), which qk_scale takes back
    qa: gl.constexpr = gl.DotOperandLayout(0, MMA, KW)
    ri = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(0, qa)))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(0, qa)))
    ri2 = gl.expand_dims(ri, 1)
    cols2 = gl.expand_dims(cols, 0)
    q_mask = (ri2 // NG < QPK) & (cols2 // GROUP == ri2 % NG)
    q_off = gl.expand_dims((kvh * QPK + ri2 // NG) * stride_qh + cols2, 0)  # [1, ROWS, D]
    w_idx = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, qa)))
    q_off = q_off + gl.expand_dims(gl.expand_dims(w_idx * 0, 1), 2)  # [W, ROWS, D]
    q = gl.load(q_ptr + b * stride_qb + q_off, mask=gl.expand_dims(q_mask, 0), other=0.0).to(gl.float32)
    amax = gl.max(gl.max(gl.max(gl.abs(q), 2), 1), 0)
    unit = (amax.to(gl.int32, bitcast=True) & 0x7F800000).to(gl.float32, bitcast=True) * 2.0
    unit = gl.where(unit > 0, unit, 1.0)
    q = (q / unit).to(gl.float16)
    qk_scale = qk_scale * unit

    # layouts of the per-group partial scores [W, QPK_PAD, NG, PAGE] and the scores [W, QPK_PAD, PAGE]
    l4: gl.constexpr = gl.reshape(gl.zeros([W, ROWS, PAGE], gl.float32, MMA), [W, QPK_PAD, NG, PAGE]).type.layout
    qk_l: gl.constexpr = gl.SliceLayout(2, l4)
    row_l: gl.constexpr = gl.SliceLayout(2, qk_l)
    m_i = gl.full([W, QPK_PAD], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([W, QPK_PAD], gl.float32, row_l)
    acc = gl.zeros([W, ROWS, D], gl.float32, MMA)
    a4l: gl.constexpr = gl.reshape(acc, [W, QPK_PAD, NG, D]).type.layout
    page_keys = gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(1, qk_l))) * PAGE, 1) + \
        gl.expand_dims(gl.arange(0, PAGE, layout=gl.SliceLayout(0, gl.SliceLayout(1, qk_l))), 0)  # [W, PAGE]
    for tile_start in range(start, end, TILE):
        slot = it % STAGES
        _wait_slot(ready, ready_off, slot, (it // STAGES) & 1, WARP_RELEASE)
        k = k_bufs.index(slot).permute((0, 2, 1)).load(gl.DotOperandLayout(1, MMA, KW))  # [W, D, PAGE] int8
        part = mma_v2(q, _i8_to_f16(k), gl.zeros([W, ROWS, PAGE], gl.float32, MMA))
        part4 = gl.convert_layout(gl.reshape(part, [W, QPK_PAD, NG, PAGE]), l4)
        sk = ks_bufs.index(slot).permute((0, 2, 1)).load(gl.SliceLayout(1, l4))  # [W, NG, PAGE]
        sv = vs_bufs.index(slot).permute((0, 2, 1)).load(gl.SliceLayout(1, l4))
        qk = gl.sum(part4 * gl.expand_dims(sk.to(gl.float32) * qk_scale, 1), 2)  # [W, QPK_PAD, PAGE]
        live = (tile_start + page_keys) < end
        qk = gl.where(gl.expand_dims(live, 1), qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 2))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp whose keys all lie past the end
        p = gl.exp2(qk - gl.expand_dims(m_ref, 2))
        alpha = gl.exp2(m_i - m_ref)
        l_i = l_i * alpha + gl.sum(p, 2)
        m_i = m_new
        px = gl.reshape(gl.expand_dims(p, 2) * gl.expand_dims(sv.to(gl.float32), 1), [W, ROWS, PAGE])
        acc4 = gl.convert_layout(gl.reshape(acc, [W, QPK_PAD, NG, D]), a4l)
        a4 = gl.convert_layout(alpha, gl.SliceLayout(2, gl.SliceLayout(3, a4l)))
        acc = gl.convert_layout(gl.reshape(acc4 * gl.expand_dims(gl.expand_dims(a4, 2), 3), [W, ROWS, D]), MMA)
        v = v_bufs.index(slot).permute((0, 2, 1)).load(gl.DotOperandLayout(1, MMA, KW))  # [W, PAGE, D]
        pa = gl.convert_layout(px.to(gl.float16), gl.DotOperandLayout(0, MMA, KW))
        acc = mma_v2(pa, _i8_to_f16(v), acc)
        _release_slot(empty, empty_off, slot, WARP_RELEASE)
        it += 1

    # row (r, g) of acc is valid at group g's columns only
    acc4 = gl.convert_layout(gl.reshape(acc, [W, QPK_PAD, NG, D]), a4l)
    g_idx = gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, a4l))))
    c_idx = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, a4l))))
    g4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(g_idx, 0), 1), 3)
    c4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(c_idx // GROUP, 0), 1), 2)
    o = gl.sum(gl.where(g4 == c4, acc4, 0.0), 2)  # [W, QPK_PAD, D]
    _merge_store(o, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, count_ptr, kvh, b, split, num_splits,
                 live_splits, stride_ob, stride_oh, QPK, QPK_PAD, HQ, HKV, D, SPLIT, MERGE)
    return it


@gluon.jit
def _merge_store(o, m, l, out_ptr, part_out_ptr, part_lse_ptr, count_ptr, kvh, b, split, num_splits, live_splits,
                 stride_ob, stride_oh, QPK: gl.constexpr, QPK_PAD: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
                 D: gl.constexpr, SPLIT: gl.constexpr, MERGE: gl.constexpr):
    """Merge the warps' softmax states (o [W, QPK_PAD, D] unnormalized, m and l [W, QPK_PAD]) and write the
    output, or the split's normalized partial and log-sum-exp; with MERGE the last split of the (sequence,
    kv head) to arrive merges the live_splits splits that have keys into the output (_merge_splits; the empty
    ones store nothing and only count their arrival), else the merge kernel merges them all."""
    ol: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 4, 1], [2, 1, 0])
    o = gl.convert_layout(o, ol)
    m = gl.convert_layout(m, gl.SliceLayout(2, ol))
    l = gl.convert_layout(l, gl.SliceLayout(2, ol))
    m_all = gl.max(m, 0)
    m_ref = gl.where(m_all == float("-inf"), 0.0, m_all)
    w = gl.exp2(m - gl.expand_dims(m_ref, 0))  # a warp without keys (m = -inf) weighs 0
    l_sum = gl.sum(l * w, 0)
    acc = gl.sum(o * gl.expand_dims(w, 2), 0)  # [QPK_PAD, D]
    row_l: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    l_sum = gl.convert_layout(l_sum, row_l)
    nonempty = l_sum > 0
    l_safe = gl.where(nonempty, l_sum, 1.0)
    res = acc / gl.expand_dims(l_safe, 1)
    rows = gl.arange(0, QPK_PAD, layout=row_l)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc.type.layout))
    heads = kvh * QPK + rows
    row_ok = gl.expand_dims(rows < QPK, 1)
    if not SPLIT:
        gl.store(out_ptr + b * stride_ob + gl.expand_dims(heads * stride_oh, 1) + gl.expand_dims(cols, 0),
                 res.to(out_ptr.dtype.element_ty), mask=row_ok)
    else:
        row_base = (b * HQ + heads) * num_splits + split
        out_mask = row_ok
        lse_mask = rows < QPK
        if MERGE:  # a split without keys stores nothing: our merge skips it (the merge kernel reads every split)
            has_keys = split < live_splits
            out_mask = out_mask & has_keys
            lse_mask = lse_mask & has_keys
        gl.store(part_out_ptr + gl.expand_dims(row_base * D, 1) + gl.expand_dims(cols, 0), res, mask=out_mask)
        lse = gl.where(nonempty, gl.convert_layout(m_all, row_l) + gl.log2(l_safe), float("-inf"))
        gl.store(part_lse_ptr + row_base, lse, mask=lse_mask)
        if MERGE:
            # the split-K counter scheme of int8_gemm: every warp's partial is stored before the counter moves
            # (barrier, then a release); the last to arrive acquires them all, merges, and resets the counter
            gl.thread_barrier()
            counter = count_ptr + b * HKV + kvh
            arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, kvh, b, num_splits, live_splits, stride_ob,
                              stride_oh, QPK, QPK_PAD, HQ, D)
                gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, kvh, b, num_splits, live_splits, stride_ob, stride_oh,
                  QPK: gl.constexpr, QPK_PAD: gl.constexpr, HQ: gl.constexpr, D: gl.constexpr):
    """out for the QPK query heads of (sequence b, kv head kvh) from the partials (normalized output and
    log2-sum-exp, read from L2) of its first live_splits splits, the ones with keys (none: zeros), MERGE_CHUNK
    splits at a time with a running max: the merge kernel's math (decode_attention._decode_reduce_kernel) for
    one group of heads."""
    CH: gl.constexpr = MERGE_CHUNK
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 4, 1], [2, 1, 0])  # [split, head, D]
    sl2: gl.constexpr = gl.SliceLayout(2, l3)  # [split, head]
    hl: gl.constexpr = gl.SliceLayout(0, sl2)  # [head]
    al: gl.constexpr = gl.SliceLayout(0, l3)  # [head, D]
    rows = gl.arange(0, QPK_PAD, layout=hl)
    row_ok = rows < QPK
    head_base = (b * HQ + kvh * QPK + rows) * num_splits  # [head]: first split's row of each head
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    cols3 = gl.expand_dims(gl.expand_dims(cols, 0), 1)
    m = gl.full([QPK_PAD], float("-inf"), gl.float32, hl)
    wsum = gl.zeros([QPK_PAD], gl.float32, hl)
    acc = gl.zeros([QPK_PAD, D], gl.float32, al)
    for s0 in range(0, live_splits, CH):
        s = s0 + gl.arange(0, CH, layout=gl.SliceLayout(1, sl2))
        idx = gl.expand_dims(s, 1) + gl.expand_dims(head_base, 0)  # [split, head]
        live = gl.expand_dims(s < live_splits, 1) & gl.expand_dims(row_ok, 0)
        # .cg: from L2, where the other programs' partials are (this SM's L1 is not coherent with them)
        lse = gl.load(part_lse_ptr + idx, mask=live, other=float("-inf"), cache_modifier=".cg")
        o = gl.load(part_out_ptr + gl.expand_dims(idx * D, 2) + cols3, mask=gl.expand_dims(live, 2), other=0.0,
                    cache_modifier=".cg")
        m_new = gl.maximum(m, gl.max(lse, 0))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # every split so far empty (seq_len 0)
        w = gl.exp2(lse - gl.expand_dims(m_ref, 0))  # an empty split (lse -inf) weighs 0
        rescale = gl.exp2(m - m_ref)
        acc_rescale = gl.expand_dims(gl.convert_layout(rescale, gl.SliceLayout(1, al)), 1)
        acc = acc * acc_rescale + gl.sum(o * gl.expand_dims(w, 2), 0)
        wsum = wsum * rescale + gl.sum(w, 0)
        m = m_new
    res = acc / gl.expand_dims(gl.convert_layout(gl.where(wsum > 0, wsum, 1.0), gl.SliceLayout(1, al)), 1)
    heads = gl.expand_dims(kvh * QPK + gl.convert_layout(rows, gl.SliceLayout(1, al)), 1)
    out_cols = gl.expand_dims(gl.convert_layout(cols, gl.SliceLayout(0, al)), 0)
    gl.store(out_ptr + b * stride_ob + heads * stride_oh + out_cols, res.to(out_ptr.dtype.element_ty),
             mask=heads < kvh * QPK + QPK)


@gluon.jit(do_not_specialize=["ready_off", "empty_off", "batch", "num_splits", "num_blocks", "bt_width", "stride_bt"],
           # see decode_attention._decode_kernel
           do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "order_ptr"])
def _decode_ws_kernel(q_ptr, out_ptr, part_out_ptr, part_lse_ptr, count_ptr, k_desc, v_desc, k_ptr, v_ptr,
                      k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, order_ptr, ready_off, empty_off,
                      qk_scale, batch, num_splits, num_blocks, bt_width, stride_qb, stride_qh, stride_ob, stride_oh,
                      stride_sb, stride_sp, stride_sh, stride_bt, QPK: gl.constexpr, QPK_PAD: gl.constexpr,
                      HQ: gl.constexpr, HKV: gl.constexpr, NG: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                      MERGE: gl.constexpr, KW: gl.constexpr, PDL: gl.constexpr, TRIGGER: gl.constexpr,
                      PREFETCH_TILES: gl.constexpr, WARP_RELEASE: gl.constexpr,
                      EARLY_INDICES: gl.constexpr):
    PAGE: gl.constexpr = k_desc.block_type.shape[1]
    D: gl.constexpr = k_desc.block_type.shape[2]
    # [slot, consumer, ...]; a layout describes one slot
    k_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, CONSUMERS, PAGE, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, CONSUMERS, D, PAGE], v_desc.layout)  # unswizzled
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    ks_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, CONSUMERS, PAGE, NG], plain)
    vs_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, CONSUMERS, PAGE, NG], plain)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS if WARP_RELEASE else 1)
    gl.warp_specialize([
        (_consumer, (q_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty, ready_off, empty_off, out_ptr,
                     part_out_ptr, part_lse_ptr, count_ptr, seq_lens_ptr, order_ptr, qk_scale, batch, num_splits,
                     stride_qb, stride_qh, stride_ob, stride_oh, QPK, QPK_PAD, HQ, HKV, NG, STAGES, SPLIT, MERGE, KW,
                     PDL, WARP_RELEASE, EARLY_INDICES)),
        (_producer, (k_desc, v_desc, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
                     order_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty, batch, num_splits, num_blocks,
                     bt_width, stride_sb, stride_sp, stride_sh, stride_bt, HKV, NG, STAGES, PDL, TRIGGER,
                     PREFETCH_TILES, EARLY_INDICES)),
    ], [1], [PRODUCER_REGS])


_SMEM_BASE = re.compile(r"mov\.(?:b32|u32)\s+(%r\d+), global_smem;")
_SMEM_ADD = re.compile(r"add\.s32\s+(%r\d+), (%r\d+), (\d+);")
_BARRIER_INIT = re.compile(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\], (\d+);")


def ring_barrier_offsets(ptx):
    """(ready[0], empty[0]): the shared-memory offsets of the ring's barriers in a compiled kernel with
    WARP_RELEASE, read from the PTX of their initialization (ready counts 1 arrival, empty CONSUMERS; each at
    global_smem + offset, slots 8 bytes apart); None where the PTX does not show them so."""
    bases = set(_SMEM_BASE.findall(ptx))
    offset = {reg: int(off) for reg, base, off in _SMEM_ADD.findall(ptx) if base in bases}
    found = {}
    for reg, count in _BARRIER_INIT.findall(ptx):
        if reg not in offset:
            return None
        found.setdefault(int(count), []).append(offset[reg])
    ready, empty = sorted(found.get(1, [])), sorted(found.get(CONSUMERS.value, []))
    if set(found) != {1, CONSUMERS.value} or len(ready) != len(empty):
        return None
    if any(slots != list(range(slots[0], slots[0] + 8 * len(slots), 8)) for slots in (ready, empty)):
        return None
    return ready[0], empty[0]


def _bind_ring_barriers(kernel):
    """FastLauncher's bind: the offsets _wait_slot and _release_slot address in this compiled kernel. Where they
    cannot be read (another Triton's PTX, or no kernel: a compile hook declined it), the kernel with Gluon's own
    barrier waits (WARP_RELEASE off), and a warning."""
    if kernel is not None and "wait_slot:" not in kernel.asm["ptx"]:  # compiled without WARP_RELEASE
        return {}
    offsets = ring_barrier_offsets(kernel.asm["ptx"]) if kernel is not None else None
    if offsets is None:
        warnings.warn("decode_attention_hopper: the ring barriers' shared-memory offsets are not in this Triton's "
                      "PTX; the int8 decode kernel runs without WARP_RELEASE (a few points of bandwidth slower)")
        return {"WARP_RELEASE": False}
    return {"ready_off": offsets[0], "empty_off": offsets[1]}


_launch_kernel = FastLauncher(_decode_ws_kernel, bind=_bind_ring_barriers)

# Launch settings (GPU A/B in docs/benchmarks/attention.md, ninth session): slots in the ring, and the register cap at
# launch. Triton pads the producer warp to a warp group, so a program holds 8 warps' registers; at 104 per thread two
# programs share an SM and the consumers get 184 (no spills). A cap of 80 (3 programs per SM, consumers at 136)
# spilled and read 5-20 points less (H100); on an H200 80 took 1.6-2x as long at every shape and 88 (three spills)
# 15-25 % longer (attention.md, forty-sixth session): the math warps' loop is on the critical path. Slots: on an H100
# 4 instead of 2 changed nothing; on an H200 3 read more of the copy bandwidth than 2 at every shape measured, by
# 0.8-2.7 points on the means of two runs each (0.5-4 in a second session's comparison), and 4 no more than 3
# (attention.md, thirty-second and thirty-third sessions). 3 is not measured on an H100.
STAGES = 3
MAXNREG = 104
# The grid (_grid_size). RESIDENT_PER_SM programs fit on an SM at once (MAXNREG; the split rule's target,
# attention_configs.DECODE_WS_PROGRAMS_PER_SM, is the same count). Up to PERSISTENT_AFTER_ROUNDS
# rounds of those, each work item gets its own program and the hardware hands them out as SMs free up; with more
# items a persistent grid of the resident programs walks them (_snake_item), each producer running ahead into
# its next item while the math warps finish one. Against one program per item (up to 8 per SM before), same
# process, calls back to back, us (H100, attention.md, twenty-second session): 128 x 2k 209.9 -> 207.8, 256 x 2k
# 404.1 -> 403.1, engine-width tables (512) at 640 keys: batch 128 79.3 -> 75.3, 256 145.7 -> 142.8; lengths
# U[100, 2k] at batch 128 / 256 113.0 -> 110.5 / 233.0 -> 230.6; 128 x 4-6k and 256 x 3k within 0.3 %; 256 x 8k
# 1,569 -> 1,582 (more than an 8B model's cache holds on an 80 GB card). At batch 64 (1.9 rounds) it was 1.5 %
# faster at uniform lengths and 0.8 % slower at mixed ones, so it starts above two rounds. Without the reversed
# rounds it lost 4-16 % at mixed lengths.
RESIDENT_PER_SM = DECODE_WS_PROGRAMS_PER_SM
PERSISTENT_AFTER_ROUNDS = 2
# Tiles of each program's first work item pulled into L2 before the PDL wait (_prefetch_first_tiles); 0: none.
# H100, same process (attention.md, nineteenth session): behind kv_write, us per kv_write + decode +
# quant_per_token, 0 -> 1 tile: 16 x 2k 38.3 -> 36.9, 64 x 640 47.7 -> 46.5, 1 x 4k 14.9 -> 13.9; calls back to
# back 16 x 2k 33.1 -> 32.6, 256 x 2k +0.4 %. Two tiles, or the prefetch in the consumer warps: no better.
PREFETCH_TILES = 1
# Each math warp waits for a slot and gives it back on its own (_wait_slot, _release_slot: inline PTX on the
# barriers' shared-memory offsets, which the launch reads from the compiled PTX, _bind_ring_barriers). Gluon's
# wait and arrive come with a barrier across the four math warps before each (Triton 3.6), so every tile waited
# for its slowest warp twice. H200, same process, ABBA (attention.md, thirty-fourth session), % of the copy
# bandwidth: batch >= 32 and 16 x >= 8k 80-90 -> 90-103; 16 x 2k, 8 x 8k and 1 x 32k within 3 points, 4 x 2k 1
# point slower. Outputs equal bit for bit (a GPU test). Not measured on an H100.
WARP_RELEASE = True
# Where the indices are settled (decode_attention._work_order: the call before took the same seq_lens and block
# tables, so everything that wrote them, and the order, has completed before the kernel just before us started), both
# partitions load their first work item's indices, from L2, before the PDL wait; the producer prefetches that item's
# first tile from them (instead of from a second, hint-only load of the same indices) and issues its copies right
# after the wait: three dependent loads (order, length, page numbers) fewer between the wait and the first bytes.
# H200, same process, off / on / on / off (attention.md, forty-fourth session), us a call: 16 x 2k 23.54 -> 22.82,
# 4 x 2k 10.94 -> 10.06, 1 x 32k 25.02 -> 23.92, 8 x 8k 41.31 -> 40.00; shapes of two rounds or more within their
# spread. The 8B engine's decode, 2k prompts, fresh processes, three runs each (engine.md, forty-fifth session):
# +0.4 % at batch 1, +1.4 % at 4, +1.2 % at 16. With the prefetch's own index loads kept before the early ones
# (forty-fourth session's version) batch 1 read 0.5-0.7 % slower than without early indices in every run; a stack
# of 32 decode layers showed the producer's half alone slower than none and the math warps' half faster. A step's
# first layer (the order just built) waits first, as before. Not for a persistent grid, whose programs walk
# several items and gain on the first alone: at 256 x 2k the kernel with it read 1.3 % slower on the mean of four
# runs each, within that shape's spread but not taken.
EARLY_INDICES = True
KW = 4  # operand elements per thread along k: four int8 values are one 32-bit shared-memory word
MERGE_CHUNK = gl.constexpr(8)  # splits per step of the merge inside the kernel (_merge_splits)


def ws_ok(q, k_cache, v_cache, k_scale, v_scale, block_tables, group):
    """For compiled CUDA tensors over an int8 cache that decode_attention has checked: sm_90, pages of 16 keys
    (the engine's; V's TMA rows are one page of bytes, at least 16; other sizes are untested on a GPU),
    contiguous caches and float16 scales (the kernel's scale buffers are float16) with 16-byte aligned bases,
    int32 block tables (TMA coordinates are 32-bit), NG * QPK_PAD == 16 (one mma row block), and a 16-bit q (the
    kernel's dots take q as float16; a float32 q goes to the Triton kernel, which keeps it float32)."""
    if not is_sm90(q.device) or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    _, page, hkv, d = k_cache.shape
    ng = d // group
    qpk = q.shape[1] // hkv
    rows = max(triton.next_power_of_2(qpk), triton.cdiv(16, ng)) * ng
    aligned = all(t.data_ptr() % 16 == 0 for t in (q, k_cache, v_cache, k_scale, v_scale))
    return (page == 16 and d <= 256 and (d * page) % 128 == 0 and ng in (2, 4, 8) and rows == 16 and aligned
            and block_tables.dtype == torch.int32
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_scale.is_contiguous()
            and k_scale.dtype == v_scale.dtype == torch.float16)


# V pages land unswizzled: the bytes of a [1, D, page] tile are the bytes of its [1, D * page / 128, 128] box
V_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)


@functools.lru_cache(maxsize=None)
def _layout(block):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.int8)


def _descriptor(t, block):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _layout(tuple(block)))


def _grid_size(items, sms):
    """One program per work item up to PERSISTENT_AFTER_ROUNDS rounds of the resident programs, else those."""
    resident = RESIDENT_PER_SM * sms
    return items if items <= PERSISTENT_AFTER_ROUNDS * resident else resident


def launch_ws(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, qk_scale, out, part_out, part_lse,
              splits, group, order, counters=None, early=False):
    """order: the sequences' indices in work order (decode_attention._work_order).
    early: the writes of the order, seq_lens and block_tables completed before the kernel just before this one
    started (decode_attention._work_order's settled), so the kernel may read them before its PDL wait
    (EARLY_INDICES; taken only with one program per work item).
    counters: with splits > 1, a zeroed int32 buffer of >= batch x kv heads (kernels/scratch.py) for the merge
    inside the kernel; None leaves the partials in part_out / part_lse for the merge kernel."""
    nblk, page, hkv, d = k_cache.shape
    bsz, hq, _ = q.shape
    qpk = hq // hkv
    ng = d // group
    k3 = k_cache.view(nblk, page, hkv * d)
    v_rows = d * page // 128
    v3 = v_cache.view(nblk * hkv, v_rows, 128)  # a (block, kv head)'s V: D x page bytes as rows of 128
    items = hkv * bsz * splits
    grid = _grid_size(items, sm_count(q.device))
    pdl = pdl_enabled(q.device)
    _launch_kernel((grid,), dict(
        q_ptr=q, out_ptr=out, part_out_ptr=part_out, part_lse_ptr=part_lse,
        count_ptr=counters if counters is not None else part_lse, k_desc=_descriptor(k3, (1, page, d)),
        v_desc=TensorDescriptor(v3, list(v3.shape), list(v3.stride()), [1, v_rows, 128], V_LAYOUT),
        k_ptr=k_cache, v_ptr=v_cache, k_scale_ptr=k_scale, v_scale_ptr=v_scale, block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens, order_ptr=order, ready_off=0, empty_off=0,  # _bind_ring_barriers fills them in
        qk_scale=qk_scale, batch=bsz, num_splits=splits, num_blocks=nblk,
        bt_width=block_tables.shape[1],
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_ob=out.stride(0), stride_oh=out.stride(1),
        stride_sb=k_scale.stride(0), stride_sp=k_scale.stride(1), stride_sh=k_scale.stride(2),
        stride_bt=block_tables.stride(0),
        QPK=qpk, QPK_PAD=16 // ng, HQ=hq, HKV=hkv, NG=ng, STAGES=STAGES, SPLIT=splits > 1,
        MERGE=splits > 1 and counters is not None, KW=KW, PDL=pdl, TRIGGER=chain_enabled(q.device),
        PREFETCH_TILES=PREFETCH_TILES, WARP_RELEASE=WARP_RELEASE,
        EARLY_INDICES=EARLY_INDICES and early and pdl and grid == items,  # the early kernel takes one item
    ), num_warps=4, maxnreg=MAXNREG, **({"launch_pdl": True} if pdl else {}))
    return out
