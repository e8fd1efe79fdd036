"""Both backends of every op refuse the same bad input with the same error (kernels/checks.py), and agree on the
edge cases they accept (empty batches, empty rows). The Triton wrappers run under TRITON_INTERPRET=1 here; every
case is refused before a kernel launches."""

import inspect

import pytest
import torch

from eightbit.kernels import decode_attention as dmod
from eightbit.kernels import int8_gemm as gmod
from eightbit.kernels import kv_write as kmod
from eightbit.kernels import metadata_checks, ops
from eightbit.kernels import prefill_attention as pmod
from eightbit.kernels import quant_per_token as qmod
from eightbit.kernels import reference as R
from eightbit.kernels import rmsnorm_quant as rmod
from eightbit.kernels import silu_mul_quant as smod
from eightbit.kernels.launch import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the Triton wrappers run on CPU tensors interpreted")

TRITON = {"rms_norm": rmod.rms_norm, "rmsnorm_quant": rmod.rmsnorm_quant, "silu_mul": smod.silu_mul,
          "silu_mul_quant": smod.silu_mul_quant, "quant_per_token": qmod.quant_per_token,
          "int8_gemm": gmod.int8_gemm, "rope_kv_write": kmod.rope_kv_write, "kv_write": kmod.kv_write,
          "prefill_attention": pmod.prefill_attention, "decode_attention": dmod.decode_attention}


def gemm_args(**change):
    a = dict(x_q=torch.ones(4, 32, dtype=torch.int8), x_scale=torch.ones(4, 1), w_q=torch.ones(8, 32, dtype=torch.int8),
             w_scale=torch.ones(8), bias=None, out_dtype=torch.float32)
    a.update(change)
    return a


def int8_cache(blocks=6, page=4, hkv=2, d=16, group=8):
    kc = torch.zeros(blocks, page, hkv, d, dtype=torch.int8)
    vc = torch.zeros(R.v_cache_shape(blocks, page, hkv, d, torch.int8), dtype=torch.int8)
    ks = torch.ones(blocks, page, hkv, d // group, dtype=torch.float16)
    return dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=ks.clone())


def kv_args(**change):
    a = dict(k=torch.randn(3, 2, 16), v=torch.randn(3, 2, 16), **int8_cache(), slot_mapping=torch.arange(3))
    a.update(change)
    return a


def rope_args(**change):
    a = dict(q=torch.randn(3, 4, 16), **kv_args(), positions=torch.arange(3), cos_sin_cache=torch.randn(10, 16))
    a.update(change)
    return a


def decode_args(**change):
    a = dict(q=torch.randn(2, 4, 16), **int8_cache(), block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
             seq_lens=torch.tensor([5, 8], dtype=torch.int32), softmax_scale=0.25)
    a.update(change)
    return a


def prefill_args(**change):
    a = decode_args(q=torch.randn(3, 4, 16), cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32))
    a.update(change)
    return a


