"""The plain-torch reference ops (the CPU backend and the kernels' oracle) against float64 by hand."""

import math

import pytest
import torch

from eightbit.kernels import reference as R
from eightbit.quant.int8 import dequantize_groups, quantize_groups, quantize_per_channel, quantize_per_token


def naive_attention(q, keys, values, first_pos):
    """q [n, Hq, D], keys/values [L, Hkv, D]; causal from first_pos; float64, loops, no tricks."""
    n, hq, d = q.shape
    group = hq // keys.shape[1]
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    for i in range(n):
        for h in range(hq):
            k = keys[: first_pos + i + 1, h // group].double()
            s = (k @ q[i, h].double()) / math.sqrt(d)
            out[i, h] = torch.softmax(s, 0) @ values[: first_pos + i + 1, h // group].double()
    return out


@pytest.mark.parametrize("int8", [False, True])
def test_paged_attention_on_a_poisoned_shuffled_cache(int8):
    torch.manual_seed(0)
    bs, blocks, hkv, hq, d = 4, 12, 2, 6, 16
    k_cache = torch.full((blocks, bs, hkv, d), float("nan"))
    v_cache = k_cache.clone()
    k_scale = v_scale = None
    if int8:  # the int8 V cache is stored key-minor
        k_cache = k_cache.to(torch.int8)
        v_cache = torch.full(R.v_cache_shape(blocks, bs, hkv, d, torch.int8), 77, dtype=torch.int8)
        k_scale = torch.full((blocks, bs, hkv, d // 8), float("nan"), dtype=torch.float16)
        v_scale = k_scale.clone()
    lens = [7, 1, 10]
    tables = torch.randperm(blocks)[:9].view(3, 3).to(torch.int32)  # shuffled blocks, no sharing
    keys, values = [], []  # what attention must see: the written k and v (int8: as the scheme rounds them)
    for b, length in enumerate(lens):
        k, v = torch.randn(length, hkv, d), torch.randn(length, hkv, d)
        slots = torch.tensor([tables[b, p // bs] * bs + p % bs for p in range(length)])
        R.kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slots)
        if int8:
            k, v = dequantize_groups(*quantize_groups(k, 8)), dequantize_groups(*quantize_groups(v, 8))
        keys.append(k)
        values.append(v)
        assert torch.equal(R.gather_kv(k_cache, k_scale, tables[b], length), k)
        assert torch.equal(R.gather_kv(R.v_token_major(k_cache, v_cache), v_scale, tables[b], length), v)
    q = torch.randn(3, hq, d)
    dec = R.decode_attention(q, k_cache, v_cache, k_scale, v_scale, tables, torch.tensor(lens, dtype=torch.int32),
                             d**-0.5)
    for b, length in enumerate(lens):
        ref = naive_attention(q[b : b + 1], keys[b], values[b], length - 1)
        assert torch.allclose(dec[b : b + 1].double(), ref, atol=1e-5)
    # prefill: the last 3 tokens of sequence 2 as a chunk starting mid-block
    chunk = torch.randn(3, hq, d)
    pre = R.prefill_attention(chunk, k_cache, v_cache, k_scale, v_scale, tables[2:], torch.tensor([0, 3]),
                              torch.tensor([10], dtype=torch.int32), d**-0.5)
    assert torch.allclose(pre.double(), naive_attention(chunk, keys[2], values[2], 7), atol=1e-5)


def test_kv_groups_by_hand():
    """scale = group absmax / 127, rounded up to float16; q = round(x / that scale), ties to even, within +-127."""
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5, 2.0, -4.0, 8.0, 1.0]])
    q, scale = quantize_groups(x, 4, torch.float16)
    assert scale.dtype == torch.float16 and scale[0, 0].item() == 1.0
    s = 0.06304931640625  # 8 / 127 = 0.0629921... lies between the float16s 0.06298828125 and this one
    assert scale[0, 1].item() == s
    # 2 / s = 31.72, -4 / s = -63.44, 8 / s = 126.88 (rounded to nearest, 127.008: clamped), 1 / s = 15.86
    assert q.tolist() == [[127, -64, 0, 2, 32, -63, 127, 16]]
    assert torch.equal(dequantize_groups(q, scale), torch.tensor([[127.0, -64.0, 0.0, 2.0, 32 * s, -63 * s, 127 * s,
                                                                   16 * s]]))


def test_kv_groups_saturate_at_65024_by_hand():
    """|x| above 127 * 512 = 65024 saturates: the scale stops at 512 (q * scale stays a finite float16), and q stays
    within +-127, never -128."""
    x = torch.tensor([[1e5, -1e5, 100.0, 0.0], [-7e4, 2048.0, -1024.0, 512.0]])
    q, scale = quantize_groups(x, 4, torch.float16)
    assert scale.tolist() == [[512.0], [512.0]]
    assert q.tolist() == [[127, -127, 0, 0], [-127, 4, -2, 1]]
    back = dequantize_groups(q, scale, torch.float16)
    assert torch.isfinite(back).all() and back.abs().max().item() == 65024.0


def test_int8_kv_write_round_trip_error_is_within_half_a_step():
    """Also for groups far below float16's normal range: their scale rounded to nearest could round down (the
    largest values then clamped: 24 % off at absmax 1e-5) or to 0 (every value stored as 0 below ~4e-6)."""
    x = torch.randn(5, 2, 64) * torch.logspace(-2, 2, 64) * torch.logspace(-8, 0, 10).view(5, 2, 1)
    cache = torch.zeros(2, 4, 2, 64, dtype=torch.int8)
    v_cache = torch.zeros(R.v_cache_shape(2, 4, 2, 64, torch.int8), dtype=torch.int8)
    scale = torch.zeros(2, 4, 2, 2, dtype=torch.float16)
    v_scale = scale.clone()
    R.kv_write(x, -x, cache, v_cache, scale, v_scale, torch.arange(5))
    for c, s, want in ((cache, scale, x), (R.v_token_major(cache, v_cache), v_scale, -x)):
        back = dequantize_groups(c.reshape(-1, 2, 64)[:5], s.view(-1, 2, 2)[:5])
        step = s.view(-1, 2, 2)[:5].float().repeat_interleave(32, -1)
        assert ((back - want).abs() <= 0.5 * step * 1.001).all() and (step > 0).all()
    assert torch.equal(v_cache[0, 1, :, 3], R.quantize_groups(-x[3], 32, torch.float16)[0][1])  # key-minor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_per_token_and_per_channel_quantization_by_hand(dtype):
    """scale = absmax / 127 in float32; q = round(x * 127 / absmax), ties to even (torch.round), within +-127."""
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5, -2.5, 0.49],  # absmax 127: q = round(x), ties to even
                      [0.0] * 6,  # all zero: scale 0 and q 0, no division by zero
                      [-0.5, -0.25, 0.1, -0.003, 0.001, 0.002]], dtype=dtype)  # absmax 0.5: q = round(254 x)
    want_q = torch.tensor([[127, -64, 0, 2, -2, 0], [0] * 6, [-127, -64, 25, -1, 0, 1]], dtype=torch.int8)
    want_scale = torch.tensor([[1.0], [0.0], [0.5 / 127]])
    for quantize in (quantize_per_token, quantize_per_channel):
        q, scale = quantize(x)
        assert torch.equal(q, want_q) and scale.dtype == torch.float32
        torch.testing.assert_close(scale, want_scale, rtol=1e-7, atol=0)
    q3, s3 = quantize_per_token(x.view(3, 1, 6))  # [..., K]: one scale per row of any leading shape
    assert torch.equal(q3, want_q.view(3, 1, 6)) and torch.equal(s3, quantize_per_token(x)[1].view(3, 1, 1))
    for bad in (x.view(3, 1, 6), x[0]):
        with pytest.raises(ValueError, match=r"expected a 2-D weight, got shape \("):
            quantize_per_channel(bad)


