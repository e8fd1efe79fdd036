"""The Hopper (sm_90) kernel of int8_gemm for large M: warp-specialized, written in Gluon.

Same contract and the same epilogue arithmetic as the Triton kernels in int8_gemm.py (exact int32
accumulation, then `acc * x_scale[m] * w_scale[n] (+ bias[n])`, cast to the output dtype), so their
outputs are equal bit for bit. It runs the table's "ws" entries (config.kernel == "ws").

Why Gluon (Triton's lower-level dialect, where layouts, shared memory, TMA copies, mbarriers and the
wgmma waits are written out): the Triton kernels stop at 50-67 % of the int8 tensor-core peak, and
Triton's pipeliner waits for each int32-accumulating wgmma before issuing the next. Keeping one wgmma
in flight was not enough by itself: a Gluon kernel with the Triton kernels' one-partition structure,
where every warp both issues the copies and does the math, was no faster (its loop has four CTA-wide
barriers per K step). Here three partitions of one CTA run side by side instead (measured 1.08-1.36x
faster than the Triton kernels at M >= 512 on an H100, docs/benchmarks/gemm.md):

* a producer warp (40 registers) walks this program's tiles and K steps and fills a ring of STAGES
  shared-memory slots by TMA: per slot two A tiles [64, BLOCK_K] (one per consumer) and one B tile
  [BLOCK_N, BLOCK_K], zero-padded past N and K. A row block that would run past M is pulled back
  to end at M instead (it then overlaps rows its neighbour also computes and stores, identically):
  a box past the last row made the GEMM 1.2-1.8x slower at M = 144-224. It waits on the slot's
  `empty` barrier, then arms its `ready` barrier with the byte count;
* two consumer warp groups (232 registers each) compute the two 64-row halves of a 128 x BLOCK_N
  tile against the shared B tile: wait `ready`, issue the wgmma asynchronously, wait until at most
  that one is in flight (so the previous step's has retired) and hand that step's slot back by
  arriving on its `empty` barrier (count 2: both consumers). The epilogue scales the accumulator
  in registers (the scales were loaded before the tile's K loop, so their latency overlaps it) and
  stores it through shared memory with a TMA store (bf16/fp16 outputs) or, for fp32 outputs (tests and
  the tuner's exactness check), straight from registers;
* a tile may be the sum of two powers of two wide (split_width: 192 = 128 + 64), since Gluon tensors
  and shared buffers are powers of two: the B tile then comes as two TMA boxes into two buffers, each
  consumer keeps two accumulators and issues two wgmmas per step, and the epilogue stores two pieces.
  The 8B qkv projection (N = 6144) at M = 1024 is 8 x 32 such tiles, 1.94 waves of 132 SMs, against
  8 x 24 tiles 256 wide (1.45 waves: two tile times) or 8 x 48 tiles 128 wide (a slower tile):
  42.5 -> 37.9 us (docs/benchmarks/gemm.md, fourteenth session);
* programs are persistent (one per SM) and walk tiles in grouped order, so the producer is already
  fetching the next tile while the consumers run their epilogue.

Where its table entry says so (GemmConfig.pdl, measured by `tune_gemm --pdl`), it is launched with programmatic
dependent launch (kernels/pdl.py): both partitions wait for the kernel before us before their first global
access (but the producer's early weight copies, below), and the producer lets the kernel after us be scheduled
once it has issued its last copy. That gains 0.6-1.9 us behind the quantization for the short GEMMs
(Llama-3.2-1B qkv and o up to M = 2048, Llama-3-8B qkv and o at M <= 128) and loses up to 25 % for the long ones
(8B gate_up at M = 8192: 1.36 -> 1.70 ms), hence the marks (docs/benchmarks/gemm.md, eighteenth session). One
access comes before the producer's wait: the weight tiles of its first tile's first ring slots
(WEIGHTS_BEFORE_WAIT), since no kernel of the chain writes weights (kernels/pdl.py says who must synchronize
otherwise); their slots are armed for the activation tiles too, which it copies after the wait. Behind the
quantization that gains another 0.3-0.7 us on the 1B qkv and o GEMMs at M = 192-512 (thirty-first session).

There is no CPU interpreter for Gluon: off sm_90 (and under TRITON_INTERPRET) int8_gemm runs the
Triton kernels instead (see int8_gemm._ws_ok and ws_ok). A CPU test compiles this kernel for sm_90;
the GPU tests compare it with the exact int32 product.
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from eightbit.kernels.launch import FastLauncher, is_sm90

ROWS_PER_CONSUMER = 64  # one wgmma row block per consumer warp group; a tile is 2 x 64 rows
SUB_M = gl.constexpr(ROWS_PER_CONSUMER)  # the same, for the kernels
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
# N sizes of the int8 wgmma instruction (m64nNk32) that Triton lowers
_INT8_INSTR_N = (224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 24, 16, 8)
# With PDL, the producer copies its first tile's weight tiles into the first ring slots before its
# griddepcontrol.wait: they arrive while the kernel before (the activations' quantization) finishes, instead of
# after it. Weights are not written by any kernel of the PDL chain (kernels/pdl.py says what a kernel may read
# before its wait). H100, quant_per_token + GEMM, same process, outputs equal bit for bit (docs/benchmarks/gemm.md,
# thirty-first session): 1B o at M = 260 / 320 / 384 / 512 7.78 / 7.75 / 8.01 / 9.43 -> 7.09 / 7.29 / 7.46 / 8.88
# us, 1B qkv at M = 192-512 0.3-0.7 us faster, both at M = 1024 0-0.2 us; the PDL-marked 8B entries within -0.6 /
# +0.35 us. False waits first (A/B runs).
WEIGHTS_BEFORE_WAIT = True
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@functools.lru_cache(maxsize=None)
def accumulator_layout(block_n):
    """A consumer's [64, BLOCK_N] int32 accumulator: one warp group, the widest instruction dividing BLOCK_N."""
    instr_n = next(n for n in _INT8_INSTR_N if block_n % n == 0)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, instr_n, 32])


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile index -> (pid_m, pid_n) in grouped order (the same walk as int8_gemm._grouped_tile)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_size = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + ((tile % per_group) % group_size), (tile % per_group) // group_size


