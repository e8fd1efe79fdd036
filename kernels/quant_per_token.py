"""Per-token (per-row) symmetric int8 quantization in Triton.

Algorithm (the definition is quant/int8.py; this reproduces it bit for bit, except rows whose absmax is
below 2^-100, which quant/int8.py rescales first):
one program owns one row and holds the whole row in registers (BLOCK_K is the
row length rounded up to a power of two, masked). In float32:

    absmax = max |x|                      (x first rounded to its own dtype: it is loaded as such)
    scale  = absmax / 127                 (stored as float32 [M, 1]; IEEE division on the CPU, absmax *
                                           float32(1/127) on CUDA: how torch evaluates it on each device)
    inv    = (1 / absmax) * 127, or 0 if absmax == 0   (how torch evaluates 127 / absmax)
    q      = round_half_even(x * inv) clamped to [-127, 127]

The row is read once and q written once, so the kernel moves the fewest bytes
possible (2 bytes in + 1 byte out per bf16 element).

`_quantize_row` and `_round_half_even` are shared by the fused producers
(rmsnorm_quant.py, silu_mul_quant.py) so there is one copy of the rounding.
Rounding adds and subtracts 1.5 * 2^23 (round-to-nearest-even in the FPU) rather
than calling libdevice, so the same code runs under TRITON_INTERPRET=1 (CPU tests)
and on the GPU. The kernels are launched with enable_fp_fusion=False so `x * inv`
is rounded to float32 before it is rounded to an integer, as in torch (no fused
multiply-add).
"""

import torch
import triton
import triton.language as tl

from eightbit.kernels import checks
from eightbit.kernels.launch import FastLauncher
from eightbit.kernels.pdl import allow_dependents, producer_launch, wait_for_previous_kernel

QMAX = 127.0
MAX_ROW = 65536  # the largest row one program holds in registers

# --- shared device helpers ----------------------------------------------------------------


@triton.jit
def _round_half_even(y):
    """Round float32 y to the nearest integer, ties to even (torch.round), for |y| < 2^22.

    Adding and subtracting 1.5 * 2^23 leaves no fraction bits, so the add rounds
    to an integer in the FPU's round-to-nearest-even mode. Two instructions; needs
    the kernel built with enable_fp_fusion=False (and no fast-math, Triton's default)."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def max_keep_nan(a, b):
    """max that returns NaN if either operand is NaN (max.NaN.f32), as torch's amax does: tl.max drops NaN,
    which turned a row holding a NaN into finite int8 values with a finite scale."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_row(y, mask, CUDA_SCALE: tl.constexpr):
    """y: float32 [BLOCK] (masked lanes ignored) -> (int8 q [BLOCK], float32 scale).

    torch evaluates `127 / absmax` (Python scalar over tensor) as reciprocal(absmax) * 127
    on every device, and `absmax / 127` as a true division on the CPU but as
    absmax * float32(1/127) on CUDA; CUDA_SCALE picks the CUDA form so that both
    backends reproduce quant/int8.py bit for bit on their own device."""
    absmax = tl.reduce(tl.where(mask, tl.abs(y), 0.0), 0, max_keep_nan)  # NaN in the row: scale NaN, as torch
    nonzero = absmax > 0.0
    safe = tl.where(nonzero, absmax, 1.0)
    inv = tl.where(nonzero, tl.math.div_rn(1.0, safe) * 127.0, 0.0)
    if CUDA_SCALE:
        scale = absmax * 0.007874015718698502  # float32(1 / 127)
    else:
        scale = tl.math.div_rn(absmax, 127.0)
    q = _round_half_even(y * inv)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    return q.to(tl.int8), scale


# --- the kernel ---------------------------------------------------------------------------


@triton.jit
def _quant_per_token_kernel(
    # pointers
    x_ptr, q_ptr, scale_ptr,
    # sizes
    K,
    # strides (rows; the last dimension is contiguous)
    stride_xm, stride_qm,
    # meta-parameters
    CUDA_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    allow_dependents(PDL)  # a PDL GEMM after us may be scheduled now; it waits for our writes (kernels/pdl.py)
    wait_for_previous_kernel(PDL)  # launched with PDL behind a GEMM: its output is our input
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_row(x, mask, CUDA_SCALE)
    tl.store(q_ptr + row * stride_qm + offs, q, mask=mask)
    tl.store(scale_ptr + row, scale)


# --- host side ----------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_launch_quant = FastLauncher(_quant_per_token_kernel)


def row_launch_params(n):
    """(BLOCK, num_warps) for a one-row-per-program kernel over rows of n elements."""
    if n > MAX_ROW:
        raise ValueError(f"rows of {n} elements are longer than the supported {MAX_ROW}")
    block = triton.next_power_of_2(max(n, 16))
    num_warps = min(32, max(4, block // 512))
    return block, num_warps


def row_outputs(m, n, dtype, device, quant):
    """(out, q, scale) of a one-row-per-program kernel: int8 q [m, n] and float32 scale [m, 1] when
    quant, else out [m, n] in dtype. The outputs the kernel does not write alias one that exists."""
    if quant:
        q = torch.empty((m, n), dtype=torch.int8, device=device)
        return q, q, torch.empty((m, 1), dtype=torch.float32, device=device)
    out = torch.empty((m, n), dtype=dtype, device=device)
    return out, out, out


def as_rows(x, name):
    """View x [..., K] as 2-D rows [M, K] with a contiguous last dimension (no copy if possible)."""
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.flatten(0, -2) if x.dim() > 1 else x.unsqueeze(0)  # reshape(-1, 0) would be ambiguous at K = 0
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def quant_per_token(x):
    """x [..., K] -> (int8 [..., K], float32 scale [..., 1]). Same as reference.quant_per_token."""
    checks.quant_per_token(x)
    x2 = as_rows(x, "x")
    m, k = x2.shape
    _, q, scale = row_outputs(m, k, None, x.device, quant=True)
    if m > 0 and k > 0:
        block, num_warps = row_launch_params(k)
        pdl, pdl_options = producer_launch(x.device)
        _launch_quant((m,), dict(
            x_ptr=x2, q_ptr=q, scale_ptr=scale, K=k, stride_xm=x2.stride(0), stride_qm=q.stride(0),
            CUDA_SCALE=x.is_cuda, BLOCK_K=block, PDL=pdl,
        ), num_warps=num_warps, enable_fp_fusion=False, **pdl_options)
    elif m > 0:
        scale.zero_()
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)
