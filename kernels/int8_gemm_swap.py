"""The Hopper (sm_90) kernel of int8_gemm for small M, with the operands swapped: written in Gluon.

Same contract and the same epilogue arithmetic as the Triton kernels in int8_gemm.py (exact int32 accumulation,
then `acc * x_scale[m] * w_scale[n] (+ bias[n])`, cast to the output dtype), so the outputs are equal bit for bit.
It runs the table's "swap" entries (config.kernel == "swap").

At decode sizes the GEMM reads its weights and little else. The "dot" kernel pads M to a 16-row tile and spends
most of each K step on its own instructions (address arithmetic, the shared-memory ring's waits, operand
shuffles for mma.sync): on an H200 it reads 8B down at M = 4-16 at 71-81 % of the copy bandwidth where a plain
read of the same bytes reaches 88-93 % (docs/benchmarks/gemm.md, thirty-fifth session). Here the weights are
the wgmma's A operand and the activations its B operand, out^T [N, M] = W [N, K] . x^T [K, M]: one
`wgmma m64nMPk32` covers 64 weight rows and 32 bytes of K against all MP (8-64) activation rows, and a K step
is one barrier wait, its BLOCK_N / 64 x BLOCK_K / 32 wgmma instructions issued asynchronously, one wgmma wait
and one barrier arrive. Both tiles come by TMA (x rows past M zero-filled by the copy engine), so no thread
touches the bytes on their way to the tensor cores:

* a producer warp fills a ring of STAGES shared-memory slots (a [BLOCK_N, BLOCK_K] weight tile and a
  [MP, BLOCK_K] activation tile each) over this program's K range, waiting on each slot's `empty` barrier;
* one consumer warp group waits on the slot's `ready` barrier, issues the wgmma, keeps one in flight and hands
  the previous step's slot back;
* the grid is N / BLOCK_N tiles times SPLIT_K ranges of K. A split adds its int32 partial into a zeroed [M, N]
  buffer with integer atomics (exact, order-independent) and counts its arrival on its tile's counter; the last
  to arrive takes the sum (swapping zeros back in, so the buffer is clean for the next launch), resets the
  counter and runs the epilogue (the scheme of the gemv kernel's split-K, int8_gemm.py).

Launched with few registers (maxnreg: 64 a thread where the accumulator, BLOCK_N * MP / 128 registers, is at most
16, else 96, the least that ptxas needs without spilling a 128 x 64 tile): with Gluon's default a program took the
whole register file for its eight warps (4 + 1, padded to a warp group's multiple), so no second program, nor the
next kernel of the PDL chain, could share an SM (8B qkv at M = 8: 60 -> 72 % of the copy bandwidth, gemm.md,
fortieth session). With PDL (kernels/pdl.py) the producer copies its first ring slots' weight tiles before its
`griddepcontrol.wait` (no kernel of the chain writes weights) and the activation tiles after it; the consumer
waits before loading any scale and before touching the split-K buffers. In the chain (TRIGGER) the producer also
lets the kernel after us be scheduled once its last copy is issued. So inside a decode layer few programs with deep
rings do best: one K range of 64-row tiles with 8-12 slots, which leaves SMs to the chain's neighbours and copies up
to 12 weight tiles a program before the wait (8B decode steps 3-4.5 % faster at batch 4-16 than with the card's
previous entries, on an H200: docs/benchmarks/engine.md, run 69; alone such configs read less than ones with more
programs).

There is no CPU interpreter for Gluon: off sm_90 (and under TRITON_INTERPRET) int8_gemm runs the "dot" kernel
instead (swap_ok). A CPU test compiles this kernel for sm_90; the GPU tests compare it with the exact int32 product.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# the large-M kernel's descriptors and accumulator layout: accumulator_layout(MP) is this kernel's [BLOCK_N, MP]
# int32 accumulator (m64nMPk32: every MP of BLOCK_MS is an int8 wgmma width)
from eightbit.kernels.int8_gemm_hopper import _descriptor, accumulator_layout
from eightbit.kernels.launch import FastLauncher, is_sm90

PRODUCER_REGS = gl.constexpr(40)
BLOCK_MS = (8, 16, 32, 64)  # activation rows per tile: the wgmma's N
BLOCK_NS = (64, 128)  # weight rows per tile: one or two 64-row wgmmas
MAX_BLOCK_K = 256  # a TMA box is at most 256 elements along each dimension
MAX_SHARED = 232448  # bytes of shared memory a program may use on sm_90


def maxnreg(cfg):
    """Registers a thread: 64 where the accumulator takes at most 16 of them, else 96 (no spills either way, ptxas)."""
    return 64 if cfg.block_m * cfg.block_n <= 2048 else 96


@gluon.jit
def _producer(w_desc, x_desc, w_bufs, x_bufs, ready, empty, k_step0, n_steps, STAGES: gl.constexpr,
              PDL: gl.constexpr, TRIGGER: gl.constexpr):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    off_n = gl.program_id(0) * BLOCK_N
    early = 0
    if PDL:  # the activations are the previous kernel's output, the weights are not: their first tiles load now
        early = gl.minimum(STAGES, n_steps)
        for i in range(early):
            mbarrier.expect(ready.index(i), nbytes)  # armed for the activation tile too, copied after the wait
            tma.async_copy_global_to_shared(w_desc, [off_n, (k_step0 + i) * BLOCK_K], ready.index(i),
                                            w_bufs.index(i))
        gdc_wait()
    for i in range(n_steps):
        slot = i % STAGES
        bar = ready.index(slot)
        if i >= early:
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # the consumer released its previous use
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(w_desc, [off_n, (k_step0 + i) * BLOCK_K], bar, w_bufs.index(slot))
        tma.async_copy_global_to_shared(x_desc, [0, (k_step0 + i) * BLOCK_K], bar, x_bufs.index(slot))
    if TRIGGER:  # every copy is issued: the kernel after us (which waits for our output) may be scheduled
        gdc_launch_dependents()


@gluon.jit
def _epilogue(acc, offs_n, offs_m, M, N, xs, ws, bias_ptr, c_ptr, stride_cm, HAS_BIAS: gl.constexpr):
    """acc [BLOCK_N, MP] is out^T: scaled in the order of the Triton kernels' epilogue, stored transposed."""
    out = acc.to(gl.float32) * gl.expand_dims(xs, 0) * gl.expand_dims(ws, 1)
    if HAS_BIAS:
        b = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
        out = out + gl.expand_dims(b, 1)
    mask = gl.expand_dims(offs_n < N, 1) & gl.expand_dims(offs_m < M, 0)
    ptrs = c_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_cm, 0) + gl.expand_dims(offs_n, 1)
    gl.store(ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _consumer(w_bufs, x_bufs, ready, empty, xs_ptr, ws_ptr, bias_ptr, c_ptr, acc_ptr, lock_ptr, M, N, stride_cm,
              n_steps, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr, LAYOUT: gl.constexpr,
              PDL: gl.constexpr):
    BLOCK_N: gl.constexpr = w_bufs.shape[1]
    MP: gl.constexpr = x_bufs.shape[1]
    pid_n = gl.program_id(0)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    offs_m = gl.arange(0, MP, layout=gl.SliceLayout(0, LAYOUT))
    if PDL:  # the row scales are the previous kernel's output
        gdc_wait()
    ws = gl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
    xs = gl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
    acc = gl.zeros([BLOCK_N, MP], gl.int32, LAYOUT)
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        acc = warpgroup_mma(w_bufs.index(slot), x_bufs.index(slot).permute((1, 0)), acc, use_acc=i > 0,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # the previous step's wgmma has retired: its slot goes back to the producer
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if SPLIT_K == 1:
        _epilogue(acc, offs_n, offs_m, M, N, xs, ws, bias_ptr, c_ptr, stride_cm, HAS_BIAS)
    else:
        mask = gl.expand_dims(offs_n < N, 1) & gl.expand_dims(offs_m < M, 0)
        sums = acc_ptr + gl.expand_dims(offs_m * N, 0) + gl.expand_dims(offs_n, 1)
        gl.atomic_add(sums, acc, mask=mask, sem="relaxed", scope="gpu")
        gl.thread_barrier()  # every thread's partial is added before the counter moves
        arrived = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = gl.atomic_xchg(sums, gl.zeros([BLOCK_N, MP], gl.int32, LAYOUT), mask=mask, sem="relaxed",
                                   scope="gpu")
            gl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            _epilogue(total, offs_n, offs_m, M, N, xs, ws, bias_ptr, c_ptr, stride_cm, HAS_BIAS)


@gluon.jit(do_not_specialize=["M"])
def _int8_gemm_swap_kernel(w_desc, x_desc, xs_ptr, ws_ptr, bias_ptr, c_ptr, acc_ptr, lock_ptr, M, N, K, stride_cm,
                           HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
                           LAYOUT: gl.constexpr, PDL: gl.constexpr, TRIGGER: gl.constexpr):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    MP: gl.constexpr = x_desc.block_type.shape[0]
    w_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, MP, BLOCK_K], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    k_steps = gl.cdiv(K, BLOCK_K)
    per_split = gl.cdiv(k_steps, SPLIT_K)
    k_step0 = gl.program_id(1) * per_split
    n_steps = gl.minimum(per_split, k_steps - k_step0)  # >= 1: the launch drops empty splits
    gl.warp_specialize([
        (_consumer, (w_bufs, x_bufs, ready, empty, xs_ptr, ws_ptr, bias_ptr, c_ptr, acc_ptr, lock_ptr, M, N,
                     stride_cm, n_steps, HAS_BIAS, SPLIT_K, STAGES, LAYOUT, PDL)),
        (_producer, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, k_step0, n_steps, STAGES, PDL, TRIGGER)),
    ], [1], [PRODUCER_REGS])


