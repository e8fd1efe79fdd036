"""Symmetric int8 quantization math in plain PyTorch.

This is the definition of every int8 format eightbit uses; the Triton kernels
must reproduce it (up to a rounding tie). All arithmetic is float32:

    scale = absmax / 127            (absmax over the reduced elements)
    q     = round(x * (127 / absmax)), clamped to [-127, 127]
    x    ~= q * scale

An all-zero row or group gets scale 0 and q 0 (no division by zero). -128 is
never produced, but every consumer must accept it in its inputs. Rows whose absmax is
below 2^-100 are rescaled by 2^100 (exact) before the division, where 127 / absmax would
overflow; the GPU kernels skip that (such a row dequantizes to within 1e-30 either way).

The KV cache's groups (quantize_groups) cap absmax at KV_ABSMAX = 127 * 512 = 65024: the
attention kernels dequantize in float16, and with scale <= 512 every q * scale fits it.
Larger magnitudes (no bf16 model's keys or values come near) saturate there. Their float16 scale is
rounded up, not to nearest, so |x / scale| <= 127 holds: rounded down, a group below float16's
normal range (absmax < 2^-14 * 127 ~ 2e-3) lost its largest values to the clamp, and one below
~4e-6 got scale 0, every value stored as 0.
"""

import torch

QMAX = 127.0
KV_ABSMAX = 65024.0  # 127 * 512: the largest group absmax whose dequantized values all fit float16


TINY_ABSMAX = 2.0**-100  # below ~3.7e-37, 127 / absmax overflows float32


def _quantize(x: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    # rows of tiny magnitude are scaled up by a power of two first (exact), so q is what the formula says; the
    # check is on absmax (one value a row), so ordinary inputs pay no pass over x
    tiny = (absmax > 0) & (absmax < TINY_ABSMAX)
    if tiny.any():
        x = torch.where(tiny, x * 2.0**100, x)
        absmax = torch.where(tiny, absmax * 2.0**100, absmax)
    inv = torch.where(absmax > 0, QMAX / absmax, torch.zeros_like(absmax))
    return torch.round(x * inv).clamp_(-QMAX, QMAX).to(torch.int8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (int8 [..., K], float32 scale [..., 1]); one scale per row."""
    xf = x.float()
    if xf.shape[-1] == 0:  # empty rows: scale 0, as the kernels give
        return xf.to(torch.int8), xf.new_zeros(*xf.shape[:-1], 1)
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    return _quantize(xf, absmax), absmax / QMAX


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [N, K] -> (int8 [N, K], float32 scale [N, 1]); one scale per output channel."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    return quantize_per_token(w)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of the per-token / per-channel quantizers (scale broadcasts over the last dim)."""
    return (q.float() * scale.float()).to(dtype)


def quantize_groups(
    x: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], scale [..., D // group_size]) in groups along the last dim.

    The scale is rounded up to `scale_dtype` first and q is computed from the rounded
    scale, so dequantization uses exactly the scale that quantization divided by.
    """
    d = x.shape[-1]
    if d % group_size:
        raise ValueError(f"group size {group_size} does not divide the last dimension {d}")
    g = x.float().unflatten(-1, (d // group_size, group_size))
    exact = g.abs().amax(dim=-1).clamp(max=KV_ABSMAX) / QMAX
    scale = exact.to(scale_dtype)
    if scale.element_size() == 2:  # float16 / bfloat16: one step up where rounding went down
        up = (scale.view(torch.int16) + 1).view(scale_dtype)
        scale = torch.where(scale.float() < exact, up, scale)
    s = scale.float().unsqueeze(-1)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round(g * inv).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.flatten(-2), scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_groups: q [..., D], scale [..., D // G] -> [..., D]."""
    d = q.shape[-1]
    groups = scale.shape[-1]
    g = q.float().unflatten(-1, (groups, d // groups)) * scale.float().unsqueeze(-1)
    return g.flatten(-2).to(dtype)