BAD = [
    ("rms_norm", lambda: dict(x=torch.randn(4, 16), weight=torch.ones(8), eps=1e-5), "weight must have shape"),
    ("rms_norm", lambda: dict(x=torch.randn(4, 16), weight=torch.ones(16), eps=1e-5, residual=torch.randn(1, 16)),
     "residual shape"),
    ("silu_mul", lambda: dict(gate_up=torch.randn(2, 5)), "must be even"),
    ("silu_mul_quant", lambda: dict(gate_up=torch.randn(2, 5)), "must be even"),
    ("int8_gemm", lambda: gemm_args(x_q=torch.ones(4, 32)), "must be int8"),
    ("int8_gemm", lambda: gemm_args(x_q=torch.ones(2, 2, 32, dtype=torch.int8)), r"x_q must be \[M, K\]"),
    ("int8_gemm", lambda: gemm_args(w_q=torch.ones(8, 16, dtype=torch.int8)), "K mismatch"),
    ("int8_gemm", lambda: gemm_args(x_scale=torch.ones(1)), r"x_scale must be a \[4\] or \[4, 1\] tensor"),
    ("int8_gemm", lambda: gemm_args(w_scale=torch.ones(8).half()), "w_scale must be float32"),
    ("int8_gemm", lambda: gemm_args(bias=torch.ones(8, 1)), r"bias must be a \[8\] tensor"),
    ("int8_gemm", lambda: gemm_args(bias=torch.ones(8, dtype=torch.int32)), "bias must be a float tensor"),
    ("int8_gemm", lambda: gemm_args(out_dtype=torch.int8), "out_dtype must be one of"),  # int8 would wrap around
    ("kv_write", lambda: kv_args(k_scale=None, v_scale=None), "needs k_scale and v_scale"),
    ("kv_write", lambda: kv_args(k=torch.randn(3, 3, 16), v=torch.randn(3, 3, 16)), "heads/head_dim"),
    ("kv_write", lambda: kv_args(k=torch.randn(3, 32), v=torch.randn(3, 32)), r"must both be \[T, Hkv, D\]"),
    ("kv_write", lambda: kv_args(slot_mapping=torch.arange(3.0)), r"slot_mapping must be an int32/int64 \[3\]"),
    ("kv_write", lambda: kv_args(v_cache=torch.zeros(6, 4, 2, 16, dtype=torch.int8)), "int8 V cache is"),
    ("kv_write", lambda: kv_args(k_scale=torch.ones(6, 4, 2, 3), v_scale=torch.ones(6, 4, 2, 3)), "must divide"),
    ("rope_kv_write", lambda: rope_args(q=torch.randn(3, 4, 8)), r"q must be \[T=3, Hq, D=16\]"),
    ("rope_kv_write", lambda: rope_args(cos_sin_cache=torch.randn(10, 8)), r"cos_sin_cache must be \[max_pos"),
    ("rope_kv_write", lambda: rope_args(positions=torch.arange(3.0)), "positions must be an int32/int64"),
    ("rope_kv_write", lambda: rope_args(q=torch.randn(3, 4, 16).half()), "q is torch.float16 but k is"),
    ("decode_attention", lambda: decode_args(q=torch.randn(2, 3, 16)), "3 query heads are not a multiple of 2"),
    ("decode_attention", lambda: decode_args(q=torch.randn(1, 4, 16)), "block_tables has 2 rows for batch 1"),
    ("decode_attention", lambda: decode_args(q=torch.randn(2, 4, 8)), "cache head_dim 16 != q's 8"),
    ("decode_attention", lambda: decode_args(seq_lens=torch.tensor([5.0, 8.0])), "seq_lens must be an int32/int64"),
    ("decode_attention", lambda: decode_args(block_tables=torch.zeros(2, 2)), "block_tables must be an int32/int64"),
    ("decode_attention", lambda: decode_args(k_scale=torch.ones(6, 4, 2, 2, dtype=torch.int8),
                                             v_scale=torch.ones(6, 4, 2, 2, dtype=torch.int8)), "one float dtype"),
    ("prefill_attention", lambda: prefill_args(cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32)),
     r"cu_seqlens_q must be an int32/int64 \[3\]"),
    ("prefill_attention", lambda: prefill_args(k_scale=None, v_scale=None), "needs k_scale and v_scale"),
    # not tensors, or integers where the op computes in float: named, on both backends (the reference ran on
    # integer inputs, and both failed with an AttributeError from inside on a None or a list)
    ("rms_norm", lambda: dict(x=torch.ones(4, 16, dtype=torch.int32), weight=torch.ones(16), eps=1e-5),
     "rms_norm: x must be a float tensor"),
    ("rms_norm", lambda: dict(x=torch.randn(4, 16), weight=torch.ones(16), eps=1e-5,
                              residual=torch.ones(4, 16, dtype=torch.int64)), "rms_norm: residual must be a float"),
    ("rms_norm", lambda: dict(x=torch.randn(4, 16), weight=None, eps=1e-5), "weight must be a torch.Tensor, got None"),
    ("silu_mul", lambda: dict(gate_up=torch.ones(2, 4, dtype=torch.int32)), "gate_up must be a float tensor"),
    ("int8_gemm", lambda: gemm_args(x_scale=None), "int8_gemm: x_scale must be a torch.Tensor, got NoneType"),
    ("int8_gemm", lambda: gemm_args(w_scale=0.5), "w_scale must be a torch.Tensor, got float"),
    ("kv_write", lambda: kv_args(slot_mapping=[0, 1, 2]), "slot_mapping must be a torch.Tensor, got list"),
    ("kv_write", lambda: kv_args(k=torch.ones(3, 2, 16, dtype=torch.int8), v=torch.ones(3, 2, 16, dtype=torch.int8)),
     "kv_write: k must be a float tensor"),
    ("rope_kv_write", lambda: rope_args(cos_sin_cache=torch.ones(10, 16, dtype=torch.int32)),
     "cos_sin_cache must be a float tensor"),
    ("quant_per_token", lambda: dict(x=torch.ones(4, 16, dtype=torch.int32)), "quant_per_token: x must be a float"),
    ("quant_per_token", lambda: dict(x=torch.tensor(2.0)), "x must have at least one dimension, got a scalar"),
    # past K = 131071 a dot product of -128s wraps the int32 accumulator on both backends, silently
    ("int8_gemm", lambda: gemm_args(x_q=torch.ones(4, 131072, dtype=torch.int8), w_q=torch.ones(8, 131072,
                                                                                            dtype=torch.int8)),
     r"K = 131072 can overflow the int32 accumulator .* at most 131071"),
    ("decode_attention", lambda: decode_args(softmax_scale=None), "softmax_scale must be a number, got NoneType"),
    ("prefill_attention", lambda: prefill_args(softmax_scale=torch.tensor(0.25)), "softmax_scale must be a number"),
]


