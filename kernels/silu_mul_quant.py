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

On the GPU the exp and the division are the bare special-function instructions
(MUFU: _exp2_ftz, _rcp_ftz). With Triton's `tl.exp` and `/` (ex2.approx.f32 and
div.full.f32) each wrapped its MUFU in range checks: 43.5 SASS instructions per
element at I = 14336, which made the kernel instruction-bound on an H200 (76-79 %
of the copy bandwidth, time proportional to BLOCK_I, masked lanes included); with
the bare ones 86-90 % (docs/benchmarks/gemm.md, thirty-third session). The outputs
are the same bit for bit wherever 1 + exp(-g) <= 2^126 (g >= -87.3; measured equal
on 59M int8 values and their scales); below that silu(g) is under 1e-36 and becomes 0 instead. The
CPU interpreter has no inline PTX, so there (MUFU False) the plain ops run.
`tl.exp2` with libdevice's fast_dividef compiles to the same instructions
(ex2.approx.ftz, div.approx.ftz = a * rcp) in another order, and read 2 points
less at I = 14336 on an H200 (the same at 8192; one process, both launched with
PDL), so the inline PTX stays.
"""

import triton
import triton.language as tl

from eightbit.kernels import checks
from eightbit.kernels.launch import FastLauncher, interpreting
from eightbit.kernels.pdl import allow_dependents, producer_launch, wait_for_previous_kernel
from eightbit.kernels.quant_per_token import _quantize_row, as_rows, row_launch_params, row_outputs


@triton.jit
def _exp2_ftz(x):
    """2^x as the one MUFU.EX2 (ex2.approx.ftz.f32). The ex2.approx.f32 that tl.exp emits is compiled with a
    rescale around it for results below 2^-126; here those only ever meet 1 + (result) = 1."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _rcp_ftz(x):
    """1 / x as the one MUFU.RCP (rcp.approx.ftz.f32): div.full.f32's a / b is a * this for b in [2^-126, 2^126]
    and rescales the operands outside."""
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


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
    MUFU: tl.constexpr,
):
    allow_dependents(PDL)  # a PDL GEMM after us may be scheduled now; it waits for our writes (kernels/pdl.py)
    wait_for_previous_kernel(PDL)  # launched with PDL behind a GEMM: its output is our input
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_I)
    mask = offs < I
    base = gu_ptr + row * stride_gu
    g = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + I + offs, mask=mask, other=0.0).to(tl.float32)
    # on the GPU an approximate division either way (`/` is div.full.f32 there): h is rounded to
    # gate_up.dtype next, and an IEEE division here made the kernel instruction-bound (1.6 TB/s on an H200)
    if MUFU:
        h = g * _rcp_ftz(1.0 + _exp2_ftz(g * -1.4426950408889634)) * u  # exp(-g) = 2^(-g * log2(e))
    else:
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
    checks.silu_mul(gate_up)
    gu = as_rows(gate_up, "gate_up")
    m, two_i = gu.shape
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
            PDL=pdl, MUFU=gate_up.is_cuda and not interpreting(),
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
