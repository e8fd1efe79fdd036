"""Fused (residual add) + RMSNorm (+ per-token int8 quantization) in Triton.

Algorithm: one program per row (token), the whole row of H elements held in
registers (BLOCK_H = H rounded up to a power of two, masked), one read of each
input and one write of each output:

    s   = x + residual, rounded to x.dtype      (only with a residual; s is stored as the new residual)
    r   = 1 / sqrt(mean(s^2) + eps)             (float32)
    y   = (s * r) * weight, rounded to x.dtype  (the bf16 model's activation, as in reference.rms_norm)
    QUANT:     q, scale = per-token int8 of y   (quant_per_token._quantize_row: absmax/127, round half even)
    not QUANT: y is stored in x.dtype

The rounding of y to x.dtype before quantizing is what the reference does
(reference.rmsnorm_quant = quant_per_token(rms_norm(...))), so the int8 path and
the bf16 path see the same activation. With a residual the sum is both
normalized and returned as the next residual (a new tensor; the inputs are not
modified).
"""

import torch
import triton
import triton.language as tl

from eightbit.kernels import checks
from eightbit.kernels.launch import FastLauncher
from eightbit.kernels.pdl import allow_dependents, producer_launch, wait_for_previous_kernel
from eightbit.kernels.quant_per_token import _quantize_row, as_rows, row_launch_params, row_outputs


@triton.jit
def _rmsnorm_kernel(
    # pointers
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr,
    # sizes
    H, eps,
    # strides (rows; the last dimension is contiguous)
    stride_x, stride_res, stride_out, stride_res_out, stride_q,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    CUDA_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    allow_dependents(PDL)  # a PDL GEMM after us may be scheduled now; it waits for our writes (kernels/pdl.py)
    wait_for_previous_kernel(PDL)  # launched with PDL behind a GEMM: its output is our input
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / H
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd * w).to(x_ptr.dtype.element_ty)
    if QUANT:
        q, scale = _quantize_row(y.to(tl.float32), mask, CUDA_SCALE)
        tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + offs, y, mask=mask)


_launch_rmsnorm = FastLauncher(_rmsnorm_kernel)


def _launch(x, weight, eps, residual, quant):
    checks.rms_norm(x, weight, residual)
    x2 = as_rows(x, "x")
    m, h = x2.shape
    weight = weight.contiguous()
    r2 = res_out = None
    if residual is not None:
        r2 = as_rows(residual, "residual")
        res_out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    out, q, scale = row_outputs(m, h, x.dtype, x.device, quant)
    if m > 0 and h > 0:
        block, num_warps = row_launch_params(h)
        pdl, pdl_options = producer_launch(x.device)
        _launch_rmsnorm((m,), dict(
            x_ptr=x2, res_ptr=r2 if r2 is not None else x2, w_ptr=weight, out_ptr=out,
            res_out_ptr=res_out if res_out is not None else x2, q_ptr=q, scale_ptr=scale,
            H=h, eps=float(eps),
            stride_x=x2.stride(0), stride_res=r2.stride(0) if r2 is not None else 0, stride_out=out.stride(0),
            stride_res_out=res_out.stride(0) if res_out is not None else 0, stride_q=q.stride(0),
            HAS_RESIDUAL=residual is not None, QUANT=quant, CUDA_SCALE=x.is_cuda, BLOCK_H=block,
            PDL=pdl,
        ), num_warps=num_warps, enable_fp_fusion=False, **pdl_options)
    elif quant:
        scale.zero_()
    new_res = res_out.reshape(x.shape) if res_out is not None else None
    if quant:
        return q.reshape(x.shape), scale.reshape(*x.shape[:-1], 1), new_res
    return out.reshape(x.shape), new_res


def rms_norm(x, weight, eps, residual=None):
    """(x + residual) -> RMSNorm. Returns (normed in x.dtype, the new residual or None)."""
    return _launch(x, weight, eps, residual, quant=False)


def rmsnorm_quant(x, weight, eps, residual=None):
    """rms_norm, then per-token int8. Returns (q int8, scale f32 [M, 1], new residual or None)."""
    return _launch(x, weight, eps, residual, quant=True)
