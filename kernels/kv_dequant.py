"""Dequantize the int8 KV blocks a batch of sequences uses into a float scratch cache (Triton twin of
reference.dequantize_blocks).

Why: the warp-specialized prefill (prefill_attention_hopper.py) runs on tensor cores that read both operands
of S = Q K^T and the V of P V from shared memory in a float type, so it cannot take the int8 cache directly.
For a long prefill it is cheaper to dequantize each sequence's context once per layer, a pass over the int8
bytes (about 1/20 of the attention's time at 4k tokens), and run the float kernel on the copy, than to run the
int8 Triton kernel. prefill_attention decides when (attention_configs.PREFILL_INT8_VIA_FLOAT_*).

Layout of the copy: sequence b's block j goes to block b * width + j (width = block_tables.shape[1]), token-major
for K and V alike ([blocks, page, Hkv, D], the float cache layout), so its block table is arange(B * width)
viewed [B, width]. Only blocks below cdiv(seq_len, page) are written (the reference zero-fills the others; here
they stay as allocated); a sequence's last block is dequantized whole, including the stale slots past its end
(the attention kernels never use them).
One program per (block j, sequence b, kv head h): a [page, D] tile of K and of V (V read key-minor).
"""

import torch
import triton
import triton.language as tl

from .launch import FastLauncher


@triton.jit(do_not_specialize=["width", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _dequant_blocks_kernel(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, k_out_ptr, v_out_ptr,
                           width, stride_kb, stride_kp, stride_kh, stride_vb, stride_vh, stride_sb, stride_sp,
                           stride_sh, stride_bt, HKV: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                           GROUP: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if j * PAGE < seq_len:
        blk = tl.load(block_tables_ptr + b.to(tl.int64) * stride_bt + j).to(tl.int64)
        p = tl.arange(0, PAGE)[:, None]
        c = tl.arange(0, D)[None, :]
        s_off = blk * stride_sb + p * stride_sp + h * stride_sh + c // GROUP
        k = tl.load(k_ptr + blk * stride_kb + p * stride_kp + h * stride_kh + c).to(tl.float32)
        v = tl.load(v_ptr + blk * stride_vb + h * stride_vh + c * PAGE + p).to(tl.float32)
        k = k * tl.load(k_scale_ptr + s_off).to(tl.float32)
        v = v * tl.load(v_scale_ptr + s_off).to(tl.float32)
        out = ((b.to(tl.int64) * width + j) * PAGE + p) * (HKV * D) + h * D + c
        tl.store(k_out_ptr + out, k.to(k_out_ptr.dtype.element_ty))
        tl.store(v_out_ptr + out, v.to(v_out_ptr.dtype.element_ty))


_launch = FastLauncher(_dequant_blocks_kernel)


def dequantize_blocks(k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, dtype):
    """(K copy, V copy, block table) of the blocks below each sequence's length, in dtype; see the module
    docstring. Inputs as prefill_attention has checked them (an int8 cache, V key-minor)."""
    nb, page, hkv, d = k_cache.shape
    b, width = block_tables.shape
    group = d // k_scale.shape[3]
    k_out = torch.empty((b * width, page, hkv, d), dtype=dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    table = torch.arange(b * width, dtype=torch.int32, device=k_cache.device).view(b, width)
    if b * width:
        _launch((width, b, hkv), dict(
            k_ptr=k_cache, v_ptr=v_cache, k_scale_ptr=k_scale, v_scale_ptr=v_scale, block_tables_ptr=block_tables,
            seq_lens_ptr=seq_lens, k_out_ptr=k_out, v_out_ptr=v_out, width=width,
            stride_kb=k_cache.stride(0), stride_kp=k_cache.stride(1), stride_kh=k_cache.stride(2),
            stride_vb=v_cache.stride(0), stride_vh=v_cache.stride(1), stride_sb=k_scale.stride(0),
            stride_sp=k_scale.stride(1), stride_sh=k_scale.stride(2), stride_bt=block_tables.stride(0),
            HKV=hkv, PAGE=page, D=d, GROUP=group,
        ), num_warps=4)
    return k_out, v_out, table