def test_quantization_of_rows_too_small_for_127_over_absmax():
    """127 / absmax overflows float32 below ~3.7e-37: such rows still get q = round(127 x / absmax), by hand."""
    w = torch.tensor([[3e-38, 0.0, -1e-38, 2e-38], [1e-40, 5e-41, 0.0, -1e-40]])  # the second row is subnormal
    q, scale = quantize_per_channel(w)
    assert torch.equal(q, torch.tensor([[127, 0, -42, 85], [127, 64, 0, -127]], dtype=torch.int8))
    torch.testing.assert_close(scale, w.abs().amax(1, keepdim=True) / 127, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("m, n, k", [(3, 5, 1), (1, 4, 1), (2, 3, 2), (17, 8, 1), (1, 3, 0), (2, 5, 3000)])
def test_int8_matmul_is_exact_at_any_k(m, n, k, precision):
    """Against int64 arithmetic. K = 3000 with every value -128: sums of 2^14 * 3000, past float32's 2^24 (the
    CPU path adds float32 chunks of 1024 in int32); with float32 matmuls in bfloat16 ("medium") the reference
    must not use them."""
    g = torch.Generator().manual_seed(m * 100 + n + k)
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    if k == 3000:
        a[0], b[0] = -128, -128
        b[1] = 127
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert R._fp32_matmul_is_ieee() == (precision == "highest")
        got = R._int8_matmul(a, b)
    finally:
        torch.set_float32_matmul_precision(saved)
    want = a.long().matmul(b.long().t())
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    if k == 3000:
        assert want[0, 0] == 2**14 * 3000


def test_rms_norm_and_int8_gemm_by_hand():
    x = torch.tensor([[3.0, 4.0]])
    out, res = R.rms_norm(x, torch.tensor([1.0, 2.0]), 0.0, residual=torch.tensor([[1.0, 0.0]]))
    assert torch.equal(res, torch.tensor([[4.0, 4.0]]))
    assert torch.allclose(out, torch.tensor([[1.0, 2.0]]))
    a = torch.tensor([[-128, 127, 5]], dtype=torch.int8)
    w = torch.tensor([[-128, -128, 1], [2, 0, -3]], dtype=torch.int8)
    got = R.int8_gemm(a, torch.tensor([[0.5]]), w, torch.tensor([1.0, 2.0]), torch.tensor([1.0, -1.0]),
                      torch.float32)
    assert torch.equal(got, torch.tensor([[(16384 - 16256 + 5) * 0.5 + 1, (-256 - 15) * 0.5 * 2 - 1]]))


def test_the_cpu_backend_refuses_what_the_kernels_refuse():
    """No broadcasting of a scale, bias or residual, and no float values stored into an int8 cache unscaled."""
    xq, wq = torch.ones(4, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"x_scale must be a \[4\]"):
        R.int8_gemm(xq, torch.ones(1), wq, torch.ones(8))
    with pytest.raises(ValueError, match=r"bias must be a \[8\]"):
        R.int8_gemm(xq, torch.ones(4), wq, torch.ones(8), bias=torch.ones(1))
    with pytest.raises(ValueError, match="residual shape"):
        R.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5, residual=torch.ones(1, 8))
    with pytest.raises(ValueError, match="weight must have shape"):
        R.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-5)
    kc = torch.zeros(2, 4, 1, 16, dtype=torch.int8)
    vc = torch.zeros(R.v_cache_shape(2, 4, 1, 16, torch.int8), dtype=torch.int8)
    k = torch.randn(3, 1, 16)
    with pytest.raises(ValueError, match="an int8 cache needs k_scale and v_scale"):
        R.kv_write(k, k, kc, vc, None, None, torch.arange(3))
    assert not kc.any()  # nothing stored


