"""Triton attention kernels (kv_write, prefill, decode) against kernels/reference.py.

CPU (CI): the kernels run under TRITON_INTERPRET=1 on fp16/fp32 tensors (the interpreter
mishandles bf16). GPU (`pytest -m gpu`): the same kernels compiled, bf16, checked by the
FlashAttention rule: max error vs a float64 reference on the dequantized cache must be at
most 2x that of a plain-torch bf16 implementation of the same math, plus a small atol.
"""

import pytest
import torch
import triton
import triton.language as tl

from eightbit.kernels import reference as R
from eightbit.kernels import decode_attention as dmod
from eightbit.kernels import prefill_attention as pmod
from eightbit.kernels.decode_attention import decode_attention, decode_attention_splits
from eightbit.kernels.kv_write import kv_write, rope_kv_write
from eightbit.kernels.launch import interpreting
from eightbit.kernels.prefill_attention import prefill_attention
from eightbit.quant.int8 import quantize_groups

INTERPRET = interpreting()
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests run the kernels under TRITON_INTERPRET=1")
gpu = pytest.mark.gpu


# --- helpers -------------------------------------------------------------------------------


def cos_sin(max_pos, d, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat([f.cos(), f.sin()], dim=-1)


def empty_cache(num_blocks, page, hkv, d, dtype, group, device="cpu"):
    """A poisoned cache: int8 values 77 with NaN scales (V key-minor), or NaN floats."""
    if dtype == torch.int8:
        kc = torch.full((num_blocks, page, hkv, d), 77, dtype=torch.int8, device=device)
        vc = torch.full(R.v_cache_shape(num_blocks, page, hkv, d, dtype), 77, dtype=torch.int8, device=device)
        ks = torch.full((num_blocks, page, hkv, d // group), float("nan"), dtype=torch.float16, device=device)
        return kc, vc, ks, ks.clone()
    kc = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype, device=device)
    return kc, kc.clone(), None, None


class Scenario:
    """Sequences in a shuffled paged cache: (seq_len, n_queries) each, optional shared prefix.

    Fills every live slot through the reference kv_write (so the cache holds exactly what the
    engine would); everything else stays poisoned (NaN), and unused table entries are -1.
    """

    def __init__(self, seqs, hq, hkv, d, cache_dtype, group, page=16, share_prefix_blocks=0,
                 device="cpu", extra_blocks=3, seed=0, k_mult=1.0, v_mult=1.0):
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.hq, self.hkv, self.d, self.page = seqs, hq, hkv, d, page
        nblk = [-(-s // page) for s, _ in seqs]
        max_blocks = max(nblk) + 2
        total = sum(nblk) + extra_blocks
        perm = torch.randperm(total, generator=g).tolist()  # a random permutation of the blocks
        table = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
        nxt = 0
        for b, n in enumerate(nblk):
            for j in range(n):
                if b > 0 and j < share_prefix_blocks and j < nblk[0]:
                    table[b, j] = table[0, j]  # shared prefix: same physical blocks
                else:
                    table[b, j] = perm[nxt]
                    nxt += 1
        self.block_tables = table.to(device)
        self.caches = empty_cache(total, page, hkv, d, cache_dtype, group, device)
        # fill: shared blocks must hold the same tokens, so draw k/v per (physical slot)
        kv_dtype = torch.float32 if cache_dtype == torch.int8 else cache_dtype
        slots = []
        seen = set()
        for b, (s, _) in enumerate(seqs):
            for p in range(s):
                slot = int(table[b, p // page]) * page + p % page
                if slot in seen:
                    continue
                seen.add(slot)
                slots.append(slot)
        n = len(slots)
        k = (torch.randn(n, hkv, d, generator=g) * k_mult).to(kv_dtype).to(device)
        v = (torch.randn(n, hkv, d, generator=g) * v_mult).to(kv_dtype).to(device)
        R.kv_write(k, v, *self.caches, torch.tensor(slots, dtype=torch.int64, device=device))
        self.seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device)
        nq = torch.tensor([q for _, q in seqs])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(nq, 0)
        self.cu = cu.to(device)
        self.T = int(cu[-1])


def poison_block_zero(sc):
    """Renumber sc's blocks from 1 and put an unused poisoned block at 0: the Gluon prefill copies the pages past a
    sequence's end from physical block 0."""
    sc.caches = tuple(None if c is None else torch.cat([torch.full_like(c[:1], float("nan") if c.is_floating_point()
                                                                        else 77), c]) for c in sc.caches)
    sc.block_tables = torch.where(sc.block_tables >= 0, sc.block_tables + 1, sc.block_tables)


def poison_alloc(monkeypatch):
    """Make the wrappers' output allocations NaN-filled, so unwritten elements show up."""
    orig_empty_like, orig_empty = torch.empty_like, torch.empty

    def empty_like(*a, **kw):
        return orig_empty_like(*a, **kw).fill_(float("nan"))

    def empty(*a, **kw):
        x = orig_empty(*a, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(pmod.torch, "empty_like", empty_like)
    monkeypatch.setattr(dmod.torch, "empty", empty)


def close(out, ref, tol):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned read)"
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol}"


TOL = {torch.float16: 4e-3, torch.float32: 2e-5}

# --- kv_write / rope_kv_write (CPU) ----------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("cache", ["int8-32", "int8-d", "float"])
@pytest.mark.parametrize("d,hq,hkv", [(64, 12, 3), (128, 8, 8)])
def test_rope_kv_write_matches_reference(dtype, cache, d, hq, hkv):
    g = torch.Generator().manual_seed(1)
    t, page, nb = 29, 16, 6
    group = 32 if cache == "int8-32" else d
    cache_dtype = torch.int8 if cache.startswith("int8") else dtype
    # q, k, v as strided views of one fused qkv row (as the engine's QKV GEMM produces)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    k[4, 0, :group] = 0  # an all-zero group: scale 0, q 0
    pos = torch.randint(0, 300, (t,), generator=g)
    cs = cos_sin(512, d)
    slots = torch.randperm(nb * page, generator=g)[:t]
    slots[[3, 17]] = -1
    q_before = q.clone()
    mine, ref = empty_cache(nb, page, hkv, d, cache_dtype, group), empty_cache(nb, page, hkv, d, cache_dtype, group)
    q_rot = rope_kv_write(q, k, v, pos, cs, *mine, slots)
    q_ref = R.rope_kv_write(q, k, v, pos, cs, *ref, slots)
    assert torch.equal(q, q_before), "q must not be modified (the rotated q is a new tensor)"
    torch.testing.assert_close(q_rot, q_ref, rtol=0, atol=0 if dtype == torch.float32 else 1e-3)
    for a, b in zip(mine, ref):
        if a is not None:  # identical, poison (NaN) included where nothing was written
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.int8 else a.nan_to_num(123.0),
                               b.view(torch.uint8) if b.dtype == torch.int8 else b.nan_to_num(123.0))


@cpu_only
@pytest.mark.parametrize("cache", ["int8-8", "int8-32", "fp16", "fp32"])
def test_kv_write_matches_reference(cache):
    g = torch.Generator().manual_seed(2)
    t, hkv, d, page, nb = 21, 3, 64, 8, 5
    dtype = torch.float32 if cache == "fp32" else torch.float16
    cache_dtype = torch.int8 if cache.startswith("int8") else dtype
    group = int(cache.split("-")[1]) if cache.startswith("int8") else d
    k = (torch.randn(t, hkv, d, generator=g) * 5).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    v[0] = 0
    if cache_dtype == torch.int8:
        k[1, 0, 3] = 1e5 if dtype == torch.float32 else 6e4  # saturates at KV_ABSMAX (fp32) / stays under it
    slots = torch.randperm(nb * page, generator=g)[:t].int()
    slots[0] = -1
    mine, ref = empty_cache(nb, page, hkv, d, cache_dtype, group), empty_cache(nb, page, hkv, d, cache_dtype, group)
    kv_write(k, v, *mine, slots)
    R.kv_write(k, v, *ref, slots)
    for a, b in zip(mine, ref):
        if a is not None:
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.int8 else a.nan_to_num(123.0),
                               b.view(torch.uint8) if b.dtype == torch.int8 else b.nan_to_num(123.0))


@triton.jit
def _i8_to_kernel(x_ptr, out_ptr, DTYPE: tl.constexpr, COMPILED: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, pmod.i8_to(tl.load(x_ptr + offs), DTYPE, COMPILED))


def _check_i8_to(dtype, device):
    """Every int8 value (the -128 edge included) converts exactly."""
    x = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)[torch.randperm(256)].to(device)
    out = torch.full((256,), float("nan"), dtype=dtype, device=device)
    _i8_to_kernel[(1,)](x, out, DTYPE=tl.float16 if dtype == torch.float16 else tl.float32, COMPILED=not INTERPRET)
    assert torch.equal(out, x.to(dtype))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_i8_to_is_exact_for_every_byte(dtype):
    _check_i8_to(dtype, "cpu")  # the interpreter's plain conversion


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_i8_to_is_exact_for_every_byte(dtype):
    _check_i8_to(dtype, "cuda")  # compiled: the byte-permute PTX for float16


def test_kv_group_absmax_is_capped_for_float16():
    """Groups past KV_ABSMAX saturate there, so every dequantized value fits float16."""
    from eightbit.quant.int8 import KV_ABSMAX, dequantize_groups

    x = torch.tensor([[1e6, -3.0, 2.0, 0.5], [-7e4, 1.0, 0.0, 0.0], [6e4, 1.0, 0.0, 0.0]])
    q, s = quantize_groups(x, 4, torch.float16)
    back = dequantize_groups(q, s)
    assert back[0, 0] == KV_ABSMAX and back[1, 0] == -KV_ABSMAX
    assert abs(back[2, 0] - 6e4) < 1e-3 * 6e4  # under the cap: quantized as before
    assert torch.isfinite(back.half()).all()


@cpu_only
def test_kv_write_gives_a_group_holding_a_nan_a_nan_scale_as_the_reference():
    k = torch.randn(3, 2, 64, dtype=torch.float16)
    k[1, 0, 40] = float("nan")  # token 1, head 0, group 1
    out = [empty_cache(1, 16, 2, 64, torch.int8, 32) for _ in range(2)]
    slots = torch.arange(3)
    kv_write(k, k.abs(), *out[0], slots)
    R.kv_write(k, k.abs(), *out[1], slots)
    ks, ks_ref = out[0][2][0, :3], out[1][2][0, :3]  # [token, head, group]
    assert torch.isnan(ks[1, 0, 1]) and torch.isnan(ks_ref[1, 0, 1])
    nan = torch.zeros_like(ks, dtype=torch.bool)
    nan[1, 0, 1] = True
    assert torch.equal(ks[~nan], ks_ref[~nan])


def test_kv_write_rejects_bad_inputs():
    k = torch.randn(4, 2, 64, dtype=torch.float16)
    kc, vc, ks, vs = empty_cache(2, 16, 2, 64, torch.int8, 32)
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="needs k_scale"):
        kv_write(k, k, kc, vc, None, None, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_write(k, k, kc, vc, ks, vs, slots.float())
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous"):  # a column: other rows' slots
        kv_write(k, k, kc, vc, ks, vs, torch.stack([slots, slots + 8], 1)[:, 0])
    with pytest.raises(ValueError, match="heads/head_dim"):
        kv_write(torch.randn(4, 3, 64, dtype=torch.float16), torch.randn(4, 3, 64, dtype=torch.float16),
                 kc, vc, ks, vs, slots)
    with pytest.raises(ValueError, match=r"int8 V cache is \[num_blocks, Hkv, D, block_size\]"):
        kv_write(k, k, kc, kc.clone(), ks, vs, slots)  # a token-major int8 V cache
    before = [x.clone() for x in (kc, vc, ks, vs)]
    with pytest.raises(ValueError, match="v_cache must be"):
        kv_write(k, k, kc, vc.float(), ks, vs, slots)
    assert all(torch.equal(a.nan_to_num(1.0), b.nan_to_num(1.0)) for a, b in zip((kc, vc, ks, vs), before))


# --- prefill (CPU) -----------------------------------------------------------------------------

# (seq_len, n_queries): a chunk starting mid-block at the end of a long context (many blocks);
# length 1; odd full prefill; a 1-query chunk deep in a context; a two-tile full prefill.
# Sequences after the first share its first blocks (prefix caching).
SEQS = [(200, 45), (1, 1), (37, 37), (131, 1), (150, 150)]

PREFILL_CASES = [
    # dtype, cache, d, hq, hkv, page
    (torch.float16, "int8-32", 64, 4, 4, 16),
    (torch.float16, "int8-d", 128, 12, 3, 16),
    (torch.float32, "int8-32", 128, 8, 1, 16),
    (torch.float16, "fp16", 64, 8, 2, 16),
    (torch.float32, "fp32", 128, 6, 2, 32),
    (torch.float16, "int8-32", 64, 16, 2, 8),
]


def _cache_args(cache, d, dtype):
    if cache.startswith("int8"):
        return torch.int8, (32 if cache == "int8-32" else d)
    return {"fp16": torch.float16, "fp32": torch.float32}[cache], d


@cpu_only
@pytest.mark.parametrize("dtype,cache,d,hq,hkv,page", PREFILL_CASES)
def test_prefill_matches_reference(monkeypatch, dtype, cache, d, hq, hkv, page):
    cache_dtype, group = _cache_args(cache, d, dtype)
    sc = Scenario(SEQS, hq, hkv, d, cache_dtype, group, page=page, share_prefix_blocks=2, seed=hq + d)
    q = torch.randn(sc.T, hq, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    poison_alloc(monkeypatch)
    scale = d ** -0.5
    out = prefill_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, scale)
    ref = R.prefill_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, scale)
    close(out, ref, TOL[dtype])