@pytest.mark.parametrize("op, make, message", BAD, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(BAD)])
def test_both_backends_refuse_alike_and_write_nothing(op, make, message):
    args = make()
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    errors = []
    for fn in (getattr(R, op), TRITON[op]):
        with pytest.raises((ValueError, TypeError), match=message) as caught:
            fn(**args)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]
    assert all(torch.equal(args[k].nan_to_num(1.0), v.nan_to_num(1.0)) for k, v in before.items())


@pytest.mark.parametrize("op", ["quant_per_token", "silu_mul_quant", "rmsnorm_quant"])
def test_rows_of_no_elements_give_zero_scales_on_both_backends(op):
    args = (torch.randn(3, 0),) if op != "rmsnorm_quant" else (torch.randn(3, 0), torch.ones(0), 1e-5)
    ref, kernel = getattr(R, op)(*args), TRITON[op](*args)
    for a, b in zip(ref, kernel):
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    assert ref[1].shape == (3, 1) and not ref[1].any()


def test_a_k_of_zero_gives_the_bias_on_both_backends():
    bias = torch.randn(8)
    empty = dict(x_q=torch.ones(4, 0, dtype=torch.int8), w_q=torch.ones(8, 0, dtype=torch.int8), bias=bias)
    for fn in (R.int8_gemm, gmod.int8_gemm):
        assert torch.equal(fn(**gemm_args(**empty)), bias.expand(4, 8))


def test_stale_ids_in_unused_table_columns_are_ignored_on_both_backends(monkeypatch):
    """A CUDA graph's table keeps old block ids past a sequence's end; the reference gathered every column and
    failed on one past the cache (an IndexError), though the metadata checks pass it and the kernel never reads it."""
    monkeypatch.setattr(metadata_checks, "ENABLED", True)
    gen = torch.Generator().manual_seed(0)
    cache = {k: torch.randint(-127, 128, v.shape, dtype=torch.int8, generator=gen) if v.dtype == torch.int8
             else torch.rand(v.shape, generator=gen).half() for k, v in int8_cache().items()}
    cache["q"] = torch.randn(2, 4, 16, generator=gen)
    stale = torch.tensor([[0, 1, 99], [2, 3, -7]], dtype=torch.int32)  # seq_lens 5 and 8 use two pages of 4
    padded = torch.tensor([[0, 1, -1], [2, 3, -1]], dtype=torch.int32)
    for fn in (R.decode_attention, dmod.decode_attention):
        want = fn(**decode_args(**cache, block_tables=padded))
        assert torch.equal(fn(**decode_args(**cache, block_tables=stale)), want) and want.abs().sum() > 0