@gluon.jit
def _rows_offset(pid_m, half, M):
    """First row of a consumer's 64-row block, pulled back so the block ends at M at the latest (when M >= 64).
    A TMA box that runs past the last row is measured to be slow (M = 192: 42 against 30 us at M = 256 for the
    same tiles); the pulled-back block overlaps its neighbour's rows, which both compute and store identically."""
    return gl.minimum(pid_m * 2 * SUB_M + half * SUB_M, gl.maximum(M - SUB_M, 0))


@gluon.jit
def _copy_b(b_desc, b1_desc, b_bufs, b1_bufs, slot, bar, off_n, off_k, BN0: gl.constexpr, TAIL: gl.constexpr):
    tma.async_copy_global_to_shared(b_desc, [off_n, off_k], bar, b_bufs.index(slot))
    if TAIL:
        tma.async_copy_global_to_shared(b1_desc, [off_n + BN0, off_k], bar, b1_bufs.index(slot))


@gluon.jit
def _producer(a_desc, b_desc, b1_desc, a0_bufs, a1_bufs, b_bufs, b1_bufs, ready, empty, M, num_pid_m, num_pid_n,
              k_tiles, GROUP_M: gl.constexpr, STAGES: gl.constexpr, TAIL: gl.constexpr, PDL: gl.constexpr,
              EARLY_B: gl.constexpr):
    BN0: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = BN0 + TAIL * b1_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes + TAIL * b1_desc.block_type.nbytes
    early = 0
    if PDL:  # launched with PDL (kernels/pdl.py): the activations are the previous kernel's output
        if EARLY_B:  # the weights are not: the first ring slots' weight tiles are copied while it finishes
            # (every program has a first tile: launch_ws starts min(tiles, SMs) programs)
            early = gl.minimum(STAGES, k_tiles)
            pid_m, pid_n = _tile_coords(gl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
            for kk in range(early):
                mbarrier.expect(ready.index(kk), nbytes)  # armed for the A tiles too, which follow the wait
                _copy_b(b_desc, b1_desc, b_bufs, b1_bufs, kk, ready.index(kk), pid_n * BLOCK_N, kk * BLOCK_K, BN0,
                        TAIL)
        gdc_wait()
    step = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m0 = _rows_offset(pid_m, 0, M)
        off_m1 = _rows_offset(pid_m, 1, M)
        for kk in range(k_tiles):
            slot = step % STAGES
            bar = ready.index(slot)
            if step >= early:  # (the first `early` slots were armed, and their weights copied, before the wait)
                # the consumers released this slot's previous use (the first pass finds it free)
                mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(bar, nbytes)
                _copy_b(b_desc, b1_desc, b_bufs, b1_bufs, slot, bar, pid_n * BLOCK_N, kk * BLOCK_K, BN0, TAIL)
            tma.async_copy_global_to_shared(a_desc, [off_m0, kk * BLOCK_K], bar, a0_bufs.index(slot))
            tma.async_copy_global_to_shared(a_desc, [off_m1, kk * BLOCK_K], bar, a1_bufs.index(slot))
            step += 1
    if PDL:  # every copy is issued: the kernel after us (which waits for our output) may be scheduled
        gdc_launch_dependents()


@gluon.jit
def _tile_scales(off_m, off_n, M, N, xs_ptr, ws_ptr, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """A tile's row and column scales, loaded before its K loop: their latency is then spent while the wgmmas
    run rather than between two tiles. (The bias stays in the epilogue: held through the loop as well, it
    made 256-wide tiles spill.)"""
    offs_m = off_m + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, LAYOUT))
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LAYOUT))
    xs = gl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
    ws = gl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
    return xs, ws


