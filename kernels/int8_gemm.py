"""W8A8 GEMM in Triton: int8 x_q [M, K] @ int8 w_q [N, K]^T, exact int32 accumulation,
with the dequantization epilogue fused.

    out[m, n] = cast( (acc[m, n] * x_scale[m]) * w_scale[n] (+ bias[n]), out_dtype ),
    acc[m, n] = sum_k x_q[m, k] * w_q[n, k]        (int32, tl.dot(..., out_dtype=tl.int32))

Both operands are K-major (row-major with K contiguous), which is what Hopper's
int8 tensor-core instructions want for A and B, so no transposes are needed.

Four kernels share this entry point (below: "dot", "gemv", "ws", "swap"); the launch configuration
(gemm_configs.py, a committed table tuned on the GPU; no autotuning at run time) picks the kernel and its
shape per (M bucket, N, K). The "dot" kernel runs every regime and is what the others fall back to:

* prefill (large M, tensor-core bound): big tiles (e.g. 128x256x128), programs
  walked in grouped order (GROUP_M rows of tiles share their weight columns in
  L2), num_stages-deep software pipelining of the K loop.
* decode (M <= 64, bound by the weight bytes): narrow tiles (BLOCK_M = 16) so
  there are many programs, each streaming a slab of weight rows with several
  BLOCK_K stages in flight, optionally split along K (SPLIT_K > 1) so there are
  enough programs to keep every SM's loads in flight when N / BLOCK_N is small.

Split-K reduction is exact and deterministic: every split stores its int32
partial tile to a workspace, then increments a per-tile counter (acq_rel, GPU
scope, after a CTA barrier). The split that arrives last reads the other
partials back (from L2), adds them in int32 (integer addition: the result does
not depend on the order), resets the counter to zero for the next launch and
runs the epilogue. No float atomics, one launch, no memset: the counters clean
up after themselves. (The counters are shared per device: do not run two
split-K launches concurrently on different streams.)

Small M (decode) has a second kernel, `_int8_gemv_kernel` (config.kernel == "gemv"): at M <= 8 the
tensor cores do not matter, the weight bytes do. It streams W as int32 words (4 int8 each, 16-byte
vector loads along K), keeps one [BLOCK_N, BLOCK_K/4] int32 accumulator per activation row and
multiplies with `dp4a` (4 int8 products + add in one instruction; a shift-based twin under the
interpreter), reducing along K once at the end. No shared memory, no tensor-core layouts: each
program only has its loads in flight. Its split-K partials are added with int32 atomics into a
zeroed [M, N] int32 buffer (exact and order-independent), the last split to arrive (same counter
scheme) reads the sum, zeroes the buffer again and runs the epilogue.

Large M on an H100/H200 has a third kernel, written in Gluon in int8_gemm_hopper.py (config.kernel ==
"ws"): warp-specialized, a TMA producer warp feeding two consumer warp groups that keep one int8 wgmma
in flight; 1.08-1.36x faster than the Triton kernels at M >= 512 (docs/benchmarks/gemm.md). It needs sm_90
and the TMA alignment (ws_ok); elsewhere, and under the CPU interpreter, the "dot" kernel runs instead.
(It replaced a persistent TMA-fed Triton kernel, "tma", which no tuned entry chose any more.)

Small M on an H100/H200 has a fourth kernel, also in Gluon, in int8_gemm_swap.py (config.kernel == "swap"): the
weights as the wgmma's A operand and the activations (up to 64 rows) as its B operand, both by TMA, one
wgmma per K step. On an H200 it reads the 8B down weights at M = 4-16 at 86-90 % of the copy bandwidth against the
dot kernel's 71-81 % (docs/benchmarks/gemm.md, fortieth session). Off sm_90 and under the interpreter the "dot"
kernel runs its entries instead.

On sm_90 the two Triton kernels are launched with programmatic dependent launch (kernels/pdl.py) at
M <= 128, and any kernel where its table entry says so (GemmConfig.pdl): their programs may be scheduled as soon
as the kernel before them allows it (the norm, SiLU and quantization kernels do as they start) and wait in
`griddepcontrol.wait` before any load or store (see PDL_MAX_M for the measurements). In turn they allow the
kernel after them (a norm, SiLU, quantization or kv_write kernel, which waits for the GEMM's output) to be
scheduled near the end of their K loop (the gemv kernel after it, the dot kernel one K step before it ends:
TRIGGER_AHEAD_STEPS). In that chain, before they wait, each program prefetches the first
PREFETCH_LINES 128-byte lines of each of its weight rows, from the start of its K range, into L2 (the weights are
not what the kernel before writes, and a prefetch is only a hint anyway), so the first loads after the wait do
not pay DRAM latency.

Masks: in the dot kernel, rows past M and columns past N load wrapped-around (valid, distinct) rows; the
gemv kernel repeats the last row and column instead (its few rows are separate pointers). Either way they are
masked at the store; K tails are masked with zeros when K % BLOCK_K != 0.

The "dot" kernel (tiles of up to 64 rows) and the "ws" kernel load a tile's x_scale and w_scale before
its K loop, so that the load latency is spent while the weights stream rather than after them: 4-7 %
faster at M = 8-16 on the 8B qkv / o shapes, 4-14 % on the 1B qkv / o at M = 8-256 (docs/benchmarks/gemm.md,
seventeenth session). The gemv kernel keeps its loads at the end: hoisted, 8B qkv at M = 2 / 4 ran 10 / 23 %
slower.
"""