def test_an_empty_decode_batch_on_both_backends():
    args = decode_args(q=torch.randn(0, 4, 16), block_tables=torch.zeros(0, 2, dtype=torch.int32),
                       seq_lens=torch.zeros(0, dtype=torch.int32))
    for fn in (R.decode_attention, dmod.decode_attention):
        assert fn(**args).shape == (0, 4, 16)


def test_the_metadata_checks_cover_the_reference(monkeypatch):
    """With the checks on, a seq_len past its block table is refused on the CPU too (without them the reference
    attends to the table's keys only)."""
    args = decode_args(seq_lens=torch.tensor([5, 50], dtype=torch.int32))
    monkeypatch.setattr(metadata_checks, "ENABLED", True)
    for fn in (R.decode_attention, dmod.decode_attention):
        with pytest.raises(ValueError, match=r"seq_lens\[1\] = 50 is outside 0..8"):
            fn(**args)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 24 is outside -1..23"):
        R.kv_write(**kv_args(slot_mapping=torch.tensor([0, 1, 24])))
    with pytest.raises(ValueError, match="sequence 0 has 2 queries but seq_len 1"):
        R.prefill_attention(**prefill_args(cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32),
                                           seq_lens=torch.tensor([1, 8], dtype=torch.int32)))


@pytest.mark.parametrize("op", sorted(TRITON))
def test_ops_show_the_signature_both_backends_share(op):
    """help(ops.X) shows the op's parameters, the Triton twin takes the same ones, and a keyword first argument
    is dispatched like a positional one."""
    assert inspect.signature(getattr(ops, op)) == inspect.signature(getattr(R, op)) == inspect.signature(TRITON[op])


def test_ops_take_their_first_argument_by_keyword():
    x = torch.randn(2, 5)
    assert all(torch.equal(a, b) for a, b in zip(ops.quant_per_token(x=x), R.quant_per_token(x)))


def test_the_reference_takes_float64_as_the_gpu_tests_oracle_and_the_kernels_refuse_it():
    """FlashAttention's accuracy rule measures the kernels against the reference run in float64."""
    args = prefill_args(q=torch.randn(3, 4, 16, dtype=torch.float64), k_cache=torch.randn(6, 4, 2, 16).double(),
                        v_cache=torch.randn(6, 4, 2, 16).double(), k_scale=None, v_scale=None)
    out = R.prefill_attention(**args)
    assert out.dtype == torch.float64 and out.isfinite().all()
    with pytest.raises(ValueError, match="q must be float16/bfloat16/float32, got torch.float64"):
        pmod.prefill_attention(**args)


def test_a_scale_with_more_elements_than_rows_is_refused():
    xq, wq = torch.ones(4, 32, dtype=torch.int8), torch.ones(8, 32, dtype=torch.int8)
    for fn in (R.int8_gemm, gmod.int8_gemm):
        with pytest.raises(ValueError, match=r"x_scale must be a \[4\] or \[4, 1\] tensor"):
            fn(xq, torch.ones(5), wq, torch.ones(8), None, torch.float32)
        with pytest.raises(ValueError, match=r"w_scale must be a \[8\] or \[8, 1\] tensor"):
            fn(xq, torch.ones(4), wq, torch.ones(16), None, torch.float32)