@cpu_only
@pytest.mark.parametrize("dtype,cache,d,hq,hkv,page", [PREFILL_CASES[1], PREFILL_CASES[3], PREFILL_CASES[4]])
def test_prefill_long_prompt_configs_match_reference(monkeypatch, dtype, cache, d, hq, hkv, page):
    """The long-prompt launch table (bigger tiles, more stages) gives the same answers; the threshold is
    lowered so that these small sequences take it, and the configs the kernel got are checked."""
    from eightbit.kernels import attention_configs as C

    monkeypatch.setattr(C, "LONG_PREFILL_TOKENS", 1)
    used = []
    real = pmod.prefill_config

    def recording(*args):
        cfg = real(*args)
        used.append(dict(cfg))  # the launcher pops the block sizes out of cfg
        return cfg

    monkeypatch.setattr(pmod, "prefill_config", recording)
    cache_dtype, group = _cache_args(cache, d, dtype)
    sc = Scenario(SEQS, hq, hkv, d, cache_dtype, group, page=page, share_prefix_blocks=2, seed=hq + d)
    q = torch.randn(sc.T, hq, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    scale = d ** -0.5
    out = prefill_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, scale)
    assert used == [C.PREFILL_LONG[(d, "int8" if cache_dtype == torch.int8 else "float")]]
    close(out, R.prefill_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, scale), TOL[dtype])