_launch_kernel = FastLauncher(_int8_gemm_swap_kernel)


def shared_bytes(cfg):
    """The ring's shared memory (the compiled kernel's, to within its barriers' few bytes)."""
    return cfg.num_stages * (cfg.block_n + cfg.block_m) * cfg.block_k


def config_ok(cfg):
    """Whether a "swap" config is one this kernel has: MP, BLOCK_N and BLOCK_K tile sizes it supports and a ring that
    fits in shared memory."""
    return (cfg.block_m in BLOCK_MS and cfg.block_n in BLOCK_NS and cfg.block_k in (64, 128, MAX_BLOCK_K)
            and cfg.num_warps == 4 and cfg.num_stages >= 2 and cfg.split_k >= 1
            and shared_bytes(cfg) + 1024 <= MAX_SHARED)


def swap_ok(x_q, w_q, out, cfg):
    """For compiled CUDA tensors (int8_gemm checks that before importing this module): sm_90, M within the config's
    MP rows, TMA-legal operands (16-byte aligned bases and row strides, unit stride along K), an output with unit
    column stride and a config the kernel has."""
    if not is_sm90(x_q.device) or x_q.shape[0] > cfg.block_m or not config_ok(cfg) or out.stride(1) != 1:
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) == 1 for t in (x_q, w_q))