def test_a_v_cache_of_another_dtype_than_k_cache_is_refused():
    """int8 K with a float16 V of the token-major shape (the layout a float16 V would have): refused by the dtype, not
    by the shape; and a float16 K with a float32 V."""
    for kc, vc in ((torch.zeros(6, 4, 2, 16, dtype=torch.int8), torch.zeros(6, 4, 2, 16, dtype=torch.float16)),
                   (torch.zeros(6, 4, 2, 16, dtype=torch.float16), torch.zeros(6, 4, 2, 16, dtype=torch.float32))):
        scales = (torch.ones(6, 4, 2, 2, dtype=torch.float16),) * 2 if kc.dtype == torch.int8 else (None, None)
        for fn in (R.kv_write, kmod.kv_write):
            with pytest.raises(ValueError, match="v_cache must be"):
                fn(torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, vc, *scales, torch.arange(3))


def test_k_and_v_scales_of_different_float_dtypes_are_refused():
    kc = torch.zeros(6, 4, 2, 16, dtype=torch.int8)
    vc = torch.zeros(R.v_cache_shape(6, 4, 2, 16, torch.int8), dtype=torch.int8)
    ks, vs = torch.ones(6, 4, 2, 2, dtype=torch.float16), torch.ones(6, 4, 2, 2, dtype=torch.float32)
    for fn in (R.kv_write, kmod.kv_write):
        with pytest.raises(ValueError, match="scales must share one float dtype"):
            fn(torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, vc, ks, vs, torch.arange(3))


# --- review s62: the metadata checks' bounds by hand, and kv_dequant on a block-table view -----------------------


def test_metadata_checks_accept_their_edge_values_and_refuse_one_past_them():
    """Each check's range by hand: the last valid value passes, the first invalid one on either side is named."""
    M = metadata_checks
    i32 = dict(dtype=torch.int32)
    tables = torch.tensor([[0, 1], [2, 3]], **i32)  # 2 columns of 4 keys: seq_lens 0..8; blocks 0..3
    M.check_tables(tables, torch.tensor([8, 0], **i32), 4, 4, "t")  # a full table, an empty sequence
    for lens, bad in (([9, 0], "seq_lens[0] = 9 is outside 0..8"), ([3, -1], "seq_lens[1] = -1 is outside 0..8")):
        with pytest.raises(ValueError, match=f"t: {bad}".replace("[", r"\[").replace("]", r"\]")):
            M.check_tables(tables, torch.tensor(lens, **i32), 4, 4, "t")
    for block, seq_len in ((4, 5), (-1, 5), (-2, 8)):  # 5 keys use column 1's block (a partial one), as 8 do
        table = torch.tensor([[0, block], [2, 3]], **i32)
        with pytest.raises(ValueError, match=rf"t: block_tables\[0, 1\] = {block} is not a block of the cache \(0..3\)"):
            M.check_tables(table, torch.tensor([seq_len, 8], **i32), 4, 4, "t")
        M.check_tables(table, torch.tensor([4, 8], **i32), 4, 4, "t")  # 4 keys: column 1 unused, anything there
    # queries: offsets from 0, never falling, ending at most at q's rows; a sequence may have as many queries as keys
    M.check_queries(torch.tensor([0, 3, 5], **i32), torch.tensor([3, 2], **i32), 5, "p")  # whole prompts
    M.check_queries(torch.tensor([0, 0, 5], **i32), torch.tensor([0, 9], **i32), 6, "p")
    for cu, rows in (([1, 3, 5], 5), ([0, 3, 2], 5), ([0, 3, 6], 5), ([-1, 3, 5], 5)):
        with pytest.raises(ValueError, match=rf"p: cu_seqlens_q must rise from 0 to at most {rows} \(q's rows\)"):
            M.check_queries(torch.tensor(cu, **i32), torch.tensor([9, 9], **i32), rows, "p")
    with pytest.raises(ValueError, match="p: sequence 1 has 2 queries but seq_len 1"):
        M.check_queries(torch.tensor([0, 3, 5], **i32), torch.tensor([3, 1], **i32), 5, "p")
    # slots: -1 (padding) .. num_slots - 1
    M.check_slots(torch.tensor([-1, 0, 23]), 24, "w")
    for slot in (-2, 24):
        with pytest.raises(ValueError, match=rf"w: slot_mapping\[1\] = {slot} is outside -1..23"):
            M.check_slots(torch.tensor([0, slot, 3]), 24, "w")
    M.check_positions(torch.tensor([0, 7]), 8, "r")
    for pos in (-1, 8):
        with pytest.raises(ValueError, match=rf"r: positions\[1\] = {pos} is outside the rotary cache's 0..7"):
            M.check_positions(torch.tensor([0, pos]), 8, "r")