@gluon.jit
def _epilogue(acc, scales, off_m, off_n, M, N, bias_ptr, c_ptr, c_desc, c_smem, stride_cm, HAS_BIAS: gl.constexpr,
              TMA_STORE: gl.constexpr, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    xs, ws = scales
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LAYOUT))
    out = acc.to(gl.float32) * gl.expand_dims(xs, 1) * gl.expand_dims(ws, 0)
    if HAS_BIAS:
        b = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
        out = out + gl.expand_dims(b, 0)
    if TMA_STORE:  # rows and columns past the edge are dropped by the copy engine (the caller has waited
        # for the previous tile's store to read c_smem)
        c_smem.store(out.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    else:
        offs_m = off_m + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, LAYOUT))
        mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
        ptrs = c_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_cm, 1) + gl.expand_dims(offs_n, 0)
        gl.store(ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _consumer(a_bufs, b_bufs, b1_bufs, ready, empty, c_desc, c1_desc, xs_ptr, ws_ptr, bias_ptr, c_ptr, M, N,
              stride_cm, num_pid_m, num_pid_n, k_tiles, HALF: gl.constexpr, HAS_BIAS: gl.constexpr,
              TMA_STORE: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, LAYOUT: gl.constexpr,
              TAIL: gl.constexpr, LAYOUT1: gl.constexpr, PDL: gl.constexpr):
    """One 64-row half of each tile: [64, BN0] against b_bufs and, with a TAIL, [64, BN1] against b1_bufs
    (a tile BN0 + BN1 wide, e.g. 128 + 64: a wgmma tile must be a power of two wide)."""
    BN0: gl.constexpr = b_bufs.shape[1]
    BN1: gl.constexpr = b1_bufs.shape[1]
    if TMA_STORE:
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        if TAIL:
            c1_smem = gl.allocate_shared_memory(c1_desc.dtype, c1_desc.block_type.shape, c1_desc.layout)
        else:
            c1_smem = c_smem  # unused
    else:
        c_smem = a_bufs  # unused
        c1_smem = a_bufs
    if PDL:  # the row scales are the previous kernel's output, and it may still read what we overwrite
        gdc_wait()
    step = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = _rows_offset(pid_m, HALF, M)
        off_n = pid_n * (BN0 + TAIL * BN1)
        scales = _tile_scales(off_m, off_n, M, N, xs_ptr, ws_ptr, BN0, LAYOUT)
        acc = gl.zeros([SUB_M, BN0], gl.int32, LAYOUT)
        if TAIL:
            scales1 = _tile_scales(off_m, off_n + BN0, M, N, xs_ptr, ws_ptr, BN1, LAYOUT1)
            acc1 = gl.zeros([SUB_M, BN1], gl.int32, LAYOUT1)
        for kk in range(k_tiles):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)
            if TAIL:
                acc1 = warpgroup_mma(a_bufs.index(slot), b1_bufs.index(slot).permute((1, 0)), acc1, use_acc=kk > 0,
                                     is_async=True)
                acc, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc1))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous step's wgmma has retired: its slot goes back to the producer
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=kk > 0)
            step += 1
        if TAIL:
            acc, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc1))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        if TMA_STORE:
            tma.store_wait(pendings=0)  # the previous tile's stores have read c_smem (and c1_smem)
        _epilogue(acc, scales, off_m, off_n, M, N, bias_ptr, c_ptr, c_desc, c_smem, stride_cm, HAS_BIAS, TMA_STORE, BN0,
                  LAYOUT)
        if TAIL:
            _epilogue(acc1, scales1, off_m, off_n + BN0, M, N, bias_ptr, c_ptr, c1_desc, c1_smem, stride_cm, HAS_BIAS,
                      TMA_STORE, BN1, LAYOUT1)
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def _int8_gemm_ws_kernel(a_desc, b_desc, b1_desc, c_desc, c1_desc, xs_ptr, ws_ptr, bias_ptr, c_ptr, M, N, K,
                         stride_cm, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr, GROUP_M: gl.constexpr,
                         STAGES: gl.constexpr, LAYOUT: gl.constexpr, TAIL: gl.constexpr, LAYOUT1: gl.constexpr,
                         PDL: gl.constexpr, EARLY_B: gl.constexpr):
    BN0: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = BN0 + TAIL * b1_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a0_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, SUB_M, BLOCK_K], a_desc.layout)
    a1_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, SUB_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BN0, BLOCK_K], b_desc.layout)
    if TAIL:
        b1_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, b1_desc.block_type.shape[0], BLOCK_K], b1_desc.layout)
    else:
        b1_bufs = b_bufs  # unused
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    num_pid_m = gl.cdiv(M, 2 * SUB_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    gl.warp_specialize([
        (_consumer, (a0_bufs, b_bufs, b1_bufs, ready, empty, c_desc, c1_desc, xs_ptr, ws_ptr, bias_ptr, c_ptr, M, N,
                     stride_cm, num_pid_m, num_pid_n, k_tiles, 0, HAS_BIAS, TMA_STORE, GROUP_M, STAGES, LAYOUT, TAIL,
                     LAYOUT1, PDL)),
        (_consumer, (a1_bufs, b_bufs, b1_bufs, ready, empty, c_desc, c1_desc, xs_ptr, ws_ptr, bias_ptr, c_ptr, M, N,
                     stride_cm, num_pid_m, num_pid_n, k_tiles, 1, HAS_BIAS, TMA_STORE, GROUP_M, STAGES, LAYOUT, TAIL,
                     LAYOUT1, PDL)),
        (_producer, (a_desc, b_desc, b1_desc, a0_bufs, a1_bufs, b_bufs, b1_bufs, ready, empty, M, num_pid_m,
                     num_pid_n, k_tiles, GROUP_M, STAGES, TAIL, PDL, EARLY_B)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


_launch_kernel = FastLauncher(_int8_gemm_ws_kernel)  # Triton's own launch path cost ~150 us of host time here


@functools.lru_cache(maxsize=None)
def _shared_layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _descriptor(t, block, dtype):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _shared_layout(block, dtype))


def ws_ok(x_q, w_q, out):
    """For compiled CUDA tensors (int8_gemm checks that before importing this module): sm_90 only (sm_100
    has other tensor-core instructions), with TMA-legal operands: 16-byte aligned bases and row strides,
    unit stride along K."""
    if not is_sm90(x_q.device):
        return False
    operands = all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) == 1 for t in (x_q, w_q))
    return operands and out.stride(1) == 1


def _tma_store_ok(out):
    return (out.dtype in (torch.bfloat16, torch.float16) and out.data_ptr() % 16 == 0
            and (out.stride(0) * out.element_size()) % 16 == 0)


@functools.lru_cache(maxsize=None)
def _unused_output(device, dtype):
    """A small aligned tensor standing in for the output descriptor when the epilogue stores from registers."""
    return torch.empty(8, 16, dtype=dtype, device=device)


def split_width(block_n):
    """A tile block_n wide as (BN0, BN1): wgmma tiles and Gluon tensors are powers of two wide, so e.g. 192 runs
    as 128 + 64 (two accumulators per consumer). BN1 = 0: one accumulator."""
    bn0 = 1 << (block_n.bit_length() - 1)
    bn1 = block_n - bn0
    if bn1 & (bn1 - 1):
        raise ValueError(f"a 'ws' tile is a power of two wide or the sum of two, got block_n={block_n}")
    return bn0, bn1


def launch_ws(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg, num_sms, pdl=False):
    """pdl: launched with PDL (kernels/pdl.py); both partitions wait before their first global access, except the
    producer's copies of its first weight tiles (WEIGHTS_BEFORE_WAIT), and the producer lets the next kernel be
    scheduled after its last copy."""
    sub_m = ROWS_PER_CONSUMER
    if cfg.block_m != 2 * sub_m or cfg.num_warps != 4 or cfg.split_k != 1:
        raise ValueError(f"a 'ws' config has block_m={2 * sub_m}, num_warps=4 and split_k=1, got {cfg}")
    bn0, bn1 = split_width(cfg.block_n)
    tma_store = _tma_store_ok(out)
    c_target = out if tma_store else _unused_output(out.device, out.dtype)  # only its type matters then
    c_dtype = _GL_DTYPES[out.dtype]
    c_desc = _descriptor(c_target, (sub_m, bn0) if tma_store else (8, 16), c_dtype)
    c1_desc = _descriptor(c_target, (sub_m, bn1), c_dtype) if bn1 and tma_store else c_desc
    b_desc = _descriptor(w_q, (bn0, cfg.block_k), gl.int8)
    b1_desc = _descriptor(w_q, (bn1, cfg.block_k), gl.int8) if bn1 else b_desc
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    _launch_kernel((min(tiles, num_sms),), dict(
        a_desc=_descriptor(x_q, (sub_m, cfg.block_k), gl.int8), b_desc=b_desc, b1_desc=b1_desc,
        c_desc=c_desc, c1_desc=c1_desc, xs_ptr=x_scale, ws_ptr=w_scale,
        bias_ptr=bias if bias is not None else w_scale, c_ptr=out, M=m, N=n, K=k, stride_cm=out.stride(0),
        HAS_BIAS=bias is not None, TMA_STORE=tma_store, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
        LAYOUT=accumulator_layout(bn0), TAIL=bn1 > 0, LAYOUT1=accumulator_layout(bn1 or bn0), PDL=pdl,
        EARLY_B=WEIGHTS_BEFORE_WAIT,
    ), num_warps=4, enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return out