def splits(k, block_k, split_k):
    """The K ranges the launch runs: at most split_k, none of them empty."""
    k_steps = -(-k // block_k)
    per = -(-k_steps // max(1, min(split_k, k_steps)))
    return -(-k_steps // per)


def launch_swap(x_q, x_scale, w_q, w_scale, bias, out, m, n, k, cfg, sums, counters, pdl=False, trigger=False):
    """sums / counters: the zeroed per-device split-K buffers (>= m * n and >= N / BLOCK_N int32), used with
    more than one split. pdl: wait for the previous kernel (the producer's first weight copies before it);
    trigger: let the next kernel be scheduled after the last copy."""
    split_k = splits(k, cfg.block_k, cfg.split_k)
    grid = (-(-n // cfg.block_n), split_k)
    _launch_kernel(grid, dict(
        w_desc=_descriptor(w_q, (cfg.block_n, cfg.block_k), gl.int8),
        x_desc=_descriptor(x_q, (cfg.block_m, cfg.block_k), gl.int8),
        xs_ptr=x_scale, ws_ptr=w_scale, bias_ptr=bias if bias is not None else w_scale, c_ptr=out,
        acc_ptr=sums, lock_ptr=counters, M=m, N=n, K=k, stride_cm=out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split_k, STAGES=cfg.num_stages, LAYOUT=accumulator_layout(cfg.block_m),
        PDL=pdl, TRIGGER=trigger,
    ), num_warps=4, maxnreg=maxnreg(cfg), enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return out