def test_metadata_checks_name_the_first_bad_entry():
    M = metadata_checks
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 30"):
        M.check_slots(torch.tensor([0, 30, -5, 40]), 24, "w")
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 20"):
        M.check_tables(torch.zeros(3, 2, dtype=torch.int32), torch.tensor([1, 20, -3]), 4, 4, "t")
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 9 "):
        M.check_tables(torch.tensor([[0, 9], [7, 8]]), torch.tensor([8, 8]), 4, 4, "t")


def test_whole_prompt_prefills_pass_the_metadata_checks_on_both_backends(monkeypatch):
    """The usual prefill, as many queries as keys in every sequence and a table filled to its last key, is in
    range: with the checks on both backends run it and agree."""
    monkeypatch.setattr(metadata_checks, "ENABLED", True)
    gen = torch.Generator().manual_seed(1)
    cache = {k: torch.randint(-127, 128, v.shape, dtype=torch.int8, generator=gen) if v.dtype == torch.int8
             else torch.rand(v.shape, generator=gen).half() for k, v in int8_cache().items()}
    args = prefill_args(**cache, q=torch.randn(13, 4, 16, generator=gen),
                        cu_seqlens_q=torch.tensor([0, 5, 13], dtype=torch.int32))  # seq_lens 5 and 8: full prompts
    want = R.prefill_attention(**args)
    torch.testing.assert_close(pmod.prefill_attention(**args), want, rtol=1e-4, atol=1e-4)
    assert want.isfinite().all()


def test_dequantize_blocks_reads_a_view_of_a_wider_block_table():
    """A mixed step passes the prefill sequences' rows and first columns of the engine's table
    (engine/context.py: block_tables[nd:, :prefill_width]), a view whose rows are further apart than its width.
    Each live block of the copy is k * scale (v too) of the block the view names, by hand in float64."""
    from eightbit.kernels.kv_dequant import dequantize_blocks

    gen = torch.Generator().manual_seed(3)
    nb, page, hkv, d, group = 10, 4, 2, 16, 8
    kc = torch.randint(-127, 128, (nb, page, hkv, d), dtype=torch.int8, generator=gen)
    vc = torch.randint(-127, 128, R.v_cache_shape(nb, page, hkv, d, torch.int8), dtype=torch.int8, generator=gen)
    ks = torch.rand(nb, page, hkv, d // group, generator=gen).half()
    vs = torch.rand(nb, page, hkv, d // group, generator=gen).half()
    full = torch.tensor([[9, 9, 9, 9, 9], [4, 7, 1, 0, 0], [2, 5, 8, 3, 6], [6, 3, 0, 0, 0]], dtype=torch.int32)
    table, lens = full[1:, :3], torch.tensor([9, 12, 5], dtype=torch.int32)  # 3, 3 and 2 blocks of 4
    assert not table.is_contiguous() and table.stride(0) == 5
    k, v, out_table = dequantize_blocks(kc, vc, ks, vs, table, lens, torch.float32)
    assert torch.equal(out_table, torch.arange(9, dtype=torch.int32).view(3, 3))
    v_tok = vc.permute(0, 3, 1, 2)  # the int8 V cache is key-minor: [blocks, Hkv, D, page]
    for b in range(3):
        for j in range(-(-int(lens[b]) // page)):
            blk = int(table[b, j])
            want_k = kc[blk].double() * ks[blk].double().repeat_interleave(group, dim=-1)
            want_v = v_tok[blk].double() * vs[blk].double().repeat_interleave(group, dim=-1)
            assert torch.equal(k[b * 3 + j].double(), want_k), (b, j)
            assert torch.equal(v[b * 3 + j].double(), want_v), (b, j)
