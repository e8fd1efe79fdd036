"""Fused SiLU(gate) * up (+ per-token int8 quantization) in Triton.

Algorithm: gate_up [M, 2I] holds the gate projection in its first I columns and
the up projection in the last I (one fused gate_up GEMM). One program per row
holds both halves in registers (BLOCK_I = I rounded up to a power of two,
masked):

    h = (g / (1 + exp(-g))) * u, in float32, rounded to gate_up.dtype (as reference.silu_mul)
    QUANT:     q, scale = per-token int8 of h   (quant_per_token._quantize_row)
    not QUANT: h is stored in gate_up.dtype

Each input element is read once and the output written once: for the int8 path
that is 4 bytes in and 1 byte out per bf16 output element, and the [M, I]
intermediate never reaches memory.
"""

import triton
import triton.language as tl

from eightbit.kernels.launch import FastLauncher
from eightbit.kernels.pdl import allow_dependents, producer_launch, wait_for_previous_kernel
from eightbit.kernels.quant_per_token import _quantize_row, as_rows, row_launch_params, row_outputs


@triton.jit
def _silu_mul_kernel(
    # pointers
    gu_ptr, out_ptr, q_ptr, scale_ptr,
    # sizes
    I,
    # strides (rows; the last dimension is contiguous)
    stride_gu, stride_out, stride_q,
    # meta-parameters
    QUANT: tl.constexpr,
    CUDA_SCALE: tl.constexpr,
    BLOCK_I: tl.constexpr,
    PDL: tl.constexpr,
):
    allow_dependents(PDL)  # a PDL GEMM after us may be scheduled now; it waits for our writes (kernels/pdl.py)
    wait_for_previous_kernel(PDL)  # launched with PDL behind a GEMM: its output is our input
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_I)
    mask = offs < I
    base = gu_ptr + row * stride_gu
    g = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + I + offs, mask=mask, other=0.0).to(tl.float32)
    # the fast (approximate) division: h is rounded to gate_up.dtype next, and an IEEE
    # division here made the kernel instruction-bound (1.6 TB/s on an H200)
    h = g / (1.0 + tl.exp(-g)) * u
    h = h.to(gu_ptr.dtype.element_ty)
    if QUANT:
        q, scale = _quantize_row(h.to(tl.float32), mask, CUDA_SCALE)
        tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + offs, h, mask=mask)


_launch_silu = FastLauncher(_silu_mul_kernel)


def _launch(gate_up, quant):
    gu = as_rows(gate_up, "gate_up")
    m, two_i = gu.shape
    if two_i % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got {two_i}")
    i = two_i // 2
    lead = gate_up.shape[:-1]
    out, q, scale = row_outputs(m, i, gate_up.dtype, gate_up.device, quant)
    if m > 0 and i > 0:
        block, num_warps = row_launch_params(i)
        pdl, pdl_options = producer_launch(gate_up.device)
        _launch_silu((m,), dict(
            gu_ptr=gu, out_ptr=out, q_ptr=q, scale_ptr=scale, I=i,
            stride_gu=gu.stride(0), stride_out=out.stride(0), stride_q=q.stride(0),
            QUANT=quant, CUDA_SCALE=gate_up.is_cuda, BLOCK_I=block,
            PDL=pdl,
        ), num_warps=num_warps, enable_fp_fusion=False, **pdl_options)
    elif quant:
        scale.zero_()
    if quant:
        return q.reshape(*lead, i), scale.reshape(*lead, 1)
    return out.reshape(*lead, i)


def silu_mul(gate_up):
    """gate_up [M, 2I] (gate first, then up) -> SiLU(gate) * up [M, I] in gate_up.dtype."""
    return _launch(gate_up, quant=False)


def silu_mul_quant(gate_up):
    """silu_mul, then per-token int8 -> (q int8 [M, I], scale f32 [M, 1])."""
    return _launch(gate_up, quant=True)