@cpu_only
@pytest.mark.parametrize("dtype,d,hkv,page,group", [(torch.float16, 64, 3, 16, 32), (torch.float32, 128, 2, 8, 128)])
def test_dequantize_blocks_matches_reference(monkeypatch, dtype, d, hkv, page, group):
    """kv_dequant's kernel writes each sequence's live blocks (stale slots of a last block included, NaN here)
    exactly as the reference does, and nothing else: the blocks past a sequence's end keep a sentinel (their
    block-table entries are -1, so a read through one would also show)."""
    from eightbit.kernels import kv_dequant
    from eightbit.kernels.kv_dequant import dequantize_blocks

    sc = Scenario([(200, 1), (1, 1), (37, 37), (0, 0), (131, 5)], hkv, hkv, d, torch.int8, group, page=page,
                  share_prefix_blocks=2, seed=d)
    args = (*sc.caches, sc.block_tables, sc.seq_lens, dtype)
    real_empty_like = torch.empty_like
    monkeypatch.setattr(kv_dequant.torch, "empty", lambda *a, **kw: torch.full(*a, 1234.0, **kw))
    monkeypatch.setattr(kv_dequant.torch, "empty_like", lambda x: real_empty_like(x).fill_(1234.0))
    k, v, table = dequantize_blocks(*args)
    monkeypatch.undo()
    rk, rv, rtable = R.dequantize_blocks(*args)
    width = sc.block_tables.shape[1]
    assert table.dtype == torch.int32 and torch.equal(table, rtable)
    assert k.shape == rk.shape == (len(sc.seqs) * width, page, hkv, d) and k.dtype == dtype
    for b, (length, _) in enumerate(sc.seqs):
        live = slice(b * width, b * width + -(-length // page))
        torch.testing.assert_close(k[live], rk[live], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v[live], rv[live], rtol=0, atol=0, equal_nan=True)
        rest = slice(live.stop, (b + 1) * width)
        assert (k[rest] == 1234.0).all() and (v[rest] == 1234.0).all()
        assert torch.isfinite(k[live].flatten(0, 1)[:length]).all()  # the sequence's own tokens
        assert torch.isfinite(v[live].flatten(0, 1)[:length]).all()


@cpu_only
def test_prefill_int64_metadata_and_empty_sequence():
    sc = Scenario([(40, 0), (33, 9), (5, 5)], 4, 2, 64, torch.int8, 32, seed=3)
    q = torch.randn(sc.T, 4, 64, dtype=torch.float16)
    args = (sc.block_tables.long(), sc.cu.long(), sc.seq_lens.long(), 0.1)
    out = prefill_attention(q, *sc.caches, *args)
    close(out, R.prefill_attention(q, *sc.caches, *args), TOL[torch.float16])


@cpu_only
@pytest.mark.parametrize("cache", ["fp16", "int8-32"])
def test_prefill_in_a_graphs_layout_skips_empty_slots(monkeypatch, cache):
    """The layout of a prefill CUDA graph (engine/cuda_graphs.py, PrefillGraphs): the real sequences, then empty
    slots (no new tokens, length 0) whose block-table rows hold a previous step's entries, then a padding sequence
    over block 0. The real rows must be what the real sequences alone give: no tile may read an empty slot's row
    (here out-of-range block ids, which a read would fault on or turn into garbage)."""
    cache_dtype, group = _cache_args(cache, 64, torch.float16)
    sc = Scenario([(40, 5), (9, 9), (70, 3)], 4, 2, 64, cache_dtype, group, seed=11)
    slots, t, n = 8, 32, sc.T
    tables = torch.zeros(slots + 1, sc.block_tables.shape[1], dtype=torch.int32)
    tables[:3] = sc.block_tables
    tables[3:slots] = 10**8  # stale entries of the unused slots
    seq_lens = torch.tensor(sc.seq_lens.tolist() + [0] * (slots - 3) + [t - n], dtype=torch.int32)
    cu = torch.tensor(sc.cu.tolist() + [n] * (slots - 3) + [t], dtype=torch.int32)
    q = torch.randn(t, 4, 64, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    poison_alloc(monkeypatch)
    out = prefill_attention(q, *sc.caches, tables, cu, seq_lens, 0.125)
    close(out[:n], R.prefill_attention(q[:n], *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, 0.125),
          TOL[torch.float16])


# --- decode (CPU) ------------------------------------------------------------------------------

DECODE_SEQS = [(300, 1), (1, 1), (37, 1), (64, 1), (129, 1)]


def decode_ref(q, kc, vc, ks, vs, block_tables, seq_lens, scale):
    """R.decode_attention gathers whole blocks, so the poisoned (NaN) slots past a sequence's end reach
    its 0 * NaN; the per-sequence reference (one query each) reads only the live keys."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return R.prefill_attention(q, kc, vc, ks, vs, block_tables, cu, seq_lens, scale)


@cpu_only
@pytest.mark.parametrize("dtype,cache,d,hq,hkv,page", PREFILL_CASES)
@pytest.mark.parametrize("splits", [None, 1, 3, 37])
def test_decode_matches_reference(monkeypatch, dtype, cache, d, hq, hkv, page, splits):
    monkeypatch.setattr(dmod, "REDUCE_CHUNK", 2)  # the reduce loop merges the non-empty splits over several steps
    cache_dtype, group = _cache_args(cache, d, dtype)
    sc = Scenario(DECODE_SEQS, hq, hkv, d, cache_dtype, group, page=page, share_prefix_blocks=1, seed=hq * d)
    q = torch.randn(len(DECODE_SEQS), hq, d, generator=torch.Generator().manual_seed(6)).to(dtype)
    poison_alloc(monkeypatch)
    out = decode_attention_splits(q, *sc.caches, sc.block_tables, sc.seq_lens, 0.11, splits)
    ref = decode_ref(q, *sc.caches, sc.block_tables, sc.seq_lens, 0.11)
    close(out, ref, TOL[dtype])


@cpu_only
def test_decode_padded_slot_gives_zeros_and_default_signature(monkeypatch):
    monkeypatch.setattr(dmod, "REDUCE_CHUNK", 2)
    sc = Scenario([(20, 1), (1, 1), (70, 1)], 8, 2, 64, torch.int8, 32, seed=9)
    seq_lens = sc.seq_lens.clone()
    seq_lens[1] = 0  # a padded batch slot (CUDA-graph bucket)
    q = torch.randn(3, 8, 64, dtype=torch.float16)
    for splits in (1, 4, 40):  # 40: most splits empty; merged 2 at a time
        out = decode_attention_splits(q, *sc.caches, sc.block_tables, seq_lens, 0.125, splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = decode_ref(q, *sc.caches, sc.block_tables, sc.seq_lens, 0.125)
        close(out[[0, 2]], ref[[0, 2]], TOL[torch.float16])
    out = decode_attention(q, *sc.caches, sc.block_tables, sc.seq_lens, 0.125)
    close(out, decode_ref(q, *sc.caches, sc.block_tables, sc.seq_lens, 0.125), TOL[torch.float16])
    # the batched reference (the CPU backend) gives the kernels' zeros for the padded slot too, not NaN
    assert torch.equal(R.decode_attention(q, *sc.caches, sc.block_tables, seq_lens, 0.125)[1], torch.zeros_like(out[1]))


@cpu_only
def test_decode_first_split_call_launches_every_merge_chunk(monkeypatch):
    """The merge kernel's chunk fits the split count (4, 16 or 128 splits per step). The first split call of a
    shape launches every chunk (each computing the same output), so a later split count compiles nothing
    mid-run; later calls launch their own chunk only, with its launch options. Every call still matches the
    reference."""
    from eightbit.kernels import attention_configs as C

    assert [dmod.merge_chunk(s) for s in (2, 4, 5, 16, 17, 33, 128, 300)] == [4, 4, 16, 16, 128, 128, 128, 128]
    warps = {chunk: options["num_warps"] for chunk, options in C.REDUCE_CHUNKS.items()}
    launched = []
    launch = dmod._launch_reduce

    def record(grid, args, **options):
        launched.append((args["CHUNK"], options["num_warps"]))
        return launch(grid, args, **options)

    monkeypatch.setattr(dmod, "_launch_reduce", record)
    monkeypatch.setattr(dmod, "_merge_warmed", set())
    sc = Scenario([(40, 1), (3, 1), (90, 1)], 8, 2, 64, torch.int8, 32, seed=11)
    q = torch.randn(3, 8, 64, dtype=torch.float16)
    ref = decode_ref(q, *sc.caches, sc.block_tables, sc.seq_lens, 0.125)
    calls = []
    for splits in (3, 20, 2):
        launched.clear()
        out = decode_attention_splits(q, *sc.caches, sc.block_tables, sc.seq_lens, 0.125, splits)
        close(out, ref, TOL[torch.float16])
        calls.append(list(launched))
    assert calls == [[(16, warps[16]), (128, warps[128]), (4, warps[4])], [(128, warps[128])], [(4, warps[4])]]


@cpu_only
@pytest.mark.parametrize("max_splits", [None, 16, 2, 0])
def test_decode_ws_dispatch_merges_in_the_kernel(monkeypatch, max_splits):
    """Host side of the Gluon kernel's merge (the kernel runs on sm_90 only; test_gpu_decode_ws_kernel runs it): with
    2 to DECODE_WS_MERGE_IN_KERNEL_MAX_SPLITS splits the launch gets the zeroed per-device counters, one per
    (sequence, kv head) at least, and no merge kernel runs; with more splits, or one, no counters and the merge
    kernel merges (one split: nothing to merge). None: the default limit, with batch 1's 33 splits."""
    from eightbit.kernels import attention_configs as C
    from eightbit.kernels import decode_attention_hopper as H

    if max_splits is not None:
        monkeypatch.setattr(C, "DECODE_WS_MERGE_IN_KERNEL_MAX_SPLITS", max_splits)
    n = 3 if max_splits is not None else 33
    in_kernel = n <= C.DECODE_WS_MERGE_IN_KERNEL_MAX_SPLITS
    monkeypatch.setattr(dmod, "_ws_ok", lambda *a: True)
    monkeypatch.setattr(dmod, "_counters", {})
    launches, merges = [], []
    monkeypatch.setattr(H, "launch_ws", lambda *a, early: launches.append((*a, early)))
    monkeypatch.setattr(dmod, "_reduce", lambda po, pl, out, splits: merges.append(splits) or out)
    monkeypatch.setattr(dmod, "_last_order", [None])
    monkeypatch.setattr(dmod, "_last_tables", [None])
    sc = Scenario([(40, 1), (3, 1), (90, 1)], 8, 2, 64, torch.int8, 32, seed=5)
    q = torch.randn(3, 8, 64, dtype=torch.float16)
    for splits in (n, 1):
        decode_attention_splits(q, *sc.caches, sc.block_tables, sc.seq_lens, 0.125, splits)
    (*_, fused, early_first), (*_, single, early_second) = launches
    assert single is None
    # the second call takes the same indices as the first: settled (the kernel may read them before its wait)
    assert not early_first and early_second
    if in_kernel:
        assert merges == [1] and fused is dmod._counters[("cpu", None)]
        assert fused.dtype == torch.int32 and fused.numel() >= 3 * 2 and int(fused.count_nonzero()) == 0
    else:
        assert merges == [n, 1] and fused is None


def test_decode_work_order_longest_first_and_memo(monkeypatch):
    """The Gluon kernel's sequence order: indices by descending length (ties in batch order), built once per
    seq_lens tensor and rebuilt after an in-place change or a flag change. Settled (the kernel may read the
    indices before its PDL wait) only when the call before, on the same stream, took the same seq_lens and block
    tables, unchanged."""
    from eightbit.kernels import attention_configs as C

    monkeypatch.setattr(dmod, "_last_order", [None])
    monkeypatch.setattr(dmod, "_last_tables", [None])
    seq_lens = torch.tensor([5, 0, 300, 17, 300, 1], dtype=torch.int32)
    tables = torch.zeros(6, 19, dtype=torch.int32)
    order, settled = dmod._work_order(seq_lens, tables)
    assert order.dtype == torch.int32 and order.tolist() == [2, 4, 3, 0, 5, 1] and not settled
    assert dmod._work_order(seq_lens, tables) == (order, True)  # memo: one build per step, not per layer
    assert dmod._work_order(seq_lens, tables.clone()) == (order, False)  # other tables: written just before?
    assert dmod._work_order(seq_lens, tables)[1] is False  # ... and back: not the previous call's
    assert dmod._work_order(seq_lens, tables)[1] is True
    tables[0, 3] = 7  # written in place since the previous call
    assert dmod._work_order(seq_lens, tables) == (order, False)
    monkeypatch.setattr(dmod, "_stream_of", lambda t: 12345)  # the same tensors, launched on another stream
    assert dmod._work_order(seq_lens, tables) == (order, False)
    assert dmod._work_order(seq_lens, tables) == (order, True)
    seq_lens[1] = 1000
    order, settled = dmod._work_order(seq_lens, tables)
    assert order.tolist() == [1, 2, 4, 3, 0, 5] and not settled
    assert dmod._work_order(seq_lens.clone(), tables)[0].tolist() == [1, 2, 4, 3, 0, 5]
    monkeypatch.setattr(C, "DECODE_LONGEST_FIRST", False)
    order, settled = dmod._work_order(seq_lens, tables)
    assert order.tolist() == list(range(6)) and not settled


@gpu
def test_gpu_decode_stream_of_is_the_current_stream():
    """The stream _work_order keys its settled flag on is the one this call's kernels go to, on a side stream too."""
    from eightbit.kernels import decode_attention as dmod

    t = torch.zeros(4, dtype=torch.int32, device="cuda")
    assert dmod._stream_of(t) == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert dmod._stream_of(t) == side.cuda_stream != torch.cuda.default_stream().cuda_stream
    assert dmod._stream_of(t.cpu()) is None


def test_decode_split_counts():
    """Hand-computed: programs_per_sm x SMs // (batch x kv heads), capped by the context (128 keys per split)
    and DECODE_MAX_SPLITS, at least 1; the Gluon kernel's rule (2 per SM) gives one round of work items."""
    from eightbit.kernels.attention_configs import decode_num_splits

    assert decode_num_splits(1, 8, 32768, 132) == 66  # 4 * 132 // 8
    assert decode_num_splits(32, 8, 2048, 132) == 2
    assert decode_num_splits(32, 8, 2048, 132, programs_per_sm=2) == 1
    assert decode_num_splits(16, 8, 2048, 132, programs_per_sm=2) == 2
    assert decode_num_splits(8, 8, 8192, 132, programs_per_sm=2) == 4
    assert decode_num_splits(1, 8, 512, 132) == 4  # 512 // 128
    assert decode_num_splits(1, 1, 1 << 20, 132) == 128  # DECODE_MAX_SPLITS
    assert decode_num_splits(256, 8, 8192, 132) == 1


@cpu_only
def test_metadata_out_of_range_is_an_error_when_the_checks_are_on(monkeypatch):
    """The kernels trust the metadata (a value out of range reads or writes past a tensor); with
    EIGHTBIT_CHECK_METADATA=1 each wrapper checks it first and names the bad entry."""
    from eightbit.kernels import metadata_checks

    monkeypatch.setattr(metadata_checks, "ENABLED", True)
    sc = Scenario([(20, 1), (9, 1)], 8, 2, 64, torch.int8, 32)
    q = torch.randn(2, 8, 64, dtype=torch.float16)
    nblk = sc.caches[0].shape[0]
    decode_attention(q, *sc.caches, sc.block_tables, sc.seq_lens, 0.1)  # in range: runs
    table = sc.block_tables.clone()
    for bad in (nblk + 1, -1):  # -1 in a column in use read block 0 in the reference, before the cache in the kernel
        table[1, 0] = bad
        with pytest.raises(ValueError, match=rf"block_tables\[1, 0\] = {bad} is not a block of the cache"):
            decode_attention(q, *sc.caches, table, sc.seq_lens, 0.1)
    long = sc.seq_lens.clone()
    long[0] = sc.block_tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = .* is outside"):
        decode_attention(q, *sc.caches, sc.block_tables, long, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q must rise from 0 to at most 2"):
        prefill_attention(q, *sc.caches, sc.block_tables, torch.tensor([0, 1, 3], dtype=torch.int32), sc.seq_lens,
                          0.1)
    k = torch.randn(3, 2, 64, dtype=torch.float16)
    before = [x.clone() for x in sc.caches]
    with pytest.raises(ValueError, match=rf"slot_mapping\[2\] = {nblk * 16} is outside -1..{nblk * 16 - 1}"):
        kv_write(k, k, *sc.caches, torch.tensor([0, -1, nblk * 16]))
    for bad in (8, -1):  # -1 read the cache's last row in the reference (Python indexing), past it in the kernel
        with pytest.raises(ValueError, match=rf"positions\[0\] = {bad} is outside the rotary cache's 0..7"):
            rope_kv_write(torch.randn(3, 8, 64, dtype=torch.float16), k, k, torch.tensor([bad, 0, 1]),
                          torch.randn(8, 64), *sc.caches, torch.tensor([0, 1, 2]))
    assert all(torch.equal(a.nan_to_num(1.0), b.nan_to_num(1.0)) for a, b in zip(sc.caches, before))


def test_attention_rejects_bad_inputs():
    sc = Scenario([(20, 1)], 8, 2, 64, torch.int8, 32)
    q = torch.randn(1, 8, 64, dtype=torch.float16)
    kc, vc, ks, vs = sc.caches
    with pytest.raises(ValueError, match="needs k_scale"):
        decode_attention(q, kc, vc, None, None, sc.block_tables, sc.seq_lens, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(torch.randn(1, 7, 64, dtype=torch.float16), kc, vc, ks, vs, sc.block_tables, sc.seq_lens, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill_attention(q, kc, vc, ks, vs, sc.block_tables, sc.cu[:1], sc.seq_lens, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(torch.randn(1, 8, 48, dtype=torch.float16), kc[..., :48], vc[:, :, :48], ks, vs,
                         sc.block_tables, sc.seq_lens, 0.1)
    with pytest.raises(ValueError, match="key-minor|int8 V cache is"):
        prefill_attention(q, kc, kc.clone(), ks, vs, sc.block_tables, sc.cu, sc.seq_lens, 0.1)
    with pytest.raises(ValueError, match="contiguous, 16-aligned blocks"):
        decode_attention(q, kc, vc.transpose(2, 3).contiguous().transpose(2, 3), ks, vs, sc.block_tables,
                         sc.seq_lens, 0.1)
    # 1-D metadata the kernels read as contiguous: a column of a wider tensor would be read at the wrong rows
    two = Scenario([(20, 1), (9, 1)], 8, 2, 64, torch.int8, 32)
    q2 = torch.randn(2, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="seq_lens must be a contiguous"):
        decode_attention(q2, *two.caches, two.block_tables, torch.stack([two.seq_lens, two.seq_lens], 1)[:, 0], 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a contiguous"):
        prefill_attention(q2, *two.caches, two.block_tables, torch.stack([two.cu, two.cu], 1)[:, 0], two.seq_lens,
                          0.1)
    # a float cache's block_size must be a power of two too: decode splits key indices by shifts and masks
    odd = Scenario([(20, 1)], 8, 2, 64, torch.float16, 64, page=24)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        decode_attention(q, *odd.caches, odd.block_tables, odd.seq_lens, 0.1)
    # a float V is read with K's offsets: a V cache with another block stride must be refused
    fs = Scenario([(20, 1)], 8, 2, 64, torch.float16, 64)
    fk, fv, _, _ = fs.caches
    wide = torch.empty((2 * fv.shape[0],) + fv.shape[1:], dtype=fv.dtype)[::2]
    wide.copy_(fv)
    for run in (lambda: decode_attention(q, fk, wide, None, None, fs.block_tables, fs.seq_lens, 0.1),
                lambda: prefill_attention(q, fk, wide, None, None, fs.block_tables, fs.cu, fs.seq_lens, 0.1)):
        with pytest.raises(ValueError, match="strides of k_cache"):
            run()


# --- GPU: bf16, compiled, FlashAttention's accuracy rule -------------------------------------


def _dequant_cache(kc, vc, ks, vs):
    if ks is None:
        return kc, vc, None, None
    from eightbit.quant.int8 import dequantize_groups

    return dequantize_groups(kc, ks).double(), dequantize_groups(R.v_token_major(kc, vc), vs).double(), None, None


def _low_precision_torch_attention(q, kc, vc, ks, vs, block_tables, cu, seq_lens, scale):
    """Plain torch, the same math with operands and outputs in q's dtype, bf16 or fp16 (the comparison baseline)."""
    kd, vd, _, _ = _dequant_cache(kc, vc, ks, vs)
    kd, vd = kd.to(q.dtype), vd.to(q.dtype)
    out = torch.empty_like(q)
    starts = cu.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = R.gather_kv(kd, None, block_tables[b], length).to(q.dtype)
        v = R.gather_kv(vd, None, block_tables[b], length).to(q.dtype)
        grp = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k) * scale
        qpos = torch.arange(e - s, device=q.device)[:, None] + length - (e - s)
        scores = scores.masked_fill(torch.arange(length, device=q.device)[None] > qpos, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _check_fa_rule(out, q, sc, scale, atol=1e-3):
    kd, vd, _, _ = _dequant_cache(*sc.caches)
    ref = R.prefill_attention(q.double(), kd.double(), vd.double(), None, None, sc.block_tables, sc.cu,
                              sc.seq_lens, scale)
    base = _low_precision_torch_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, scale)
    err = (out.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 2 * base_err + atol, f"kernel error {err} > 2 x {q.dtype}-torch error {base_err} + {atol}"


GPU_CASES = [("int8-32", 128, 32, 8), ("int8-d", 64, 12, 3), ("bf16", 128, 32, 8), ("int8-32", 128, 8, 8)]


@gpu
@pytest.mark.parametrize("cache,d,hq,hkv", GPU_CASES)
def test_gpu_prefill_bf16(cache, d, hq, hkv):
    cache_dtype = torch.int8 if cache.startswith("int8") else torch.bfloat16
    group = 32 if cache == "int8-32" else d
    seqs = [(1, 1), (1000, 1000), (2100, 333), (777, 1), (4096, 600)]
    sc = Scenario(seqs, hq, hkv, d, cache_dtype, group, share_prefix_blocks=3, device="cuda", seed=d)
    q = torch.randn(sc.T, hq, d, device="cuda", dtype=torch.bfloat16)
    out = prefill_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, d ** -0.5)
    torch.cuda.synchronize()
    _check_fa_rule(out, q, sc, d ** -0.5)


@gpu
@pytest.mark.parametrize("cache", ["fp32", "int8-32"])
def test_gpu_float32_attention_computes_in_float32(cache):
    """A float32 q is computed in float32 on the GPU as on the CPU: prefill and decode within the CPU's float32
    tolerance of float64 on the dequantized cache. (With TF32 dots, the default, they were 3e-3 off on an H200.)"""
    d, hq, hkv = 128, 8, 2
    cache_dtype, group = _cache_args(cache, d, torch.float32)
    sc = Scenario(SEQS, hq, hkv, d, cache_dtype, group, share_prefix_blocks=2, device="cuda", seed=7)
    kd, vd, _, _ = _dequant_cache(*sc.caches)
    kd, vd, scale = kd.double(), vd.double(), d ** -0.5
    q = torch.randn(sc.T, hq, d, device="cuda")
    out = prefill_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, scale)
    ref = R.prefill_attention(q.double(), kd, vd, None, None, sc.block_tables, sc.cu, sc.seq_lens, scale)
    close(out.double(), ref, TOL[torch.float32])
    q1 = torch.randn(len(SEQS), hq, d, device="cuda")
    out = decode_attention(q1, *sc.caches, sc.block_tables, sc.seq_lens, scale)
    ref = R.decode_attention(q1.double(), kd, vd, None, None, sc.block_tables, sc.seq_lens, scale)
    close(out.double(), ref, TOL[torch.float32])


@gpu
@pytest.mark.parametrize("cache,d,hq,hkv", GPU_CASES)
def test_gpu_prefill_long_prompts_bf16(cache, d, hq, hkv):
    """Prompts averaging >= LONG_PREFILL_TOKENS take the long-prompt launch table."""
    from eightbit.kernels.attention_configs import LONG_PREFILL_TOKENS

    cache_dtype = torch.int8 if cache.startswith("int8") else torch.bfloat16
    group = 32 if cache == "int8-32" else d
    seqs = [(5000, 4100), (3300, 3300)]
    assert sum(n for _, n in seqs) // len(seqs) >= LONG_PREFILL_TOKENS
    sc = Scenario(seqs, hq, hkv, d, cache_dtype, group, device="cuda", seed=d + 1)
    q = torch.randn(sc.T, hq, d, device="cuda", dtype=torch.bfloat16)
    out = prefill_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, d ** -0.5)
    torch.cuda.synchronize()
    _check_fa_rule(out, q, sc, d ** -0.5)


@gpu
@pytest.mark.parametrize("dtype,d,hq,hkv,page", [
    (torch.bfloat16, 128, 32, 8, 16), (torch.bfloat16, 64, 12, 3, 16), (torch.bfloat16, 128, 8, 8, 64),
    (torch.float16, 128, 16, 2, 32), (torch.bfloat16, 64, 8, 1, 8)])
@pytest.mark.parametrize("int64_meta,small_grid", [(False, False), (True, False), (False, True)])
def test_gpu_prefill_ws_kernel(monkeypatch, dtype, d, hq, hkv, page, int64_meta, small_grid):
    """The warp-specialized Gluon prefill (taken for every float-cache call on sm_90): FlashAttention's rule
    against float64 while every unused cache slot holds NaN (V's rows past a sequence's end are zeroed in
    shared memory), an empty chunk, and within bf16/fp16 rounding of the Triton kernel. small_grid: a grid of
    3 programs, so each walks many work items (and dead tile-map entries) through one ring."""
    from eightbit.kernels import attention_configs as C
    from eightbit.kernels import prefill_attention_hopper as H

    if small_grid:
        monkeypatch.setattr(H, "sm_count", lambda device: 3)

    seqs = [(1, 1), (1000, 1000), (2100, 333), (40, 0), (777, 1), (4096, 600), (130, 129), (64, 64), (100, 1)]
    sc = Scenario(seqs, hq, hkv, d, dtype, d, page=page, share_prefix_blocks=3, device="cuda", seed=d + page)
    poison_block_zero(sc)
    q = torch.randn(sc.T, hq, d, device="cuda", dtype=dtype)
    meta = (sc.block_tables, sc.cu, sc.seq_lens)
    if int64_meta:
        meta = tuple(t.long() for t in meta)
    args = (q, *sc.caches, *meta, d ** -0.5)
    assert H.ws_ok(q, sc.caches[0], sc.caches[1])
    calls = []
    real = H.launch_ws
    monkeypatch.setattr(H, "launch_ws", lambda *a: calls.append(1) or real(*a))
    ws = prefill_attention(*args)
    torch.cuda.synchronize()
    assert calls == [1]
    _check_fa_rule(ws, q, sc, d ** -0.5)  # fp16 too: against the Triton kernel alone, 0.02 hid a 10 % error
    assert torch.isfinite(ws).all()
    for _ in range(2):  # deterministic: a race between the partitions would show as changed bits
        torch.testing.assert_close(prefill_attention(*args), ws, rtol=0, atol=0)
    monkeypatch.setattr(C, "PREFILL_WS_ENABLED", False)
    triton_out = prefill_attention(*args)
    assert calls == [1, 1, 1]
    torch.testing.assert_close(ws.float(), triton_out.float(), rtol=0.02, atol=0.02)


@gpu
@pytest.mark.parametrize("d,hq,hkv,group,int64_meta", [(128, 32, 8, 32, False), (128, 12, 3, 128, True),
                                                      (64, 8, 1, 32, False)])
def test_gpu_prefill_int8_via_float_copy(monkeypatch, d, hq, hkv, group, int64_meta):
    """An int8-cache prefill with enough tokens per sequence runs on a dequantized bf16 copy of its blocks through
    the Gluon kernel: FlashAttention's rule against float64 on the dequantized cache (unused slots NaN), within
    bf16 rounding of the int8 Triton kernel; below MIN_TOKENS per sequence and MIN_CONTEXT, or above MAX_BYTES,
    the Triton kernel; a long context alone takes the copy; with no memory for the copy, the Triton kernel."""
    from eightbit.kernels import attention_configs as C
    from eightbit.kernels import kv_dequant

    seqs = [(1, 1), (1000, 1000), (2100, 333), (40, 0), (777, 1), (4096, 600), (130, 129)]
    sc = Scenario(seqs, hq, hkv, d, torch.int8, group, share_prefix_blocks=3, device="cuda", seed=d + group)
    poison_block_zero(sc)
    q = torch.randn(sc.T, hq, d, device="cuda", dtype=torch.bfloat16)
    meta = (sc.block_tables, sc.cu, sc.seq_lens)
    if int64_meta:
        meta = tuple(t.long() for t in meta)
    args = (q, *sc.caches, *meta, d ** -0.5)
    calls = []
    real = kv_dequant.dequantize_blocks
    monkeypatch.setattr(kv_dequant, "dequantize_blocks", lambda *a: calls.append(1) or real(*a))
    assert sc.T >= len(seqs) * C.PREFILL_INT8_VIA_FLOAT_MIN_TOKENS
    out = prefill_attention(*args)
    torch.cuda.synchronize()
    assert calls == [1]
    _check_fa_rule(out, q, sc, d ** -0.5)
    monkeypatch.setattr(C, "PREFILL_INT8_VIA_FLOAT", False)
    triton_out = prefill_attention(*args)
    torch.testing.assert_close(out.float(), triton_out.float(), rtol=0.02, atol=0.02)
    monkeypatch.setattr(C, "PREFILL_INT8_VIA_FLOAT", True)
    monkeypatch.setattr(C, "PREFILL_INT8_VIA_FLOAT_MIN_TOKENS", sc.T // len(seqs) + 1)
    monkeypatch.setattr(C, "PREFILL_INT8_VIA_FLOAT_MIN_CONTEXT", sc.block_tables.shape[1] * sc.page + 1)
    torch.testing.assert_close(prefill_attention(*args), triton_out, rtol=0, atol=0)
    monkeypatch.setattr(C, "PREFILL_INT8_VIA_FLOAT_MIN_CONTEXT", sc.block_tables.shape[1] * sc.page)
    torch.testing.assert_close(prefill_attention(*args), out, rtol=0, atol=0)  # a long context alone takes it
    assert calls == [1, 1]
    monkeypatch.setattr(C, "PREFILL_INT8_VIA_FLOAT_MIN_CONTEXT", 1 << 30)
    monkeypatch.setattr(C, "PREFILL_INT8_VIA_FLOAT_MIN_TOKENS", 1)
    monkeypatch.setattr(C, "PREFILL_INT8_VIA_FLOAT_MAX_BYTES", 1 << 20)
    torch.testing.assert_close(prefill_attention(*args), triton_out, rtol=0, atol=0)
    assert calls == [1, 1]

    def no_memory(*a):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(C, "PREFILL_INT8_VIA_FLOAT_MAX_BYTES", 1 << 40)
    monkeypatch.setattr(kv_dequant, "dequantize_blocks", no_memory)
    torch.testing.assert_close(prefill_attention(*args), triton_out, rtol=0, atol=0)  # no room: the Triton kernel


@gpu
@pytest.mark.parametrize("page", [16, 128])
def test_gpu_prefill_ws_kernel_short_prompt(page):
    """A call with fewer query rows than a consumer's 64 (the Q box runs past q's end), and pages as wide as a key
    tile (one copy per tile), against float64."""
    from eightbit.kernels import prefill_attention_hopper as H

    sc = Scenario([(20, 20)], 8, 2, 128, torch.bfloat16, 128, page=page, device="cuda", seed=page)
    poison_block_zero(sc)
    q = torch.randn(sc.T, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert H.ws_ok(q, sc.caches[0], sc.caches[1])
    out = prefill_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, 128 ** -0.5)
    _check_fa_rule(out, q, sc, 128 ** -0.5)


@gpu
def test_gpu_prefill_ws_kernel_declines_what_it_cannot_run():
    """ws_ok sends an int8 cache, a q of another dtype, a head_dim without a config and non-contiguous tensors to
    the Triton kernel."""
    from eightbit.kernels import prefill_attention_hopper as H

    sc = Scenario([(100, 100)], 8, 2, 128, torch.bfloat16, 128, device="cuda")
    q = torch.randn(sc.T, 8, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = sc.caches[:2]
    assert H.ws_ok(q, kc, vc)
    assert not H.ws_ok(q.half(), kc, vc)
    assert not H.ws_ok(q.float(), kc, vc)
    unaligned = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape).copy_(q)
    assert unaligned.is_contiguous() and not H.ws_ok(unaligned, kc, vc)
    assert not H.ws_ok(q, kc[:, :, :1], vc[:, :, :1])  # non-contiguous cache view
    assert not H.ws_ok(torch.randn(sc.T, 8, 256, device="cuda", dtype=torch.bfloat16)[:, :, :128], kc, vc)
    i8 = Scenario([(100, 100)], 8, 2, 128, torch.int8, 32, device="cuda")
    assert not H.ws_ok(q, i8.caches[0], i8.caches[1])
    small = Scenario([(100, 100)], 8, 2, 32, torch.bfloat16, 32, device="cuda")
    assert not H.ws_ok(q[:, :, :32].contiguous(), small.caches[0], small.caches[1])


@gpu
@pytest.mark.parametrize("cache,d,hq,hkv", GPU_CASES)
def test_gpu_decode_bf16_cuda_graph(cache, d, hq, hkv):
    cache_dtype = torch.int8 if cache.startswith("int8") else torch.bfloat16
    group = 32 if cache == "int8-32" else d
    seqs = [(1, 1), (5000, 1), (333, 1), (17, 1), (2048, 1), (64, 1)]
    sc = Scenario(seqs, hq, hkv, d, cache_dtype, group, share_prefix_blocks=2, device="cuda", seed=d + 1)
    q = torch.randn(len(seqs), hq, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    args = (*sc.caches, sc.block_tables, sc.seq_lens, scale)
    eager = decode_attention(q, *args)
    _check_fa_rule(eager, q, sc, scale)
    # capture once, then change the lengths in place: the graph must follow the new values
    decode_attention(q, *args)  # warm (compile) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_attention(q, *args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)
    sc.seq_lens.copy_(torch.tensor([1, 4000, 300, 17, 100, 64], device="cuda", dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, decode_attention(q, *args), rtol=0, atol=0)


@cpu_only
@pytest.mark.parametrize("d", [64, 128])
def test_decode_ws_host_copies_v_pages_as_wide_rows(monkeypatch, d):
    """The Gluon decode's host side (the kernel runs only on sm_90): one head's key-minor V page, D x page
    contiguous bytes, is one TMA box of 128-byte rows over those same bytes, unswizzled like the [D, page] buffer
    it lands in (so the bytes keep their places); K is one box per page; every kernel parameter is named."""
    from triton.experimental.gluon import language as gl

    from eightbit.kernels import decode_attention_hopper as H
    from eightbit.kernels.reference import v_cache_shape

    calls = []
    monkeypatch.setattr(H, "_launch_kernel", lambda grid, args, **opts: calls.append((grid, args, opts)))
    monkeypatch.setattr(H, "sm_count", lambda device: 132)
    nblk, page, hkv, hq, b = 12, 16, 2, 8, 3
    k = torch.zeros(nblk, page, hkv, d, dtype=torch.int8)
    v = torch.zeros(v_cache_shape(nblk, page, hkv, d, torch.int8), dtype=torch.int8)
    ks = vs = torch.ones(nblk, page, hkv, d // 32, dtype=torch.float16)
    q = torch.zeros(b, hq, d, dtype=torch.bfloat16)
    bt = torch.arange(b * 4, dtype=torch.int32).view(b, 4)
    sl = torch.full((b,), 50, dtype=torch.int32)
    out = torch.empty_like(q)
    H.launch_ws(q, k, v, ks, vs, bt, sl, 1.0, out, out, out, 1, 32, torch.arange(b, dtype=torch.int32))
    grid, args, opts = calls[-1]
    assert sorted(args) == sorted(H._decode_ws_kernel.arg_names)
    rows = d * page // 128
    v_desc = args["v_desc"]
    assert list(v_desc.block_shape) == [1, rows, 128] and list(v_desc.shape) == [nblk * hkv, rows, 128]
    assert v_desc.base.data_ptr() == v.data_ptr() and v_desc.base.is_contiguous()
    assert v_desc.layout == H.V_LAYOUT and H.V_LAYOUT.swizzle_byte_width == 0
    assert gl.NVMMASharedLayout.get_default_for([1, d, page], gl.int8) == H.V_LAYOUT  # the buffer's own layout
    assert list(args["k_desc"].block_shape) == [1, page, d]
    assert grid == (b * hkv,) and opts["num_warps"] == 4


def _ptx_inits(inits, base="global_smem"):
    """PTX lines as Triton writes a barrier's initialization: (offset, arrival count) per barrier."""
    lines = [f"\tmov.b32 \t%r9, {base};"]
    for i, (offset, count) in enumerate(inits):
        lines += [f"\tadd.s32 \t%r{20 + i}, %r9, {offset};", "\t// begin inline asm",
                  f"\t@%p1 mbarrier.init.shared::cta.b64 [%r{20 + i}], {count};", "\t// end inline asm"]
    return "\n".join(lines)


def test_ring_barrier_offsets_reads_the_ptx_or_gives_up():
    """The launch reads ready[0] and empty[0]'s shared-memory offsets from the kernel's barrier initializations
    (ready: 1 arrival, empty: one per math warp; slots 8 bytes apart, interleaved as the kernel initializes them);
    anything else gives None, so that the launch falls back to Gluon's waits rather than wait on a wrong address."""
    from eightbit.kernels import decode_attention_hopper as H

    w = H.CONSUMERS.value
    ring = [(60416, 1), (60448, w), (60424, 1), (60456, w), (60432, 1), (60464, w)]
    assert H.ring_barrier_offsets(_ptx_inits(ring)) == (60416, 60448)
    assert H.ring_barrier_offsets(_ptx_inits(ring[:2])) == (60416, 60448)
    assert H.ring_barrier_offsets(_ptx_inits(ring, base="other_smem")) is None  # not from the shared base
    assert H.ring_barrier_offsets(_ptx_inits(ring[:5])) is None  # 3 ready, 2 empty
    assert H.ring_barrier_offsets(_ptx_inits([(o, 1) for o, _ in ring])) is None  # Gluon's waits: counts all 1
    gap = [(60416, 1), (60448, w), (60432, 1), (60456, w)]
    assert H.ring_barrier_offsets(_ptx_inits(gap)) is None  # ready slots not 8 bytes apart
    assert H.ring_barrier_offsets("") is None


def test_decode_ws_grid_size():
    """The Gluon decode's grid: one program per work item up to two rounds of the resident programs (two per SM),
    then a persistent grid of those (the kernel then walks its rounds alternately forwards and backwards)."""
    from eightbit.kernels import decode_attention_hopper as H

    assert (H.RESIDENT_PER_SM, H.PERSISTENT_AFTER_ROUNDS) == (2, 2)
    assert H._grid_size(1, 132) == 1
    assert H._grid_size(512, 132) == 512  # batch 64 x 8 kv heads: 1.9 rounds, one program each
    assert H._grid_size(528, 132) == 528
    assert H._grid_size(529, 132) == 264
    assert H._grid_size(2048, 132) == 264  # batch 256 x 8 kv heads
    assert H._grid_size(29, 7) == 14


@gpu
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("splits", [None, 1, 5, 19])
@pytest.mark.parametrize("small_grid", [False, True])
@pytest.mark.parametrize("merge_in_kernel", [True, False])
def test_gpu_decode_ws_kernel(monkeypatch, hq, hkv, d, splits, small_grid, merge_in_kernel):
    """The warp-specialized Gluon kernel (forced on at any batch): FlashAttention's rule against float64,
    a padded slot (seq_len 0) gives zeros, and its output is within a float16 rounding of the Triton kernel's.
    small_grid: 7 SMs, so above 28 work items a persistent grid of 14 programs walks them through one ring, odd
    rounds in reverse (a partial odd round at the end for most of these shapes). merge_in_kernel: the
    splits merged by their last program or by the merge kernel; merged in the kernel, the counters are all zero
    again after every call. With 19 splits the 4,864-key sequence has keys in all of them (three steps of
    MERGE_CHUNK) and the short ones in one or two (the rest store nothing and are not merged)."""
    from eightbit.kernels import attention_configs as C
    from eightbit.kernels import decode_attention_hopper as H

    if small_grid:
        monkeypatch.setattr(H, "sm_count", lambda device: 7)
    monkeypatch.setattr(C, "DECODE_WS_MERGE_IN_KERNEL_MAX_SPLITS", 128 if merge_in_kernel else 0)

    seqs = [(1, 1), (5000, 1), (333, 1), (17, 1), (2048, 1), (64, 1), (65, 1), (700, 1), (4864, 1)]
    sc = Scenario(seqs, hq, hkv, d, torch.int8, 32, share_prefix_blocks=2, device="cuda", seed=hq)
    q = torch.randn(len(seqs), hq, d, device="cuda", dtype=torch.bfloat16)
    args = (*sc.caches, sc.block_tables, sc.seq_lens, d ** -0.5)
    assert H.ws_ok(q, *sc.caches, sc.block_tables, 32)
    monkeypatch.setattr(C, "DECODE_WS_MIN_PROGRAMS", 0)
    ws = decode_attention_splits(q, *args, splits)
    _check_fa_rule(ws, q, sc, d ** -0.5)
    monkeypatch.setattr(C, "DECODE_WS_MIN_PROGRAMS", 1 << 30)
    triton_out = decode_attention_splits(q, *args, splits)
    torch.testing.assert_close(ws.float(), triton_out.float(), rtol=0.02, atol=0.01)
    monkeypatch.setattr(C, "DECODE_WS_MIN_PROGRAMS", 0)
    if splits is None and not small_grid:  # int64 block tables: the Triton kernel (the TMA coordinates are 32-bit)
        wide = sc.block_tables.long()
        assert not H.ws_ok(q, *sc.caches, wide, 32)
        torch.testing.assert_close(decode_attention_splits(q, *sc.caches, wide, sc.seq_lens, d ** -0.5, None),
                                   triton_out, rtol=0, atol=0)
        # float32 scales: the Gluon kernel's scale buffers are float16, so the Triton kernel runs them
        kc, vc, ks, vs = sc.caches
        assert not H.ws_ok(q, kc, vc, ks.float(), vs.float(), sc.block_tables, 32)
        torch.testing.assert_close(decode_attention_splits(q, kc, vc, ks.float(), vs.float(), sc.block_tables,
                                                           sc.seq_lens, d ** -0.5, None), triton_out, rtol=0, atol=0)
    monkeypatch.setattr(C, "DECODE_LONGEST_FIRST", False)  # work items in batch order: the same bits
    torch.testing.assert_close(decode_attention_splits(q, *args, splits), ws, rtol=0, atol=0)
    monkeypatch.setattr(C, "DECODE_LONGEST_FIRST", True)
    sc.seq_lens[3] = 0
    padded = decode_attention_splits(q, *args, splits)
    assert (padded[3] == 0).all()
    torch.testing.assert_close(padded[4:], ws[4:], rtol=0, atol=0)
    if merge_in_kernel and (splits or 2) > 1:
        torch.cuda.synchronize()
        assert dmod._counters and all(int(c.count_nonzero()) == 0 for c in dmod._counters.values())


@gpu
def test_gpu_decode_ws_merge_reads_only_splits_with_keys():
    """Merged in the kernel, a split without keys stores no partial and the merge reads none: with the partial
    buffers poisoned (NaN), the output equals decode_attention's bit for bit, the slots of the splits without keys
    are still NaN, those with keys are written, and the counters are zero again."""
    from eightbit.kernels import decode_attention_hopper as H

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon decode kernel is sm_90 only")
    seqs, splits, hq, hkv, d = [(1, 1), (17, 1), (700, 1), (4864, 1)], 19, 32, 8, 128
    sc = Scenario(seqs, hq, hkv, d, torch.int8, 32, device="cuda", seed=3)
    q = torch.randn(len(seqs), hq, d, device="cuda", dtype=torch.bfloat16)
    expected = decode_attention_splits(q, *sc.caches, sc.block_tables, sc.seq_lens, d ** -0.5, splits)
    part_out = torch.full((len(seqs), hq, splits, d), float("nan"), device="cuda")
    part_lse = torch.full((len(seqs), hq, splits), float("nan"), device="cuda")
    out = torch.empty_like(q)
    counters = torch.zeros(len(seqs) * hkv, dtype=torch.int32, device="cuda")
    H.launch_ws(q, *sc.caches, sc.block_tables, sc.seq_lens, d ** -0.5 * dmod.LOG2E, out, part_out, part_lse, splits,
                32, dmod._work_order(sc.seq_lens, sc.block_tables)[0], counters)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    tile = H.CONSUMERS.value * 16  # a split's keys are whole tiles of CONSUMERS pages
    for b, (n, _) in enumerate(seqs):
        per_split = -(-(-(-n // splits)) // tile) * tile
        live = -(-n // per_split)  # the splits with keys
        assert 1 <= live <= splits and (live == splits) == (n == 4864)  # 4,864 keys fill all 19: three merge steps
        assert not part_lse[b, :, :live].isnan().any() and part_lse[b, :, live:].isnan().all()
    assert int(counters.count_nonzero()) == 0


@gpu
@pytest.mark.parametrize("splits,small_grid", [(None, False), (19, False), (5, True)])
def test_gpu_decode_ws_warp_release_matches_gluon_waits(monkeypatch, splits, small_grid):
    """WARP_RELEASE (each math warp waits for and gives back its ring slot itself, on barrier offsets the launch
    reads from the PTX) against Gluon's own waits: the same outputs bit for bit, with a persistent grid too (7
    SMs: the ring's phases carry on across work items), and the launch did find the offsets. Where it cannot (a
    Triton whose PTX it does not read), it warns and runs Gluon's waits, with the same outputs."""
    from eightbit.kernels import attention_configs as C
    from eightbit.kernels import decode_attention_hopper as H

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon decode kernel is sm_90 only")
    if small_grid:
        monkeypatch.setattr(H, "sm_count", lambda device: 7)
    monkeypatch.setattr(C, "DECODE_WS_MIN_PROGRAMS", 0)
    seqs = [(1, 1), (5000, 1), (333, 1), (17, 1), (2048, 1), (64, 1), (65, 1), (700, 1), (4864, 1)]
    sc = Scenario(seqs, 32, 8, 128, torch.int8, 32, share_prefix_blocks=2, device="cuda", seed=5)
    q = torch.randn(len(seqs), 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, *sc.caches, sc.block_tables, sc.seq_lens, 128 ** -0.5)
    names = H._launch_kernel.names
    monkeypatch.setattr(H._launch_kernel, "compiled", {})  # only this call's kernels below
    per_warp = decode_attention_splits(*args, splits)
    bound = [fixed for _, fixed in H._launch_kernel.compiled.values()]
    assert bound and all({names[i] for i, _ in fixed} == {"ready_off", "empty_off"} for fixed in bound)
    assert all(v > 0 for fixed in bound for _, v in fixed)
    monkeypatch.setattr(H, "WARP_RELEASE", False)
    torch.testing.assert_close(decode_attention_splits(*args, splits), per_warp, rtol=0, atol=0)
    monkeypatch.setattr(H, "WARP_RELEASE", True)
    monkeypatch.setattr(H._launch_kernel, "compiled", {})
    monkeypatch.setattr(H, "ring_barrier_offsets", lambda ptx: None)
    with pytest.warns(UserWarning, match="without WARP_RELEASE"):
        fallback = decode_attention_splits(*args, splits)
    assert all([names[i] for i, _ in fixed] == ["WARP_RELEASE"] for _, fixed in H._launch_kernel.compiled.values())
    torch.testing.assert_close(fallback, per_warp, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("splits,small_grid", [(None, False), (19, False), (5, True), (1, True)])
def test_gpu_decode_ws_early_indices_same_bits(monkeypatch, splits, small_grid):
    """A call whose indices are settled (the call before took the same seq_lens and block tables) loads its first
    work item's indices before the PDL wait (EARLY_INDICES): the same outputs bit for bit as the call before it,
    which was not settled. A persistent grid (7 SMs, or 19 splits) runs without it, settled or not. New block
    tables, or a changed length, make the next call unsettled again, and it sees them. Nothing here writes the
    indices just before a settled call, so this checks the early kernel's results and the host's rule, not the
    ordering argument (kernels/pdl.py) itself."""
    from eightbit.kernels import attention_configs as C
    from eightbit.kernels import decode_attention_hopper as H
    from eightbit.kernels import pdl

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon decode kernel is sm_90 only")
    if not pdl.pdl_enabled(torch.device("cuda")):
        pytest.skip("EIGHTBIT_PDL=0: no PDL wait to load the indices before")
    assert H.EARLY_INDICES
    if small_grid:
        monkeypatch.setattr(H, "sm_count", lambda device: 7)
    monkeypatch.setattr(C, "DECODE_WS_MIN_PROGRAMS", 0)
    monkeypatch.setattr(dmod, "_last_order", [None])
    monkeypatch.setattr(dmod, "_last_tables", [None])
    settled = []
    real = H.launch_ws
    splits_run = []
    monkeypatch.setattr(H, "launch_ws", lambda *a, early: settled.append(early) or splits_run.append(a[11])
                        or real(*a, early=early))
    compiled_early = []
    launch = H._launch_kernel
    monkeypatch.setattr(H, "_launch_kernel", lambda grid, args, **kw: compiled_early.append(args["EARLY_INDICES"])
                        or launch(grid, args, **kw))
    seqs = [(1, 1), (5000, 1), (333, 1), (17, 1), (2048, 1), (64, 1), (65, 1), (700, 1), (4864, 1)]
    sc = Scenario(seqs, 32, 8, 128, torch.int8, 32, share_prefix_blocks=2, device="cuda", seed=7)
    q = torch.randn(len(seqs), 32, 128, device="cuda", dtype=torch.bfloat16)
    first = decode_attention_splits(q, *sc.caches, sc.block_tables, sc.seq_lens, 128 ** -0.5, splits)
    second = decode_attention_splits(q, *sc.caches, sc.block_tables, sc.seq_lens, 128 ** -0.5, splits)
    items = 9 * 8 * splits_run[0]
    one_round = H._grid_size(items, H.sm_count(q.device)) == items  # else a persistent grid: never early
    assert settled == [False, True] and compiled_early == [False, one_round]
    assert one_round == (not small_grid and splits != 19)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    _check_fa_rule(second, q, sc, 128 ** -0.5)
    # the same tables, rows swapped into a new tensor: unsettled, and the outputs follow the new tables
    perm = torch.tensor([8, 7, 6, 5, 4, 3, 2, 1, 0], device="cuda")
    swapped = decode_attention_splits(q[perm], *sc.caches, sc.block_tables[perm], sc.seq_lens[perm], 128 ** -0.5,
                                      splits)
    assert settled[-1] is False
    torch.testing.assert_close(swapped, first[perm], rtol=0, atol=0)
    sc.seq_lens[1] = 4000  # in place: the version moves, so the next call is not settled
    shorter = decode_attention_splits(q, *sc.caches, sc.block_tables, sc.seq_lens, 128 ** -0.5, splits)
    assert settled[-1] is False
    again = decode_attention_splits(q, *sc.caches, sc.block_tables, sc.seq_lens, 128 ** -0.5, splits)
    assert settled[-1] is True
    torch.testing.assert_close(again, shorter, rtol=0, atol=0)
    torch.testing.assert_close(again[2:], first[2:], rtol=0, atol=0)
    assert not torch.equal(again[1], first[1])


def _gpu_int8_caches(g, blocks, page, hkv, d):
    """Random int8 paged K and V caches with their group scales (groups of 32) on the GPU."""
    shape = (blocks, page, hkv, d)
    return (torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8, generator=g),
            torch.randint(-127, 128, R.v_cache_shape(*shape, torch.int8), device="cuda", dtype=torch.int8,
                          generator=g),
            (torch.rand(blocks, page, hkv, d // 32, device="cuda", generator=g) * 0.02 + 1e-3).half(),
            (torch.rand(blocks, page, hkv, d // 32, device="cuda", generator=g) * 0.02 + 1e-3).half())


def _gpu_decode_slots(g, b, width, page):
    """A random block table [b, width], context lengths, and the position and cache slot of each sequence's
    new token (the last of its context)."""
    bt = torch.randperm(b * width, device="cuda", dtype=torch.int32, generator=g).view(b, width).contiguous()
    sl = torch.randint(1, width * page, (b,), device="cuda", dtype=torch.int32, generator=g)
    pos = (sl - 1).long()
    slots = bt.gather(1, (pos // page).view(-1, 1).int()).view(-1).long() * page + pos % page
    return bt, sl, pos, slots


def _graph_outputs_without_and_with_pdl(monkeypatch, caches, n_out, step):
    """step(outs) fills outs[0 .. n_out - 1]; it runs once eagerly (compiling), then is captured in a CUDA graph
    that is replayed once, with PDL off and then on. The caches, which kv_write writes, are restored before each
    run and before the capture. Returns (outputs without PDL, outputs with it)."""
    from eightbit.kernels import pdl

    pristine = [t.clone() for t in caches]

    def restore_caches():
        for t, fresh in zip(caches, pristine):
            t.copy_(fresh)

    def run(on):
        monkeypatch.setattr(pdl, "ENABLED", on)
        restore_caches()
        outs = [None] * n_out
        step(outs)  # compiles outside the capture
        restore_caches()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(outs)
        graph.replay()
        torch.cuda.synchronize()
        return [o.clone() for o in outs]

    return run(False), run(True)


@gpu
@pytest.mark.parametrize("b,width", [(16, 48), (1, 512)])
def test_gpu_kv_write_then_decode_same_bits_with_pdl(monkeypatch, b, width):
    """kv_write lets the Gluon decode after it start early (programmatic dependent launch, sm_90), and the decode
    prefetches only hints before its wait. Four layers of (rope_kv_write, decode_attention) replayed from a CUDA
    graph give the same bits with PDL as without, for every layer; batch 1 at the engine's table width runs 33
    splits merged in the kernel, most of them without keys, through counters the four layers share."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("PDL and the Gluon decode kernel are sm_90 only")
    g = torch.Generator(device="cuda").manual_seed(7)
    hq, hkv, d, page = 32, 8, 128, 16
    layers = [_gpu_int8_caches(g, b * width, page, hkv, d) for _ in range(4)]
    bt, sl, pos, slots = _gpu_decode_slots(g, b, width, page)
    cos_sin = torch.randn(width * page, d, device="cuda", generator=g)
    q, k, v = (torch.randn(b, h, d, device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))

    def step(outs):
        for i, (kc, vc, ks, vs) in enumerate(layers):
            qr = rope_kv_write(q, k, v, pos, cos_sin, kc, vc, ks, vs, slots)
            outs[i] = decode_attention(qr, kc, vc, ks, vs, bt, sl, d ** -0.5)

    caches = [t for layer in layers for t in layer]
    without, with_pdl = _graph_outputs_without_and_with_pdl(monkeypatch, caches, len(layers), step)
    for a, c in zip(without, with_pdl):
        assert torch.equal(a, c)
    assert all(o.abs().sum() > 0 for o in with_pdl)


@gpu
def test_gpu_decode_layer_chain_same_bits_with_pdl(monkeypatch):
    """The PDL chain through a decode layer (kernels/pdl.py): rmsnorm_quant -> qkv GEMM -> rope_kv_write -> Gluon
    decode -> quant_per_token -> o GEMM, three layers, each layer's input the previous one's output, replayed from
    a CUDA graph. Every hand-over is a PDL one (the GEMMs and the decode let the next kernel start early, the
    producers and kv_write wait), so a kernel that read before its wait would read the previous layer's or the
    warm-up's data: the bits must equal the same layers launched without PDL."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("PDL and the Gluon decode kernel are sm_90 only")
    from eightbit.kernels.int8_gemm import int8_gemm
    from eightbit.kernels.quant_per_token import quant_per_token
    from eightbit.kernels.rmsnorm_quant import rmsnorm_quant

    g = torch.Generator(device="cuda").manual_seed(11)
    b, hq, hkv, d, page, width, hidden = 16, 32, 8, 128, 16, 48, 2048

    def weight(n, k):  # int8 weights whose products keep activations of order 1
        return (torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=g),
                torch.full((n, 1), 1.0 / (127 * k**0.5), device="cuda"))

    layers = []
    for _ in range(3):
        caches = _gpu_int8_caches(g, b * width, page, hkv, d)
        norm_w = torch.rand(hidden, device="cuda", generator=g).bfloat16() + 0.5
        layers.append((caches, norm_w, weight((hq + 2 * hkv) * d, hidden), weight(hidden, hq * d)))
    bt, sl, pos, slots = _gpu_decode_slots(g, b, width, page)
    cos_sin = torch.randn(width * page, d, device="cuda", generator=g)
    x = torch.randn(b, hidden, device="cuda", generator=g).bfloat16()

    def step(outs):
        y = x
        for i, ((kc, vc, ks, vs), norm_w, (wqkv, sqkv), (wo, so)) in enumerate(layers):
            qkv = int8_gemm(*rmsnorm_quant(y, norm_w, 1e-5)[:2], wqkv, sqkv)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            qr = rope_kv_write(q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d), pos, cos_sin, kc, vc,
                               ks, vs, slots)
            o = decode_attention(qr, kc, vc, ks, vs, bt, sl, d ** -0.5)
            y = outs[i] = int8_gemm(*quant_per_token(o.reshape(b, hq * d)), wo, so)

    caches = [t for layer in layers for t in layer[0]]
    without, with_pdl = _graph_outputs_without_and_with_pdl(monkeypatch, caches, len(layers), step)
    for a, c in zip(without, with_pdl):
        assert torch.equal(a, c)
    assert all(torch.isfinite(o).all() and o.abs().sum() > 0 for o in with_pdl)


@gpu
@pytest.mark.parametrize("q_mult,k_mult,v_mult", [(30.0, 40.0, 1e-3), (1.0, 3000.0, 3000.0), (1e4, 1e-3, 1.0)])
def test_gpu_int8_attention_float16_range(q_mult, k_mult, v_mult):
    """The int8 cache is read in float16 (q scaled by a power of two): tiny values, values near the
    float16 limit and a q far outside it keep the FlashAttention rule, with atol scaled to V."""
    seqs = [(1, 1), (700, 300), (2500, 1)]
    sc = Scenario(seqs, 32, 8, 128, torch.int8, 32, device="cuda", seed=3, k_mult=k_mult, v_mult=v_mult)
    q = (torch.randn(sc.T, 32, 128, device="cuda") * q_mult).to(torch.bfloat16)
    scale = 128 ** -0.5
    out = prefill_attention(q, *sc.caches, sc.block_tables, sc.cu, sc.seq_lens, scale)
    _check_fa_rule(out, q, sc, scale, atol=1e-3 * v_mult)
    dsc = Scenario([(s, 1) for s, _ in seqs], 32, 8, 128, torch.int8, 32, device="cuda", seed=4, k_mult=k_mult,
                   v_mult=v_mult)
    qd = (torch.randn(len(seqs), 32, 128, device="cuda") * q_mult).to(torch.bfloat16)
    _check_fa_rule(decode_attention(qd, *dsc.caches, dsc.block_tables, dsc.seq_lens, scale), qd, dsc, scale,
                   atol=1e-3 * v_mult)


@gpu
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("cache", ["int8-32", "bf16"])
def test_gpu_rope_kv_write_bf16(cache, rope):
    torch.manual_seed(0)
    # 4M codes: with fused multiply-adds about 6 in a million came out one off
    t, hq, hkv, d, page, nb = 4000, 32, 8, 128, 16, 300
    cache_dtype, group = (torch.int8, 32) if cache == "int8-32" else (torch.bfloat16, d)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16) * 3
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4000, (t,), device="cuda")
    cs = cos_sin(4096, d).cuda()
    slots = torch.randperm(nb * page, device="cuda")[:t]
    slots[::7] = -1
    mine = empty_cache(nb, page, hkv, d, cache_dtype, group, "cuda")
    ref = empty_cache(nb, page, hkv, d, cache_dtype, group, "cuda")
    if rope:
        q_rot = rope_kv_write(q, k, v, pos, cs, *mine, slots)
        q_ref = R.rope_kv_write(q, k, v, pos, cs, *ref, slots)
    else:
        kv_write(k, v, *mine, slots)
        R.kv_write(k, v, *ref, slots)
        q_rot = q_ref = q  # nothing rotated
    # built without fused multiply-adds, the kernel rounds every product as the reference does: equal bit for bit
    assert torch.equal(q_rot, q_ref)
    for a, b in zip(mine, ref):  # the poisoned (NaN) slots too: bits, not values
        if a is not None:
            bits = {1: torch.int8, 2: torch.int16}[a.element_size()]
            assert torch.equal(a.view(bits), b.view(bits))


def test_tile_map_built_once_per_step_and_follows_in_place_changes():
    """The program -> (sequence, query tile) map: hand-computed, memoized per cu_seqlens_q tensor."""
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    first = pmod._tile_map(cu, 10, 4)
    assert pmod._tile_map(cu, 10, 4) is first  # the next layer of the same step
    cu[1] = 5  # sequences of 5 and 5 tokens: 2 tiles each, the longer-seeing tile first
    bound, tile_seq, tile_idx = pmod._tile_map(cu, 10, 4)
    assert bound == 5  # cdiv(10, 4) + 2 sequences
    assert tile_seq.tolist() == [0, 0, 1, 1, 2]  # 2 = past the last sequence: the program exits
    assert tile_idx.tolist()[:4] == [1, 0, 1, 0]
    other = torch.tensor([0, 5, 10], dtype=torch.int32)  # equal values, another tensor: rebuilt
    assert pmod._tile_map(other, 10, 4) is not pmod._tile_map(cu, 10, 4)


@pytest.mark.parametrize("ctx", [1, 65])
def test_prefill_full_query_tile_sees_its_last_key_at_a_key_tile_start(ctx):
    from eightbit.kernels.attention_configs import prefill_config
    from test_reference_ops import naive_attention

    cfg = prefill_config(64, torch.float32)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (128, 64)  # so ctx = 1 mod 64 puts key ctx + 127 at a tile start
    g = torch.Generator().manual_seed(ctx)
    n_q, hkv, hq, d, page = 128, 1, 2, 64, 16
    seq_len = ctx + n_q
    blocks = -(-seq_len // page)
    k_cache = torch.full((blocks, page, hkv, d), float("nan"))
    v_cache = k_cache.clone()
    keys, values = torch.randn(seq_len, hkv, d, generator=g), torch.randn(seq_len, hkv, d, generator=g)
    table = torch.randperm(blocks, generator=g).to(torch.int32).view(1, -1)
    slots = torch.tensor([int(table[0, p // page]) * page + p % page for p in range(seq_len)])
    R.kv_write(keys, values, k_cache, v_cache, None, None, slots)
    q = torch.randn(n_q, hq, d, generator=g)
    args = (k_cache, v_cache, None, None, table, torch.tensor([0, n_q], dtype=torch.int32),
            torch.tensor([seq_len], dtype=torch.int32), d ** -0.5)
    want = naive_attention(q, keys, values, ctx)  # float64 loops, scale d ** -0.5
    torch.testing.assert_close(prefill_attention(q, *args).double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(R.prefill_attention(q, *args).double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strided", ["q", "k", "cos_sin"])
def test_rope_kv_write_reads_strided_heads_and_rotary_rows(strided):
    g = torch.Generator().manual_seed(7)
    t, hq, hkv, d, page, nblk = 5, 4, 2, 32, 4, 3
    q, k, v = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    pos = torch.tensor([0, 3, 7, 2, 9])
    f = torch.outer(torch.arange(12, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos_sin = torch.cat([f.cos(), f.sin()], -1)
    if strided == "q":  # heads 2 * d apart
        q = torch.cat([q, torch.full_like(q, float("nan"))], -1)[..., :d]
    elif strided == "k":
        k = torch.cat([k, torch.full_like(k, float("nan"))], -1)[..., :d]
    else:  # rows of a wider table
        cos_sin = torch.cat([cos_sin, torch.full_like(cos_sin, float("nan"))], -1)[:, :d]
    slots = torch.tensor([0, 5, -1, 9, 11])
    outs = []
    for fn in (rope_kv_write, R.rope_kv_write):
        kc = torch.zeros(nblk, page, hkv, d)
        vc = torch.zeros(nblk, page, hkv, d)
        outs.append((fn(q, k, v, pos, cos_sin, kc, vc, None, None, slots), kc, vc))
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    x1, x2 = q[1, :, : d // 2].double(), q[1, :, d // 2:].double()  # position 3, in float64
    c, s = f[3].cos().double(), f[3].sin().double()
    torch.testing.assert_close(outs[0][0][1].double(), torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1), rtol=0,
                               atol=1e-5)


def test_prefill_config_switches_tables_at_long_prefill_tokens():
    from eightbit.kernels import attention_configs as C

    assert C.PREFILL[(128, "float")] != C.PREFILL_LONG[(128, "float")]  # else this test shows nothing
    n = C.LONG_PREFILL_TOKENS
    assert C.prefill_config(128, torch.float16, n - 1) == C.PREFILL[(128, "float")]
    assert C.prefill_config(128, torch.float16, n) == C.PREFILL_LONG[(128, "float")]


def test_kv_write_kernel_caps_large_groups_at_kv_absmax():
    # as quantize_groups does: a group's absmax is capped at 127 * 512, so every dequantized value fits float16
    from eightbit.quant.int8 import KV_ABSMAX, dequantize_groups

    d, group = 16, 8
    k = torch.zeros(2, 1, d)
    k[0, 0, 0], k[0, 0, 1], k[0, 0, 9] = 1e6, -3.0, -7e4  # two groups past the cap
    k[1, 0, 0] = 6e4  # under it
    v = -k
    kc = torch.zeros(1, 2, 1, d, dtype=torch.int8)
    vc = torch.zeros(R.v_cache_shape(1, 2, 1, d, torch.int8), dtype=torch.int8)
    ks = torch.zeros(1, 2, 1, d // group, dtype=torch.float16)
    vs = ks.clone()
    kv_write(k, v, kc, vc, ks, vs, torch.tensor([0, 1]))
    assert ks[0, 0, 0].tolist() == [512.0, 512.0] and vs[0, 0, 0].tolist() == [512.0, 512.0]
    back = dequantize_groups(kc[0, :, 0], ks[0, :, 0])
    assert back[0, 0] == KV_ABSMAX and back[0, 9] == -KV_ABSMAX and abs(back[1, 0] - 6e4) < 60
    assert torch.isfinite(back.half()).all()