def test_a_grown_scratch_buffer_keeps_the_old_one_alive():
    """A captured CUDA graph keeps the address of the buffer it used: growing must not free it."""
    from eightbit.kernels import scratch

    cache, dev = {}, torch.device("cpu")
    small = scratch.zeroed_scratch(cache, dev, 10, 16, "test buffer")
    assert small.numel() == 16 and not small.any()
    assert scratch.zeroed_scratch(cache, dev, 12, 16, "test buffer") is small  # large enough: the same one
    big = scratch.zeroed_scratch(cache, dev, 100, 16, "test buffer")
    assert big.numel() == 100 and not big.any() and any(b is small for b in scratch._RETIRED)


def test_rotary_by_hand():
    """Rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos | sin per position in the cache's columns."""
    cos_sin = torch.tensor([[1.0, 1.0, 0.0, 0.0],  # position 0: angle 0
                            [0.0, 0.6, 1.0, 0.8]])  # position 1: 90 degrees for pair 0, cos .6 / sin .8 for pair 1
    q = torch.tensor([[[1.0, 2.0, 3.0, 4.0]], [[1.0, 2.0, 3.0, 4.0]]])  # [T=2, Hq=1, D=4]
    k = q.clone() * 2
    qr, kr = R.rotary(q, k, torch.tensor([0, 1]), cos_sin)
    assert torch.equal(qr[0], q[0]) and torch.equal(kr[0], k[0])
    want = torch.tensor([1 * 0 - 3 * 1, 2 * 0.6 - 4 * 0.8, 3 * 0 + 1 * 1, 4 * 0.6 + 2 * 0.8])
    torch.testing.assert_close(qr[1, 0], want)
    torch.testing.assert_close(kr[1, 0], 2 * want)


