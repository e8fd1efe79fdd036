"""RoPE + paged KV-cache write in one pass (Triton twins of reference.rope_kv_write / kv_write).

One program per token. It loads the token's cos/sin row once, rotates every query head
and every key head (rotate-half, HF Llama: the first half pairs with the second half), and
writes k and v into the token's cache slot (slot = block * page_size + offset; -1 = skip).
The int8 V cache is key-minor (reference.py), so a token's V channels land block_size bytes
apart: the kernel takes the token-major view's strides, head_dim's included.

Rotation of a whole head row at once: column c takes its partner c + D/2 (mod D), so

    out[c] = x[c] * cos[c mod D/2] + sign(c) * x[partner(c)] * sin[c mod D/2],  sign = -1 for c < D/2.

As in the reference, the rotated q and k are rounded to their own dtype; the int8 cache then
quantizes that rounded k exactly as quant.int8.quantize_groups does: per token and head, in
groups of G along head_dim, scale = fp16(min(absmax, 65024) / 127) rounded up, q = round_half_even(x * (1 / scale)),
clamped to [-127, 127]; an all-zero group gets scale 0 and q 0. A float cache stores the value
cast to the cache dtype.

The rotated q goes to a NEW tensor (contiguous [T, Hq, D], q.dtype); q itself is not changed.
Inputs may be strided views (e.g. slices of a fused qkv output) as long as head_dim is
contiguous. head_dim must be a power of two.
"""

import torch
import triton
import triton.language as tl

from . import checks
from .attention_configs import KV_WRITE
from .launch import FastLauncher
from .pdl import allow_dependents, producer_launch, wait_for_previous_kernel
from .quant_per_token import max_keep_nan
from .reference import v_token_major
from eightbit.quant import int8

KV_ABSMAX = tl.constexpr(int8.KV_ABSMAX)  # the attention kernels dequantize in float16