import torch
import triton
import triton.language as tl

from eightbit.kernels import checks
from eightbit.kernels.gemm_configs import (KERNELS, GemmConfig, device_name_of, device_name_of_index, dot_config,
                                           get_config)
from eightbit.kernels.launch import FastLauncher, interpreting, sm_count
from eightbit.kernels.pdl import allow_dependents, chain_enabled, pdl_enabled, prefetch_l2, wait_for_previous_kernel
from eightbit.kernels.scratch import zeroed_scratch


@triton.jit
def _tile_scales(offs_m, offs_n, M, N, xs_ptr, ws_ptr):
    """A tile's row and column scales, loaded before its K loop so their latency overlaps the loop."""
    xs = tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
    return xs, ws


@triton.jit
def _prefetch_weight_rows(rows_ptr, k0, k_last, stride_k, LINES: tl.constexpr, PER_LINE: tl.constexpr):
    """Before the PDL wait: prefetch_l2 the first LINES 128-byte lines (PER_LINE elements each) of each weight row
    (rows_ptr [rows]) from column k0, clamped to the row's last column k_last."""
    tl.static_assert(LINES & (LINES - 1) == 0, "PREFETCH (lines) must be a power of two")
    cols = tl.minimum(k0 + tl.arange(0, LINES) * PER_LINE, k_last)
    prefetch_l2(rows_ptr[:, None] + cols[None, :] * stride_k)