def test_silu_mul_by_hand():
    """gate first, then up: silu(g) * u = g / (1 + e^-g) * u."""
    gu = torch.tensor([[1.0, -2.0, 2.0, 3.0]])  # gate [1, -2], up [2, 3]
    want = torch.tensor([[1 / (1 + math.exp(-1)) * 2, -2 / (1 + math.exp(2)) * 3]])
    torch.testing.assert_close(R.silu_mul(gu), want, rtol=1e-6, atol=0)
    q, s = R.silu_mul_quant(gu)
    torch.testing.assert_close(s, want.abs().amax(-1, keepdim=True) / 127, rtol=1e-6, atol=0)


def test_rms_norm_eps_by_hand():
    """eps inside the root: x = (3, 4), mean of squares 12.5, eps 7.5 -> x / sqrt(20) * w."""
    out, res = R.rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), 7.5)
    assert res is None
    torch.testing.assert_close(out, torch.tensor([[3 / math.sqrt(20), 8 / math.sqrt(20)]]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_attention_uses_the_softmax_scale_it_is_given(op):
    """Two keys, scores (1, 2) * scale, values e0 and e1: the output is softmax(scale * (1, 2)) by hand, for a scale
    that is not head_dim ** -0.5."""
    d, scale = 16, 0.7
    k_cache = torch.zeros(1, 4, 1, d)
    v_cache = torch.zeros(1, 4, 1, d)
    k_cache[0, 0, 0, 0], k_cache[0, 1, 0, 0] = 1.0, 2.0
    v_cache[0, 0, 0, 0], v_cache[0, 1, 0, 1] = 1.0, 1.0
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    if op == "decode":
        out = R.decode_attention(q, k_cache, v_cache, None, None, table, lens, scale)
    else:
        out = R.prefill_attention(q, k_cache, v_cache, None, None, table, torch.tensor([0, 1]), lens, scale)
    p1 = 1 / (1 + math.exp(-scale))  # weight of key 1: e^{2s} / (e^s + e^{2s})
    torch.testing.assert_close(out[0, 0, :2], torch.tensor([1 - p1, p1]), rtol=1e-6, atol=1e-7)


def test_reference_dequantize_blocks_holds_each_sequences_tokens():
    g = torch.Generator().manual_seed(6)
    page, hkv, d, nblocks = 4, 2, 16, 8
    k_cache = torch.zeros(nblocks, page, hkv, d, dtype=torch.int8)
    v_cache = torch.zeros(R.v_cache_shape(nblocks, page, hkv, d, torch.int8), dtype=torch.int8)
    k_scale = torch.zeros(nblocks, page, hkv, d // 8, dtype=torch.float16)
    v_scale = k_scale.clone()
    table = torch.tensor([[5, 2, 7], [0, 3, -1]], dtype=torch.int32)
    lens = torch.tensor([10, 5], dtype=torch.int32)  # 2.5 and 1.25 blocks: partial last blocks
    want = []
    for b, length in enumerate(lens.tolist()):
        k, v = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, d, generator=g)
        slots = torch.tensor([int(table[b, p // page]) * page + p % page for p in range(length)])
        R.kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slots)
        want.append((dequantize_groups(*quantize_groups(k, 8)), dequantize_groups(*quantize_groups(v, 8))))
    kc, vc, tab = R.dequantize_blocks(k_cache, v_cache, k_scale, v_scale, table, lens, torch.float32)
    assert torch.equal(tab, torch.arange(6, dtype=torch.int32).view(2, 3))
    for b, length in enumerate(lens.tolist()):
        assert torch.equal(kc[3 * b: 3 * b + 3].flatten(0, 1)[:length], want[b][0])
        assert torch.equal(vc[3 * b: 3 * b + 3].flatten(0, 1)[:length], want[b][1])