@triton.jit
def _round_half_even(y):
    # torch.round semantics without libdevice (the interpreter has none): floor(y + 0.5),
    # then undo the round-up on exact ties that landed on an odd integer.
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (tl.floor(r * 0.5) * 2.0) != r
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _store_head_rows(
    x,  # [H_PAD, D] float32, already rounded to the input dtype
    cache_ptr, scale_ptr, cache_base, scale_base, stride_ch, stride_cd, stride_sh, rows, cols,
    H: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr,
):
    mask = (rows < H)[:, None]
    if QUANT:
        NG: tl.constexpr = HEAD_DIM // GROUP
        g = tl.reshape(x, (H_PAD, NG, GROUP))
        # [H_PAD, NG]; a NaN in a group gives it a NaN scale, as torch's amax and clamp do
        absmax = tl.minimum(tl.reduce(tl.abs(g), 2, max_keep_nan), KV_ABSMAX, propagate_nan=tl.PropagateNan.ALL)
        exact = tl.math.div_rn(absmax, 127.0)
        scale = exact.to(scale_ptr.dtype.element_ty)
        if scale_ptr.dtype.element_ty.primitive_bitwidth == 16:  # rounded up, as quantize_groups does
            up = (scale.to(tl.int16, bitcast=True) + 1).to(scale_ptr.dtype.element_ty, bitcast=True)
            scale = tl.where(scale.to(tl.float32) < exact, up, scale)
        s = scale.to(tl.float32)
        inv = tl.where(s > 0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(s > 0, s, 1.0)), 0.0)
        qv = _round_half_even(g * inv[:, :, None])
        qv = tl.minimum(tl.maximum(qv, -127.0), 127.0).to(tl.int8)
        qv = tl.reshape(qv, (H_PAD, HEAD_DIM))
        tl.store(cache_ptr + cache_base + rows[:, None] * stride_ch + cols[None, :] * stride_cd, qv, mask=mask)
        gcols = tl.arange(0, NG)
        tl.store(scale_ptr + scale_base + rows[:, None] * stride_sh + gcols[None, :], scale, mask=mask)
    else:
        tl.store(cache_ptr + cache_base + rows[:, None] * stride_ch + cols[None, :] * stride_cd,
                 x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kv_write_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, q_out_ptr, pos_ptr, cos_sin_ptr,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    # strides (elements; head_dim is contiguous everywhere)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_cs,
    stride_kcb, stride_kcp, stride_kch, stride_vcb, stride_vcp, stride_vch, stride_vcd,
    stride_ksb, stride_ksp, stride_ksh, stride_vsb, stride_vsp, stride_vsh,
    # sizes
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    # modes
    ROPE: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr,
):
    allow_dependents(PDL)  # the decode attention after us may start its setup now; it waits for our writes
    wait_for_previous_kernel(PDL)  # launched with PDL behind a GEMM: its output is our input
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, HEAD_DIM)
    kv_rows = tl.arange(0, HKV_PAD)
    kv_mask = (kv_rows < HKV)[:, None]

    k = tl.load(k_ptr + t * stride_kt + kv_rows[:, None] * stride_kh + cols[None, :], mask=kv_mask, other=0.0)
    if ROPE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        j = cols % HALF
        partner = (cols + HALF) % HEAD_DIM
        cos = tl.load(cos_sin_ptr + pos * stride_cs + j).to(tl.float32)[None, :]
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j).to(tl.float32)[None, :]
        sign = tl.where(cols < HALF, -1.0, 1.0)[None, :]
        # queries
        q_rows = tl.arange(0, HQ_PAD)
        q_mask = (q_rows < HQ)[:, None]
        q_base = q_ptr + t * stride_qt + q_rows[:, None] * stride_qh
        qx = tl.load(q_base + cols[None, :], mask=q_mask, other=0.0).to(tl.float32)
        qp = tl.load(q_base + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q_rot = qx * cos + sign * (qp * sin)
        tl.store(q_out_ptr + t * stride_ot + q_rows[:, None] * stride_oh + cols[None, :],
                 q_rot.to(q_out_ptr.dtype.element_ty), mask=q_mask)
        kp = tl.load(k_ptr + t * stride_kt + kv_rows[:, None] * stride_kh + partner[None, :], mask=kv_mask, other=0.0)
        k = (k.to(tl.float32) * cos + sign * (kp.to(tl.float32) * sin)).to(k_ptr.dtype.element_ty)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        _store_head_rows(k.to(tl.float32), k_cache_ptr, k_scale_ptr, blk * stride_kcb + off * stride_kcp,
                         blk * stride_ksb + off * stride_ksp, stride_kch, 1, stride_ksh, kv_rows, cols,
                         HKV, HKV_PAD, HEAD_DIM, GROUP, QUANT)
        v = tl.load(v_ptr + t * stride_vt + kv_rows[:, None] * stride_vh + cols[None, :], mask=kv_mask, other=0.0)
        _store_head_rows(v.to(tl.float32), v_cache_ptr, v_scale_ptr, blk * stride_vcb + off * stride_vcp,
                         blk * stride_vsb + off * stride_vsp, stride_vch, stride_vcd, stride_vsh, kv_rows, cols,
                         HKV, HKV_PAD, HEAD_DIM, GROUP, QUANT)


def _check_cache(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """checks.kv_write, then what the kernel needs on top. Returns (quant, V's token-major view)."""
    quant = checks.kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    d = k.shape[2]
    if d < 16 or d & (d - 1):
        raise ValueError(f"kv_write: head_dim must be a power of two >= 16, got {d}")
    if quant:
        ng = k_scale.shape[-1]
        if ng & (ng - 1):
            raise ValueError(f"kv_write: D // G = {ng} groups must be a power of two")
        if k_scale.stride(-1) != 1 or v_scale.stride(-1) != 1:
            raise ValueError("kv_write: the scales' last dim must be contiguous")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("kv_write: the caches' last dim and head_dim of k and v must be contiguous (stride 1)")
    if not slot_mapping.is_contiguous():
        raise ValueError(f"kv_write: slot_mapping must be a contiguous int32/int64 [T], got strides "
                         f"{slot_mapping.stride()}")
    return quant, v_token_major(k_cache, v_cache)


_launch_rope_kv = FastLauncher(_rope_kv_write_kernel)
# No fused multiply-adds: fused, the rotation and the rounding `floor(x * inv + 0.5)` skip the rounding of the
# product that the reference does, and a few codes in a million came out one off (a rotated value one bf16 ulp
# off, or a product on the other side of a rounding tie)
LAUNCH_OPTIONS = dict(KV_WRITE, enable_fp_fusion=False)


def _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, k_scale, v_scale, slot_mapping, rope):
    quant, vc = _check_cache(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)  # vc: token-major view of V
    t, hkv, d = k.shape
    if rope:
        checks.rope(q, k, positions, cos_sin_cache)
        if q.stride(-1) != 1 or not positions.is_contiguous() or cos_sin_cache.stride(-1) != 1:
            raise ValueError("rope_kv_write: q's head_dim, positions and cos_sin_cache's rows must be contiguous")
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        hq = q.shape[1]
    else:
        q = q_out = positions = cos_sin_cache = k  # unused placeholders
        hq = 1
    if t == 0:
        return q_out if rope else None
    ks = k_scale if quant else k_cache
    vs = v_scale if quant else v_cache
    group = d // k_scale.shape[-1] if quant else d
    pdl, pdl_options = producer_launch(k.device)
    _launch_rope_kv((t,), dict(
        q_ptr=q, k_ptr=k, v_ptr=v, q_out_ptr=q_out, pos_ptr=positions, cos_sin_ptr=cos_sin_cache,
        k_cache_ptr=k_cache, v_cache_ptr=v_cache, k_scale_ptr=ks, v_scale_ptr=vs, slot_ptr=slot_mapping,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_ot=q_out.stride(0), stride_oh=q_out.stride(1), stride_cs=cos_sin_cache.stride(0),
        stride_kcb=k_cache.stride(0), stride_kcp=k_cache.stride(1), stride_kch=k_cache.stride(2),
        stride_vcb=vc.stride(0), stride_vcp=vc.stride(1), stride_vch=vc.stride(2), stride_vcd=vc.stride(3),
        stride_ksb=ks.stride(0), stride_ksp=ks.stride(1), stride_ksh=ks.stride(2),
        stride_vsb=vs.stride(0), stride_vsp=vs.stride(1), stride_vsh=vs.stride(2),
        HQ=hq, HKV=hkv, HQ_PAD=triton.next_power_of_2(hq), HKV_PAD=triton.next_power_of_2(hkv),
        HEAD_DIM=d, GROUP=group, PAGE_SIZE=k_cache.shape[1], ROPE=rope, QUANT=quant, PDL=pdl,
    ), **LAUNCH_OPTIONS, **pdl_options)
    return q_out if rope else None


def rope_kv_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """RoPE on q and k, then k and v into the paged cache (in place). Returns the rotated q (a new tensor)."""
    return _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, k_scale, v_scale, slot_mapping, True)


def kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """Store k, v [T, Hkv, D] at their slots (-1 = skip), group-quantized for an int8 cache. In place."""
    _launch(None, k, v, None, None, k_cache, v_cache, k_scale, v_scale, slot_mapping, False)