@triton.jit
def _epilogue(acc, scales, offs_m, offs_n, M, N, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS: tl.constexpr):
    xs, ws = scales
    mask_m = offs_m < M
    mask_n = offs_n < N
    out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        out = out + b[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (pid_m, pid_n) in grouped order: GROUP_M rows of tiles walk the N tiles
    together, so the weight columns they share are read from L2 rather than HBM."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((tile % per_group) % group_size)
    pid_n = (tile % per_group) // group_size
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])  # M=1 gets no kernel of its own (it ran slower, and costs a compile)
def _int8_gemm_kernel(
    # pointers
    a_ptr, xs_ptr, b_ptr, ws_ptr, bias_ptr, c_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K,
    # strides
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
    LATE_TRIGGER: tl.constexpr,
    PREFETCH: tl.constexpr,  # 128-byte lines of each weight row pulled into L2 before the PDL wait
    TRIGGER_AHEAD: tl.constexpr,  # with LATE_TRIGGER: allow dependents in K step t_end - TRIGGER_AHEAD
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)

    pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows and columns past the edge wrap around: in bounds without masks, and distinct addresses
    # (clamping them all to the last row made 48 lanes copy the same bytes, which the async copies
    # serialize: M = 80 ran 2.1x slower than M = 128, H100)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    # this split's range of K tiles
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)

    if PDL and PREFETCH > 0:
        _prefetch_weight_rows(b_ptr + rn * stride_bn, t_start * BLOCK_K, K - 1, stride_bk, PREFETCH, 128)
    # launched with PDL (sm_90, small M): no load or store before the kernel before us has completed (the
    # prefetch above is only a hint)
    wait_for_previous_kernel(PDL)

    a_ptrs = a_ptr + rm[:, None] * stride_am + (t_start * BLOCK_K + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + rn[None, :] * stride_bn + (t_start * BLOCK_K + offs_k)[:, None] * stride_bk
    # small tiles load their scales before the K loop (the latency overlaps it); 128-row tiles after it,
    # where the registers held through the loop halved the programs per SM (128 x 128, 8 warps: 156 > 128)
    EARLY_SCALES: tl.constexpr = BLOCK_M <= 64
    if EARLY_SCALES:
        scales = _tile_scales(offs_m, offs_n, M, N, xs_ptr, ws_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for t in range(t_start, t_end):
        if LATE_TRIGGER and TRIGGER_AHEAD > 0:
            if t == t_end - TRIGGER_AHEAD and t > t_start:  # a split of <= TRIGGER_AHEAD steps: after its loop
                allow_dependents(LATE_TRIGGER)
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - t * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    # every weight byte is in: the kernel after us (waiting for our output) may be scheduled now (if the loop
    # has not allowed it already: a repeated trigger does nothing)
    allow_dependents(LATE_TRIGGER)
    if not EARLY_SCALES:
        scales = _tile_scales(offs_m, offs_n, M, N, xs_ptr, ws_ptr)

    if SPLIT_K == 1:
        _epilogue(acc, scales, offs_m, offs_n, M, N, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
    else:
        # workspace [SPLIT_K, num_tiles, BLOCK_M, BLOCK_N] int32, tile-local and unmasked
        num_tiles = num_pid_m * num_pid_n
        tile_elems = BLOCK_M * BLOCK_N
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_base = part_ptr + pid.to(tl.int64) * tile_elems
        tl.store(tile_base + pid_k.to(tl.int64) * num_tiles * tile_elems + local, acc)
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for j in tl.static_range(SPLIT_K):
                total += tl.load(tile_base + j * num_tiles * tile_elems + local, cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + pid, 0, sem="relaxed", scope="gpu")
            _epilogue(total, scales, offs_m, offs_n, M, N, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)


@triton.jit
def _dp4a(w, x, acc, USE_ASM: tl.constexpr):
    """acc + sum over the 4 bytes of sext(w_byte) * sext(x_byte), elementwise on int32 words."""
    if USE_ASM:
        res = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, x, acc],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:  # the interpreter has no inline asm: the same products through arithmetic shifts
        res = acc
        for s in tl.static_range(4):
            res += ((w << (24 - 8 * s)) >> 24) * ((x << (24 - 8 * s)) >> 24)
    return res


@triton.jit
def _gemv_row(acc, w, x_row_ptr, k0, offs_k, KW, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr):
    if EVEN_K:
        x = tl.load(x_row_ptr + k0 + offs_k)
    else:
        x = tl.load(x_row_ptr + k0 + offs_k, mask=(k0 + offs_k) < KW, other=0)
    return _dp4a(w, tl.broadcast_to(x[None, :], w.shape), acc, USE_ASM)


@triton.jit
def _gemv_out(s, m, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS: tl.constexpr):
    """Row m of the output from its int32 sums s [BLOCK_N] (nothing stored for m >= M)."""
    mask_n = offs_n < N
    xs = tl.load(xs_ptr + tl.minimum(m, M - 1))
    ws = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    out = s.to(tl.float32) * xs * ws
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(c_ptr + m.to(tl.int64) * stride_cm + offs_n * stride_cn, out.to(c_ptr.dtype.element_ty),
             mask=mask_n & (m < M))


@triton.jit
def _gemv_add(s, m, M, offs_n, N, acc_ptr):
    tl.atomic_add(acc_ptr + m.to(tl.int64) * N + offs_n, s, mask=(offs_n < N) & (m < M), sem="relaxed", scope="gpu")


@triton.jit
def _gemv_take(m, M, offs_n, N, acc_ptr):
    """The summed row m from the split-K buffer, which is zeroed again for the next launch."""
    mask = (offs_n < N) & (m < M)
    ptrs = acc_ptr + m.to(tl.int64) * N + offs_n
    s = tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")
    tl.store(ptrs, tl.zeros_like(s), mask=mask)
    return s


@triton.jit(do_not_specialize=["M"])
def _int8_gemv_kernel(
    # pointers (a_ptr / b_ptr: the int8 operands viewed as int32 words, 4 along K each)
    a_ptr, xs_ptr, b_ptr, ws_ptr, bias_ptr, c_ptr, acc_ptr, lock_ptr,
    # sizes (KW = K / 4 words)
    M, N, KW,
    # strides (a / b in words)
    stride_am, stride_bn, stride_cm, stride_cn,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # activation rows per program: 1, 2, 4 or 8
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,  # words of K per step (BLOCK_K / 4)
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    PDL: tl.constexpr,
    LATE_TRIGGER: tl.constexpr,
    PREFETCH: tl.constexpr,  # as in _int8_gemm_kernel
):
    tl.static_assert(BLOCK_M == 1 or BLOCK_M == 2 or BLOCK_M == 4 or BLOCK_M == 8)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_KW), BLOCK_KW), BLOCK_KW)

    k_tiles = tl.cdiv(KW, BLOCK_KW)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    if PDL and PREFETCH > 0:  # 32 words a line
        _prefetch_weight_rows(b_ptr + rn * stride_bn, t_start * BLOCK_KW, KW - 1, 1, PREFETCH, 32)
    wait_for_previous_kernel(PDL)  # as in _int8_gemm_kernel

    m0 = pid_m * BLOCK_M
    x0 = a_ptr + tl.minimum(m0, M - 1).to(tl.int64) * stride_am
    x1 = a_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_am
    x2 = a_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_am
    x3 = a_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_am
    x4 = a_ptr + tl.minimum(m0 + 4, M - 1).to(tl.int64) * stride_am
    x5 = a_ptr + tl.minimum(m0 + 5, M - 1).to(tl.int64) * stride_am
    x6 = a_ptr + tl.minimum(m0 + 6, M - 1).to(tl.int64) * stride_am
    x7 = a_ptr + tl.minimum(m0 + 7, M - 1).to(tl.int64) * stride_am
    acc0 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    acc4 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    acc5 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    acc6 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    acc7 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)

    w_ptrs = b_ptr + rn[:, None] * stride_bn + (t_start * BLOCK_KW + offs_k)[None, :]
    for t in range(t_start, t_end):
        k0 = t * BLOCK_KW
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=(k0 + offs_k)[None, :] < KW, other=0, eviction_policy="evict_first")
        acc0 = _gemv_row(acc0, w, x0, k0, offs_k, KW, EVEN_K, USE_ASM)
        if BLOCK_M > 1:
            acc1 = _gemv_row(acc1, w, x1, k0, offs_k, KW, EVEN_K, USE_ASM)
        if BLOCK_M > 2:
            acc2 = _gemv_row(acc2, w, x2, k0, offs_k, KW, EVEN_K, USE_ASM)
            acc3 = _gemv_row(acc3, w, x3, k0, offs_k, KW, EVEN_K, USE_ASM)
        if BLOCK_M > 4:
            acc4 = _gemv_row(acc4, w, x4, k0, offs_k, KW, EVEN_K, USE_ASM)
            acc5 = _gemv_row(acc5, w, x5, k0, offs_k, KW, EVEN_K, USE_ASM)
            acc6 = _gemv_row(acc6, w, x6, k0, offs_k, KW, EVEN_K, USE_ASM)
            acc7 = _gemv_row(acc7, w, x7, k0, offs_k, KW, EVEN_K, USE_ASM)
        w_ptrs += BLOCK_KW
    allow_dependents(LATE_TRIGGER)  # as in _int8_gemm_kernel

    s0 = tl.sum(acc0, axis=1)
    s1 = tl.sum(acc1, axis=1)
    s2 = tl.sum(acc2, axis=1)
    s3 = tl.sum(acc3, axis=1)
    s4 = tl.sum(acc4, axis=1)
    s5 = tl.sum(acc5, axis=1)
    s6 = tl.sum(acc6, axis=1)
    s7 = tl.sum(acc7, axis=1)
    if SPLIT_K > 1:
        _gemv_add(s0, m0, M, offs_n, N, acc_ptr)
        if BLOCK_M > 1:
            _gemv_add(s1, m0 + 1, M, offs_n, N, acc_ptr)
        if BLOCK_M > 2:
            _gemv_add(s2, m0 + 2, M, offs_n, N, acc_ptr)
            _gemv_add(s3, m0 + 3, M, offs_n, N, acc_ptr)
        if BLOCK_M > 4:
            _gemv_add(s4, m0 + 4, M, offs_n, N, acc_ptr)
            _gemv_add(s5, m0 + 5, M, offs_n, N, acc_ptr)
            _gemv_add(s6, m0 + 6, M, offs_n, N, acc_ptr)
            _gemv_add(s7, m0 + 7, M, offs_n, N, acc_ptr)
        tl.debug_barrier()  # every thread's atomics are issued before the counter moves
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            s0 = _gemv_take(m0, M, offs_n, N, acc_ptr)
            _gemv_out(s0, m0, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
            if BLOCK_M > 1:
                s1 = _gemv_take(m0 + 1, M, offs_n, N, acc_ptr)
                _gemv_out(s1, m0 + 1, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
            if BLOCK_M > 2:
                s2 = _gemv_take(m0 + 2, M, offs_n, N, acc_ptr)
                _gemv_out(s2, m0 + 2, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
                s3 = _gemv_take(m0 + 3, M, offs_n, N, acc_ptr)
                _gemv_out(s3, m0 + 3, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
            if BLOCK_M > 4:
                s4 = _gemv_take(m0 + 4, M, offs_n, N, acc_ptr)
                _gemv_out(s4, m0 + 4, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
                s5 = _gemv_take(m0 + 5, M, offs_n, N, acc_ptr)
                _gemv_out(s5, m0 + 5, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
                s6 = _gemv_take(m0 + 6, M, offs_n, N, acc_ptr)
                _gemv_out(s6, m0 + 6, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
                s7 = _gemv_take(m0 + 7, M, offs_n, N, acc_ptr)
                _gemv_out(s7, m0 + 7, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        _gemv_out(s0, m0, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
        if BLOCK_M > 1:
            _gemv_out(s1, m0 + 1, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
        if BLOCK_M > 2:
            _gemv_out(s2, m0 + 2, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
            _gemv_out(s3, m0 + 3, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
        if BLOCK_M > 4:
            _gemv_out(s4, m0 + 4, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
            _gemv_out(s5, m0 + 5, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
            _gemv_out(s6, m0 + 6, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)
            _gemv_out(s7, m0 + 7, M, offs_n, N, xs_ptr, ws_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, HAS_BIAS)


# --- host side ----------------------------------------------------------------------------

_launch_dot = FastLauncher(_int8_gemm_kernel)  # prefill launches it ~130 times a step: skip the re-binding
_launch_gemv_kernel = FastLauncher(_int8_gemv_kernel)
_locks = {}
_gemv_acc = {}


def _gemv_acc_buffer(device, n):
    """Per-device int32 split-K sums of the gemv and "swap" kernels (each launch re-zeroes its rows)."""
    return zeroed_scratch(_gemv_acc, device, n, 1 << 18, "int8_gemm: the split-K sum buffer")


def _lock_buffer(device, n):
    """Per-device split-K tile counters (each launch resets its own)."""
    return zeroed_scratch(_locks, device, n, 1 << 16, "int8_gemm: the split-K counters")


def _ws_ok(x_q, w_q, out):
    if x_q.device.type != "cuda" or interpreting():
        return False
    from eightbit.kernels.int8_gemm_hopper import ws_ok  # Gluon: imported only where it can run

    return ws_ok(x_q, w_q, out)


def _launch_ws(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg):
    from eightbit.kernels.int8_gemm_hopper import launch_ws

    pdl = _pdl(x_q.device, m, cfg)[0]["PDL"]
    return launch_ws(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg, sm_count(x_q.device), pdl)


def _swap_ok(x_q, w_q, out, cfg):
    if x_q.device.type != "cuda" or interpreting():
        return False
    from eightbit.kernels.int8_gemm_swap import swap_ok  # Gluon: imported only where it can run

    return swap_ok(x_q, w_q, out, cfg)


def _launch_swap(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg):
    from eightbit.kernels.int8_gemm_swap import launch_swap

    if cfg.split_k > 1:  # (the launch may run fewer K ranges; the per-device buffers are there either way)
        sums = _gemv_acc_buffer(x_q.device, m * n)
        counters = _lock_buffer(x_q.device, triton.cdiv(n, cfg.block_n))
    else:
        sums = counters = x_scale  # unused
    pdl_args = _pdl(x_q.device, m, cfg)[0]
    return launch_swap(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg, sums, counters, pdl=pdl_args["PDL"],
                       trigger=pdl_args["LATE_TRIGGER"])


def gemv_ok(x_q, w_q):
    """The gemv kernel reads both operands as int32 words: K, the row strides and the offsets must allow it."""
    k = x_q.shape[1]
    return (k % 4 == 0 and x_q.stride(0) % 4 == 0 and w_q.stride(0) % 4 == 0
            and x_q.storage_offset() % 4 == 0 and w_q.storage_offset() % 4 == 0
            and (x_q.device.type != "cuda" or (x_q.data_ptr() % 4 == 0 and w_q.data_ptr() % 4 == 0)))


def _launch_gemv(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg):
    kw, bkw = k // 4, cfg.block_k // 4
    x32 = x_q.view(torch.int32)
    w32 = w_q.view(torch.int32)
    split_k = max(1, min(cfg.split_k, triton.cdiv(kw, bkw)))
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, cfg.block_m))
    if split_k > 1:
        acc = _gemv_acc_buffer(x_q.device, m * n)
        locks = _lock_buffer(x_q.device, grid[0] * grid[2])
    else:
        acc = locks = x32  # unused
    pdl_args, pdl_options = _pdl(x_q.device, m, cfg)
    _launch_gemv_kernel(grid, dict(
        a_ptr=x32, xs_ptr=x_scale, b_ptr=w32, ws_ptr=w_scale, bias_ptr=bias if bias is not None else w_scale,
        c_ptr=out, acc_ptr=acc, lock_ptr=locks, M=m, N=n, KW=kw,
        stride_am=x_q.stride(0) // 4, stride_bn=w_q.stride(0) // 4, stride_cm=out.stride(0), stride_cn=out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_KW=bkw, SPLIT_K=split_k, EVEN_K=(kw % bkw == 0),
        USE_ASM=x_q.device.type == "cuda", PREFETCH=_prefetch_lines(pdl_args), **pdl_args,
    ), num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False, **pdl_options)
    return out


# PDL at decode sizes only (docs/benchmarks/gemm.md, twelfth session; H100, same-process A/B). At M <= 128,
# quant_per_token + GEMM got 0.45-1.0 us faster for qkv, o and gate_up; down (K = 8192-14336) lost 0.7-1.7 us
# at M = 8-32 there, yet the engine, where silu_mul_quant feeds down, decoded faster with it than with down
# left out (batch 1: 3.713 vs 3.728 ms per token; 3.797 without PDL). Above that it depends on the shape: with
# the chain, 1B o at M = 256 gains 1.1 us and 1B qkv (Gluon) at 192-256 1.7-1.9 us, while 8B qkv at M = 256 loses
# 3 us and the long Gluon GEMMs (8B gate_up / down) 1-6 us (eighteenth session). So larger M keeps the plain
# launch unless its table entry says otherwise (GemmConfig.pdl, measured by `tune_gemm --pdl`).
PDL_MAX_M = 128


_PLAIN_LAUNCH = (dict(PDL=False, LATE_TRIGGER=False), {})
_PDL_LAUNCH = (dict(PDL=True, LATE_TRIGGER=False), {"launch_pdl": True})
_CHAIN_LAUNCH = (dict(PDL=True, LATE_TRIGGER=True), {"launch_pdl": True})


def pdl_by_rule(m, cfg):
    """PDL for a config without a table mark: the Triton kernels and the small-M Gluon kernel ("swap", launched
    as the Triton kernels are) up to PDL_MAX_M rows."""
    return m <= PDL_MAX_M and cfg.kernel != "ws"


def _pdl(device, m, cfg):
    """(constexprs, launch options): launched with PDL on sm_90 where the config says so (a table entry's mark,
    measured with the chain), else up to PDL_MAX_M rows for the Triton kernels; in the chain (kernels/pdl.py)
    allowing the next kernel to start near the end of the K loop. The large-M Gluon kernel ("ws") only ever gets PDL
    in the chain, so its one PDL flag (wait and trigger) follows PDL here; the small-M one ("swap") gets it as the
    Triton kernels do, its trigger following LATE_TRIGGER."""
    if not pdl_enabled(device):
        return _PLAIN_LAUNCH
    chain = chain_enabled(device)
    # the marks were measured with the chain: without it the rule alone holds (the twelfth session's launches)
    wanted = cfg.pdl if cfg.pdl is not None and chain else pdl_by_rule(m, cfg)
    if not wanted:
        return _PLAIN_LAUNCH
    return _CHAIN_LAUNCH if chain else _PDL_LAUNCH


# 128-byte lines of each weight row (from the start of the program's K range) a Triton GEMM launched in the PDL
# chain pulls into L2 before its wait (0: none; a power of two). H100, same
# process (docs/benchmarks/gemm.md, nineteenth session), 0 -> 4 lines: quant_per_token + GEMM faster in 29 of 32
# cells at M = 1-64, by up to 2.3 us (8B qkv at M = 16 12.96 -> 12.18 us), the other three within 0.2 us; the
# linear part of a decode layer 1-7 % faster at M = 1-128; GEMM after GEMM mixed (1B gate_up at M = 8 13.5 -> 14.1
# us). 8 lines: no better, and worse at 1B M = 128.
PREFETCH_LINES = 4


def _prefetch_lines(pdl_args):
    """In the chain only: EIGHTBIT_PDL_CHAIN=0 gives the twelfth session's launches, without the prefetch."""
    return PREFETCH_LINES if pdl_args["LATE_TRIGGER"] else 0


# In the chain, up to TRIGGER_AHEAD_MAX_M rows, the dot kernel allows its dependents in K step t_end -
# TRIGGER_AHEAD_STEPS instead of after its loop (0: after the loop; a split of no more steps than that too). The
# software pipeliner puts the trigger at the end of that step's body, after its MMA and after the copies of the
# steps ahead are issued: with 2, one K step's MMA is left. The next kernel's launch (~0.75 us from the last
# program's trigger to its first program, a %globaltimer timeline showed) then overlaps this kernel's last step
# and epilogue instead of following them.
# H100, same process (docs/benchmarks/gemm.md, twentieth session), 0 -> 2 steps: the linear part of a decode layer
# 1-4 % faster at M = 8-64 (8B M = 8 92.5 -> 91.0 us, 1B M = 16 39.9 -> 38.3), equal (8B) or 1 % faster (1B) at
# M = 128; GEMM after GEMM 0.1-0.4 us faster (8B qkv at M = 8 10.65 -> 10.56 us). 3 steps: faster GEMM after GEMM,
# no better in the layer.
# The eighteenth session's trigger after the loop stays above M = 128, where it was not measured; the nineteenth's
# trial at num_stages - 1 steps (up to 5) made the 8B layer 1-1.5 % slower at M = 64-128.
TRIGGER_AHEAD_STEPS = 2
TRIGGER_AHEAD_MAX_M = PDL_MAX_M


def _trigger_ahead(m, pdl_args):
    return TRIGGER_AHEAD_STEPS if pdl_args["LATE_TRIGGER"] and m <= TRIGGER_AHEAD_MAX_M else 0


def _check(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    m, n, k = checks.int8_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    if k > 1 and (x_q.stride(1) != 1 or w_q.stride(1) != 1):
        raise ValueError("x_q and w_q must have a contiguous last (K) dimension")
    for name, t in (("x_scale", x_scale), ("w_scale", w_scale), ("bias", bias)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    return m, n, k


def int8_gemm_with_config(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16, config=None, out=None):
    """int8_gemm with an explicit GemmConfig (tuning, tests) and an optional preallocated out [M, N]. See int8_gemm
    for writing w_q right before a call."""
    m, n, k = _check(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    cfg = config if config is not None else get_config(m, n, k, device_name_of_index(x_q.get_device()))
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.device != x_q.device:
        raise ValueError(f"out must be a {out_dtype} [{m}, {n}] tensor on {x_q.device}")
    if cfg.kernel not in KERNELS:
        raise ValueError(f"unknown int8_gemm kernel {cfg.kernel!r} ({', '.join(KERNELS)})")
    if ((cfg.kernel == "gemv" and not gemv_ok(x_q, w_q)) or (cfg.kernel == "ws" and not _ws_ok(x_q, w_q, out))
            or (cfg.kernel == "swap" and not _swap_ok(x_q, w_q, out, cfg))):
        cfg = dot_config(m, n, k)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(
            (torch.zeros((m, n), device=x_q.device) + (bias.float() if bias is not None else 0.0)).to(out_dtype))
    if cfg.kernel == "gemv":
        return _launch_gemv(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg)
    if cfg.kernel == "ws":
        return _launch_ws(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg)
    if cfg.kernel == "swap":
        return _launch_swap(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split_k = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    if split_k > 1:
        part = torch.empty(split_k * tiles * cfg.block_m * cfg.block_n, dtype=torch.int32, device=x_q.device)
        locks = _lock_buffer(x_q.device, tiles)
    else:
        part = locks = x_q  # unused
    bias_arg = bias if bias is not None else w_scale
    pdl_args, pdl_options = _pdl(x_q.device, m, cfg)
    strides = (x_q.stride(0), x_q.stride(1), w_q.stride(0), w_q.stride(1), out.stride(0), out.stride(1))
    _launch_dot((tiles, split_k), dict(
        a_ptr=x_q, xs_ptr=x_scale, b_ptr=w_q, ws_ptr=w_scale, bias_ptr=bias_arg, c_ptr=out, part_ptr=part,
        lock_ptr=locks, M=m, N=n, K=k,
        stride_am=strides[0], stride_ak=strides[1], stride_bn=strides[2], stride_bk=strides[3],
        stride_cm=strides[4], stride_cn=strides[5],
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SPLIT_K=split_k, EVEN_K=(k % cfg.block_k == 0), PREFETCH=_prefetch_lines(pdl_args),
        TRIGGER_AHEAD=_trigger_ahead(m, pdl_args), **pdl_args,
    ), num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False, **pdl_options)
    return out


def variant_sizes(n, k, max_m, device=None):
    """Values of M, at most max_m, at which int8_gemm launches every kernel variant it launches for [M, K] x [N, K]
    with M in [1, max_m] on `device`: each M's config (a table entry or a default, which can vary inside a bucket),
    whether it gets PDL, and Triton's specializations of M (== 1, % 16 == 0; the Gluon kernel's M is not exempted).
    Smallest M first; ModelRunner.compile_gemms launches them before serving."""
    name = device_name_of(torch.device(device)) if device is not None else None
    sizes = {}
    for m in range(1, max_m + 1):
        cfg = get_config(m, n, k, name)
        sizes.setdefault((cfg.key(), cfg.pdl, m <= PDL_MAX_M, m <= TRIGGER_AHEAD_MAX_M, m == 1, m % 16 == 0), m)
    return sorted(sizes.values())


def int8_gemm(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
    """int8 x_q [M, K] @ int8 w_q [N, K]^T, exact in int32, then * x_scale[m] * w_scale[n] (+ bias).

    On sm_90 a launch with programmatic dependent launch may copy w_q before the kernels ahead of it on the stream
    have finished (kernels/pdl.py). A w_q written by PyTorch ops is safe; one written by an eightbit kernel (e.g.
    quant_per_token on a weight matrix) needs torch.cuda.synchronize() or any PyTorch op in between. The same holds
    for int8_gemm_with_config."""
    return int8_gemm_with_config(x_q, x_scale, w_q, w_scale, bias, out_dtype)


__all__ = ["int8_gemm", "int8_gemm_with_config", "GemmConfig", "variant_sizes"]
