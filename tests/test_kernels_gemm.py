"""Tests of the W8A8 GEMM and the fused per-token quantizers against kernels/reference.py.

CPU (CI): the Triton kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest.py sets it before
anything imports triton; with a GPU it sets 0).
The interpreter mishandles bf16 arithmetic, so the CPU tests use fp16/fp32.
GPU (`pytest -m gpu`): the same checks on CUDA tensors in bf16, plus every
committed table shape, split-K determinism and CUDA-graph capture.
"""

import json
import zlib

import pytest
import torch

from eightbit.kernels import reference as R
from eightbit.kernels import gemm_configs
from eightbit.kernels.gemm_configs import GemmConfig
from eightbit.kernels.int8_gemm import _int8_gemm_kernel, int8_gemm, int8_gemm_with_config
from eightbit.kernels.quant_per_token import quant_per_token
from eightbit.kernels.rmsnorm_quant import rms_norm, rmsnorm_quant
from eightbit.kernels.silu_mul_quant import silu_mul, silu_mul_quant

INTERPRETED = type(_int8_gemm_kernel).__name__ == "InterpretedFunction"
cpu = pytest.mark.skipif(not INTERPRETED, reason="Triton kernels were imported without TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and TRITON_INTERPRET unset/0")


@pytest.fixture
def poison(monkeypatch):
    """Make every torch.empty come back full of NaN (floats) or -128 (int8, never produced by quantization)."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.int8:
            t.fill_(-128)
        elif t.dtype == torch.int32:
            t.fill_(-(2**31))
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g


def _int8(shape, g, device):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8).to(device)


# --- the GEMM -----------------------------------------------------------------------------

SMALL_CONFIGS = [
    GemmConfig(16, 32, 32, group_m=1, split_k=1, num_warps=4, num_stages=2),
    GemmConfig(16, 64, 64, group_m=1, split_k=3, num_warps=4, num_stages=2),
    GemmConfig(32, 32, 64, group_m=2, split_k=1, num_warps=4, num_stages=2),
    GemmConfig(64, 64, 128, group_m=8, split_k=2, num_warps=4, num_stages=2),
    GemmConfig(128, 32, 64, group_m=1, split_k=2, num_warps=4, num_stages=2),  # 128 rows: scales loaded after the loop
]
SHAPES = [(1, 50, 100), (1, 64, 256), (17, 33, 96), (70, 96, 200), (33, 20, 32)]
GEMV_CONFIGS = [  # block_m = activation rows per program; block_k in bytes (a multiple of 4)
    GemmConfig(1, 16, 64, split_k=1, num_warps=4, num_stages=1, kernel="gemv"),
    GemmConfig(2, 16, 32, split_k=3, num_warps=4, num_stages=1, kernel="gemv"),
    GemmConfig(4, 32, 64, split_k=2, num_warps=4, num_stages=1, kernel="gemv"),
    GemmConfig(8, 16, 128, split_k=4, num_warps=4, num_stages=1, kernel="gemv"),
]
GEMV_SHAPES = [(1, 50, 100), (3, 33, 96), (8, 40, 160), (11, 20, 64), (2, 64, 260)]


def _check_gemm_exact(device, cfg, m, n, k, seed):
    """Scales of 1, fp32 out, |acc| < 2^24: the float result is the exact int32 accumulator."""
    g = _gen(seed)
    xq, wq = _int8((m, k), g, device), _int8((n, k), g, device)
    xq[0, : k // 2] = -128  # the -128 edge in both operands
    wq[-1, : k // 2] = -128
    ones_m = torch.ones(m, 1, device=device)
    ones_n = torch.ones(n, 1, device=device)
    out = torch.full((m, n), float("nan"), device=device)
    int8_gemm_with_config(xq, ones_m, wq, ones_n, None, torch.float32, cfg, out=out)
    acc = xq.cpu().long() @ wq.cpu().long().t()
    assert torch.equal(out.cpu().double(), acc.double())


def _check_gemm_ref(device, cfg, m, n, k, seed, out_dtype, with_bias):
    g = _gen(seed)
    xq, wq = _int8((m, k), g, device), _int8((n, k), g, device)
    xs = (torch.rand(m, 1, generator=g) * 0.02 + 1e-3).to(device)
    ws = (torch.rand(n, 1, generator=g) * 0.02 + 1e-3).to(device)
    bias = torch.randn(n, generator=g).to(device, out_dtype if out_dtype != torch.float32 else torch.float32)
    bias = bias if with_bias else None
    xq[m // 2] = 0  # a zero row with a zero scale
    xs[m // 2] = 0
    out = torch.full((m, n), float("nan"), device=device, dtype=out_dtype)
    int8_gemm_with_config(xq, xs, wq, ws, bias, out_dtype, cfg, out=out)
    ref = R.int8_gemm(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), None if bias is None else bias.cpu(), out_dtype)
    out = out.cpu()
    assert torch.isfinite(out).all()
    if device == "cpu":  # the interpreter runs the epilogue's float32 ops in the reference's order: bit for bit
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    else:  # compiled (GPU): one rounding of the output dtype apart at most
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    expect_zero_row = bias.float() if bias is not None else torch.zeros(n)
    torch.testing.assert_close(out[m // 2].float(), expect_zero_row.cpu().to(out_dtype).float())


EXACT_CASES = ([(c, s) for c in SMALL_CONFIGS for s in SHAPES] + [(c, s) for c in GEMV_CONFIGS for s in GEMV_SHAPES])


@cpu
@pytest.mark.parametrize("cfg,shape", EXACT_CASES,
                         ids=[f"{c.kernel}{c.block_m}x{c.block_n}x{c.block_k}s{c.split_k}-{s}" for c, s in EXACT_CASES])
def test_gemm_int32_exact_cpu(cfg, shape):
    seed = zlib.crc32(repr((cfg, shape)).encode()) % 1000  # the same in every process (hash() of a str is not)
    _check_gemm_exact("cpu", cfg, *shape, seed=seed)


@cpu
@pytest.mark.parametrize("cfg", GEMV_CONFIGS[1:3], ids=lambda c: f"gemv{c.block_m}x{c.block_n}x{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_reference_cpu(cfg, with_bias):
    _check_gemm_ref("cpu", cfg, 3, 40, 96, seed=5, out_dtype=torch.float16, with_bias=with_bias)


@cpu
def test_gemv_split_k_buffers_reset_and_fallback_cpu():
    from eightbit.kernels import int8_gemm as mod

    cfg = GemmConfig(2, 16, 32, split_k=4, num_warps=4, num_stages=1, kernel="gemv")
    g = _gen(12)
    xq, wq = _int8((3, 160), g, "cpu"), _int8((40, 160), g, "cpu")
    one_m, one_n = torch.ones(3, 1), torch.ones(40, 1)
    a = int8_gemm_with_config(xq, one_m, wq, one_n, None, torch.float32, cfg)
    b = int8_gemm_with_config(xq, one_m, wq, one_n, None, torch.float32, cfg)
    assert torch.equal(a, b) and torch.equal(a, (xq.long() @ wq.long().t()).float())
    assert int(mod._locks[("cpu", None)].abs().sum()) == 0
    assert int(mod._gemv_acc[("cpu", None)].abs().sum()) == 0
    # K not a multiple of 4 (or a misaligned view): the gemv config falls back to the dot kernel
    for xk, wk in ((xq[:, :150], wq[:, :150]), (xq[:, 1:157], wq[:, 1:157])):
        out = int8_gemm_with_config(xk, one_m, wk, one_n, None, torch.float32, cfg)
        assert torch.equal(out, (xk.long() @ wk.long().t()).float())


@cpu
@pytest.mark.parametrize("cfg", [*SMALL_CONFIGS[:2], SMALL_CONFIGS[-1]],
                         ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("shape", [(1, 50, 100), (37, 70, 96)], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_reference_cpu(cfg, shape, out_dtype, with_bias):
    _check_gemm_ref("cpu", cfg, *shape, seed=7, out_dtype=out_dtype, with_bias=with_bias)


WS_CONFIGS = [GemmConfig(128, 256, 64, 8, 1, 4, 6, "ws"), GemmConfig(128, 128, 128, 8, 1, 4, 4, "ws"),
              GemmConfig(128, 192, 64, 8, 1, 4, 6, "ws"),  # 192 = 128 + 64: two accumulators per consumer
              GemmConfig(128, 96, 128, 8, 1, 4, 6, "ws")]  # 96 = 64 + 32


@cpu
def test_gemm_ws_config_falls_back_off_hopper_cpu(monkeypatch):
    """The Gluon kernel has no interpreter: a "ws" config runs the Triton dot kernel on the CPU, exactly."""
    from eightbit.kernels import int8_gemm as mod

    monkeypatch.setattr(mod, "_launch_ws", lambda *a: pytest.fail("the Gluon kernel was launched on the CPU"))
    _check_gemm_exact("cpu", WS_CONFIGS[1], 37, 80, 96, seed=8)
    _check_gemm_ref("cpu", WS_CONFIGS[0], 5, 40, 64, seed=9, out_dtype=torch.float16, with_bias=True)
    with pytest.raises(ValueError, match="unknown int8_gemm kernel"):  # e.g. a table from before "tma" was removed
        int8_gemm_with_config(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1), torch.zeros(16, 32, dtype=torch.int8),
                              torch.ones(16, 1), config=GemmConfig(128, 128, 128, 8, 1, 8, 3, "tma"))


SWAP_CONFIGS = [GemmConfig(8, 64, 256, 1, 1, 4, 6, "swap"), GemmConfig(16, 128, 128, 1, 3, 4, 4, "swap"),
                GemmConfig(8, 64, 128, 1, 8, 4, 3, "swap"), GemmConfig(64, 128, 64, 1, 2, 4, 3, "swap")]


@cpu
def test_gemm_swap_config_falls_back_off_hopper_cpu(monkeypatch):
    """The small-M Gluon kernel has no interpreter either: a "swap" config runs the Triton dot kernel on the CPU."""
    from eightbit.kernels import int8_gemm as mod

    monkeypatch.setattr(mod, "_launch_swap", lambda *a: pytest.fail("the Gluon kernel was launched on the CPU"))
    _check_gemm_exact("cpu", SWAP_CONFIGS[1], 13, 80, 96, seed=8)
    _check_gemm_ref("cpu", SWAP_CONFIGS[0], 5, 40, 64, seed=9, out_dtype=torch.float16, with_bias=True)


@cpu
def test_gemm_swap_host_launch_arguments_cpu(monkeypatch):
    """The small-M Gluon kernel's host side (it runs only on sm_90): every kernel parameter named, one program per
    BLOCK_N weight rows and K range, no empty K range, the activation box as tall as the config's rows, few
    registers, PDL as asked; configs and operands it cannot take are refused."""
    from eightbit.kernels import int8_gemm_swap as S

    calls = []
    monkeypatch.setattr(S, "_launch_kernel", lambda grid, args, **opts: calls.append((grid, args, opts)))
    m, n, k = 5, 1040, 2080  # N off the 64-row tile, K off the 256-byte step: 9 steps
    xq, wq = torch.zeros(m, k, dtype=torch.int8), torch.zeros(n, k, dtype=torch.int8)
    xs, ws = torch.ones(m, 1), torch.ones(n, 1)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    sums, counters = torch.zeros(m * n, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    for split_k, want in ((1, 1), (2, 2), (4, 3), (8, 5), (100, 9)):  # 9 steps: 5 / 3 / 3 ... per range
        cfg = GemmConfig(8, 64, 256, 1, split_k, 4, 4, "swap")
        assert S.splits(k, 256, split_k) == want
        S.launch_swap(xq, xs, wq, ws, None, out, m, n, k, cfg, sums, counters)
        grid, args, opts = calls[-1]
        assert sorted(args) == sorted(S._int8_gemm_swap_kernel.arg_names)
        assert grid == (17, want) and args["SPLIT_K"] == want and opts["maxnreg"] == 64
        assert list(args["w_desc"].block_shape) == [64, 256] and list(args["x_desc"].block_shape) == [8, 256]
        assert args["PDL"] is False and "launch_pdl" not in opts
    S.launch_swap(xq, xs, wq, ws, None, out, m, n, k, SWAP_CONFIGS[1], sums, counters, pdl=True, trigger=True)
    grid, args, opts = calls[-1]
    assert grid == (9, 3) and list(args["x_desc"].block_shape) == [16, 128]
    assert args["PDL"] is True and args["TRIGGER"] is True and opts["launch_pdl"] is True
    S.launch_swap(xq, xs, wq, ws, None, out, m, n, k, SWAP_CONFIGS[3], sums, counters)
    assert calls[-1][2]["maxnreg"] == 96  # a 128 x 64 accumulator: 64 registers a thread would spill
    assert all(S.config_ok(c) for c in SWAP_CONFIGS)
    for bad in (GemmConfig(12, 64, 256, 1, 1, 4, 4, "swap"), GemmConfig(8, 96, 256, 1, 1, 4, 4, "swap"),
                GemmConfig(8, 64, 512, 1, 1, 4, 4, "swap"), GemmConfig(8, 64, 256, 1, 1, 8, 4, "swap"),
                GemmConfig(64, 128, 256, 1, 1, 4, 6, "swap")):  # 6 slots of 48 KB: more than the shared memory
        assert not S.config_ok(bad), bad
    # the operands it refuses (int8_gemm then runs the dot kernel); on this CPU only because it is not sm_90 ...
    cfg = SWAP_CONFIGS[0]
    assert not S.swap_ok(xq, wq, out, cfg)
    monkeypatch.setattr(S, "is_sm90", lambda device: True)  # ... and with that aside, for each reason below
    base = torch.zeros(16 * 2112 + 16, dtype=torch.int8)
    aligned = base[(-base.data_ptr()) % 16:]  # a 16-byte aligned start
    x_ok = aligned[: m * k].view(m, k)
    assert S.swap_ok(x_ok, wq, out, cfg) == (wq.data_ptr() % 16 == 0)
    w_ok = torch.zeros(n * k + 16, dtype=torch.int8)
    w_ok = w_ok[(-w_ok.data_ptr()) % 16:][: n * k].view(n, k)
    assert S.swap_ok(x_ok, w_ok, out, cfg)
    assert not S.swap_ok(aligned[: 9 * k].view(9, k), w_ok, torch.empty(9, n), cfg)  # M = 9 > 8 rows
    assert not S.swap_ok(x_ok, w_ok, torch.empty(n, m).t(), cfg)  # output columns not contiguous
    assert not S.swap_ok(aligned[1 : m * k + 1].view(m, k), w_ok, out, cfg)  # base not 16-byte aligned
    assert not S.swap_ok(aligned[: m * 2088].view(m, 2088)[:, :2080], w_ok, out, cfg)  # row stride 2088 % 16 != 0
    assert not S.swap_ok(x_ok, w_ok, out, GemmConfig(8, 96, 256, 1, 1, 4, 4, "swap"))


@cpu
def test_gemm_swap_splits_match_the_kernels_k_ranges_cpu():
    """splits() (the grid's K ranges) against the kernel's own arithmetic, per_split = cdiv(steps, SPLIT_K) and range
    s = [s * per_split, min((s + 1) * per_split, steps)): every range holds a step, together they hold each once."""
    from eightbit.kernels.int8_gemm_swap import splits

    for k in (1, 16, 255, 256, 257, 2048, 2080, 4096, 14336):
        for block_k in (64, 128, 256):
            steps = -(-k // block_k)
            for split_k in range(1, 20):
                got = splits(k, block_k, split_k)
                per = -(-steps // got)
                ranges = [range(s * per, min((s + 1) * per, steps)) for s in range(got)]
                assert 1 <= got <= min(split_k, steps) and all(len(r) >= 1 for r in ranges), (k, block_k, split_k)
                assert sorted(i for r in ranges for i in r) == list(range(steps))


@cpu
def test_gemm_ws_host_launch_arguments_cpu(monkeypatch):
    """The Gluon kernel's host side (it runs only on sm_90): every kernel parameter named, one program per SM
    at most, TMA store for aligned 16-bit outputs, stores from registers otherwise, bad configs refused."""
    from eightbit.kernels import int8_gemm_hopper as H

    calls = []
    monkeypatch.setattr(H, "_launch_kernel", lambda grid, args, **opts: calls.append((grid, args, opts)))
    m, n, k = 300, 1040, 2048
    xq, wq = torch.zeros(m, k, dtype=torch.int8), torch.zeros(n, k, dtype=torch.int8)
    xs, ws = torch.ones(m, 1), torch.ones(n, 1)
    for dtype, tma_store in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        H.launch_ws(xq, xs, wq, ws, None, torch.empty(m, n, dtype=dtype), m, n, k, WS_CONFIGS[0], 132)
        grid, args, opts = calls[-1]
        assert sorted(args) == sorted(H._int8_gemm_ws_kernel.arg_names)
        assert grid == (min(132, 3 * 5),) and args["TMA_STORE"] is tma_store and opts["num_warps"] == 4
        assert list(args["a_desc"].block_shape) == [64, 64] and list(args["b_desc"].block_shape) == [256, 64]
        assert args["TAIL"] is False and args["b1_desc"] is args["b_desc"]
    # 192 wide: a 128-wide and a 64-wide accumulator, each with its own weight and output boxes
    for dtype, tma_store in ((torch.bfloat16, True), (torch.float32, False)):
        H.launch_ws(xq, xs, wq, ws, None, torch.empty(m, n, dtype=dtype), m, n, k, WS_CONFIGS[2], 132)
        grid, args, _ = calls[-1]
        assert grid == (min(132, 3 * 6),) and args["TAIL"] is True
        assert list(args["b_desc"].block_shape) == [128, 64] and list(args["b1_desc"].block_shape) == [64, 64]
        assert list(args["c1_desc"].block_shape) == ([64, 64] if tma_store else [8, 16])
    assert calls[-1][1]["PDL"] is False and "launch_pdl" not in calls[-1][2]
    H.launch_ws(xq, xs, wq, ws, None, torch.empty(m, n, dtype=torch.bfloat16), m, n, k, WS_CONFIGS[0], 132, pdl=True)
    assert calls[-1][1]["PDL"] is True and calls[-1][2]["launch_pdl"] is True
    unaligned = torch.empty(m, n + 3, dtype=torch.bfloat16)[:, :n]  # row stride of 1043 elements: no TMA store
    H.launch_ws(xq, xs, wq, ws, None, unaligned, m, n, k, WS_CONFIGS[0], 132)
    assert calls[-1][1]["TMA_STORE"] is False
    with pytest.raises(ValueError, match="block_m"):
        H.launch_ws(xq, xs, wq, ws, None, torch.empty(m, n, dtype=torch.bfloat16), m, n, k,
                    GemmConfig(64, 256, 64, 8, 1, 4, 6, "ws"), 132)
    with pytest.raises(ValueError, match="sum of two"):  # 160 + 64 would need a third accumulator
        H.launch_ws(xq, xs, wq, ws, None, torch.empty(m, n, dtype=torch.bfloat16), m, n, k,
                    GemmConfig(128, 224, 64, 8, 1, 4, 6, "ws"), 132)


@cpu
def test_gemm_pdl_launch_rule_cpu(monkeypatch):
    """Which GEMM launches use PDL (kernels/pdl.py) where it is available: the Triton kernels up to PDL_MAX_M rows,
    the Gluon kernel never, unless the config (a table entry's mark) says otherwise. Without the chain the marks
    are ignored (they were measured with it) and the Triton kernels wait but do not let the next kernel start
    early. Only in the chain do the Triton kernels prefetch weight lines before their wait, and the dot kernel
    allow its dependents before its K loop ends. A config's pdl flag is how it launches, not which kernel it is:
    equality and key() ignore it."""
    import dataclasses

    from eightbit.kernels import int8_gemm as mod

    dev = torch.device("cpu")
    assert mod._pdl(dev, 8, SMALL_CONFIGS[0]) == mod._PLAIN_LAUNCH  # no PDL off sm_90
    monkeypatch.setattr(mod, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(mod, "chain_enabled", lambda device: True)
    dot, ws = SMALL_CONFIGS[3], WS_CONFIGS[1]
    assert mod._pdl(dev, mod.PDL_MAX_M, dot) == mod._CHAIN_LAUNCH
    assert mod._pdl(dev, mod.PDL_MAX_M + 1, dot) == mod._PLAIN_LAUNCH
    assert mod._pdl(dev, 8, ws) == mod._PLAIN_LAUNCH
    assert mod._pdl(dev, 4096, dataclasses.replace(ws, pdl=True)) == mod._CHAIN_LAUNCH
    assert mod._pdl(dev, 256, dataclasses.replace(dot, pdl=True)) == mod._CHAIN_LAUNCH
    assert mod._pdl(dev, 8, dataclasses.replace(dot, pdl=False)) == mod._PLAIN_LAUNCH
    assert mod._prefetch_lines(mod._pdl(dev, 8, dot)[0]) == mod.PREFETCH_LINES > 0
    assert mod._prefetch_lines(mod._PLAIN_LAUNCH[0]) == 0
    # in the chain the dot kernel allows its dependents a few K steps early, up to TRIGGER_AHEAD_MAX_M rows
    assert mod._trigger_ahead(8, mod._pdl(dev, 8, dot)[0]) == mod.TRIGGER_AHEAD_STEPS > 0
    big = mod.TRIGGER_AHEAD_MAX_M + 1
    assert mod._trigger_ahead(big, mod._pdl(dev, big, dataclasses.replace(dot, pdl=True))[0]) == 0
    assert mod._trigger_ahead(8, mod._PLAIN_LAUNCH[0]) == 0
    from eightbit.kernels import int8_gemm_hopper as H  # the Gluon launch gets the same decision

    seen = []
    monkeypatch.setattr(H, "launch_ws", lambda *args: seen.append(args[-1]))
    xq, wq = torch.zeros(256, 64, dtype=torch.int8), torch.zeros(128, 64, dtype=torch.int8)
    for cfg in (ws, dataclasses.replace(ws, pdl=True)):
        mod._launch_ws(xq, torch.ones(256, 1), wq, torch.ones(128, 1), None, None, 256, 128, 64, cfg)
    assert seen == [False, True]
    monkeypatch.setattr(mod, "chain_enabled", lambda device: False)
    assert mod._pdl(dev, 8, dot) == mod._PDL_LAUNCH  # waits, but lets no kernel after it start early
    assert mod._prefetch_lines(mod._pdl(dev, 8, dot)[0]) == 0  # and prefetches nothing: the old launch
    assert mod._trigger_ahead(8, mod._pdl(dev, 8, dot)[0]) == 0  # nor triggers (it lets no kernel start early)
    assert mod._pdl(dev, 8, dataclasses.replace(dot, pdl=False)) == mod._PDL_LAUNCH
    assert mod._pdl(dev, 256, dataclasses.replace(dot, pdl=True)) == mod._PLAIN_LAUNCH
    assert mod._pdl(dev, 256, dataclasses.replace(ws, pdl=True)) == mod._PLAIN_LAUNCH
    flagged = dataclasses.replace(ws, pdl=True)
    assert flagged == ws and flagged.key() == ws.key() and hash(flagged) == hash(ws)
    assert GemmConfig(**flagged.to_dict()).pdl is True and "pdl" not in ws.to_dict()


@cpu
def test_gemm_default_config_and_table_lookup_cpu(poison):
    # SmolLM2-135M's o-projection shape through the public entry point (table or default config)
    g = _gen(3)
    m, n, k = 3, 576, 576
    xq, wq = _int8((m, k), g, "cpu"), _int8((n, k), g, "cpu")
    xs, ws = torch.rand(m, 1, generator=g) + 0.1, torch.rand(n, 1, generator=g) + 0.1
    out = int8_gemm(xq, xs, wq, ws, out_dtype=torch.float32)
    torch.testing.assert_close(out, R.int8_gemm(xq, xs, wq, ws, None, torch.float32), rtol=0, atol=0)


@cpu
def test_gemm_split_k_counters_reset_cpu():
    from eightbit.kernels import int8_gemm as mod

    cfg = GemmConfig(16, 32, 32, group_m=1, split_k=4, num_warps=4, num_stages=2)
    g = _gen(11)
    xq, wq = _int8((5, 160), g, "cpu"), _int8((40, 160), g, "cpu")
    one_m, one_n = torch.ones(5, 1), torch.ones(40, 1)
    a = int8_gemm_with_config(xq, one_m, wq, one_n, None, torch.float32, cfg)
    b = int8_gemm_with_config(xq, one_m, wq, one_n, None, torch.float32, cfg)
    assert torch.equal(a, b) and torch.equal(a, (xq.long() @ wq.long().t()).float())
    assert int(mod._locks[("cpu", None)].abs().sum()) == 0


@cpu
def test_gemm_rejects_bad_inputs_cpu():
    xq = torch.zeros(4, 64, dtype=torch.int8)
    wq = torch.zeros(32, 64, dtype=torch.int8)
    xs, ws = torch.ones(4, 1), torch.ones(32, 1)
    with pytest.raises(TypeError, match="x_q and w_q must be int8"):
        int8_gemm(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match="K mismatch"):
        int8_gemm(xq, xs, wq[:, :32], ws)
    with pytest.raises(ValueError, match="contiguous last"):
        int8_gemm(xq.t().contiguous().t(), xs, wq, ws)  # K not contiguous
    with pytest.raises(ValueError, match=r"x_scale must be a \[4\] or \[4, 1\] tensor"):
        int8_gemm(xq, torch.ones(3, 1), wq, ws)
    with pytest.raises(TypeError, match="x_scale must be float32"):
        int8_gemm(xq, xs.half(), wq, ws)
    with pytest.raises(ValueError, match=r"bias must be a \[32\] tensor"):
        int8_gemm(xq, xs, wq, ws, bias=torch.ones(31))
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        int8_gemm(xq, xs, wq, ws, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="x_scale must be contiguous"):
        int8_gemm(xq, torch.ones(4, 2)[:, 0], wq, ws)


def _assert_entries_well_formed(table):
    for (mb, n, k), cfg in table.items():
        assert mb in gemm_configs.M_BUCKETS and n > 0 and k > 0
        if cfg.kernel == "gemv":
            assert cfg.block_m in (1, 2, 4, 8) and cfg.block_k % 16 == 0 and cfg.block_n >= 8
        elif cfg.kernel == "swap":
            assert cfg.block_m in (8, 16, 32, 64) and mb <= cfg.block_m and cfg.block_n in (64, 128)
            assert cfg.block_k in (64, 128, 256) and cfg.num_warps == 4
        else:
            assert cfg.kernel in ("dot", "ws") and cfg.block_k >= 32 and cfg.block_m >= 16 and cfg.block_n >= 16
            assert cfg.kernel == "dot" or cfg.split_k == 1
            assert cfg.kernel != "ws" or (cfg.block_m == 128 and cfg.num_warps == 4)
        assert cfg.pdl is None or isinstance(cfg.pdl, bool)


def test_config_table_is_well_formed():
    with open(gemm_configs.TABLE_PATH) as f:  # the committed table, as installed: a missing file fails here
        entries = json.load(f)["configs"]
    table = gemm_configs.table_entries()
    assert len(table) == len(entries) > 0  # one entry per (bucket, n, k), none lost when read
    first = entries[0]
    assert table[(first["m_bucket"], first["n"], first["k"])] == gemm_configs.GemmConfig(**first["config"])
    _assert_entries_well_formed(table)
    assert gemm_configs.m_bucket(1) == 1 and gemm_configs.m_bucket(3) == 4 and gemm_configs.m_bucket(17) == 32
    assert gemm_configs.m_bucket(100000) == gemm_configs.M_BUCKETS[-1]
    for m in (1, 3, 8, 64, 65, 5000):
        cfg = gemm_configs.get_config(m, 4096, 4096)
        assert cfg.block_k >= 32 and (cfg.kernel != "gemv" or m <= 8 * cfg.block_m)


def test_per_device_entries_are_well_formed_and_replace_the_tables_on_their_device():
    with open(gemm_configs.BY_DEVICE_PATH) as f:  # committed, as installed
        files = json.load(f)
    assert files and set(files) == set(gemm_configs.devices_with_entries())
    base = gemm_configs.table_entries()
    for name, section in files.items():
        own = gemm_configs.device_entries(name)
        assert len(own) == len(section["configs"]) > 0
        _assert_entries_well_formed(own)
        for e in section["configs"]:  # read as written, PDL mark included (GemmConfig's == ignores it)
            key = (e["m_bucket"], e["n"], e["k"])
            assert gemm_configs.get_config(*key, name).to_dict() == GemmConfig(**e["config"]).to_dict()
        other = next(key for key in base if key not in own)
        assert gemm_configs.get_config(*other, name) is base[other]


def _device_entries_for_test(monkeypatch, by_device):
    """gemm_configs as if gemm_configs_by_device.json held by_device (None: read it again), its caches empty."""
    monkeypatch.setattr(gemm_configs, "_by_device", by_device)
    monkeypatch.setattr(gemm_configs, "_merged", {})
    monkeypatch.setattr(gemm_configs, "_memo", {})


def test_device_entries_take_precedence_only_on_their_device(monkeypatch):
    base = gemm_configs.table_entries()
    (mb, n, k) = next(key for key in base if key[0] == 8)
    mine = GemmConfig(16, 32, 512, 1, 1, 2, 3)
    assert base[(mb, n, k)] != mine
    _device_entries_for_test(monkeypatch, {"Fake GPU": {(mb, n, k): mine}})
    assert gemm_configs.get_config(mb, n, k, "Fake GPU") == mine
    assert gemm_configs.get_config(mb - 1, n, k, "Fake GPU") == mine  # M 5..8 share bucket 8
    assert gemm_configs.get_config(mb, n, k, "Other GPU") == base[(mb, n, k)]
    assert gemm_configs.get_config(mb, n, k) == base[(mb, n, k)]
    monkeypatch.setattr(gemm_configs, "USE_DEVICE_ENTRIES", False)  # EIGHTBIT_GEMM_BY_DEVICE=0
    assert gemm_configs.get_config(mb, n, k, "Fake GPU") == base[(mb, n, k)]
    assert gemm_configs.device_entries("Fake GPU") == {}


@pytest.mark.parametrize("text", ['[]', '{"NVIDIA H200": []}', '{"NVIDIA H200": {"configs": [{"m_bucket": 8}]}}',
                                  '{"NVIDIA H200": {"configs": [{"m_bucket": 8, "n": 1, "k": 1, "config": {"x": 1}}]}}'])
def test_a_malformed_per_device_file_is_named_in_the_error(tmp_path, monkeypatch, text):
    bad = tmp_path / "by_device.json"
    bad.write_text(text)
    monkeypatch.setattr(gemm_configs, "BY_DEVICE_PATH", str(bad))
    _device_entries_for_test(monkeypatch, None)
    with pytest.raises(ValueError, match="by_device.json is not a map of device name"):
        gemm_configs.get_config(8, 6144, 4096, "Some GPU")


def test_variant_sizes_follow_the_devices_entries(monkeypatch):
    from eightbit.kernels import int8_gemm as G

    n, k = 6144, 4096
    mine = GemmConfig(16, 32, 512, 1, 1, 2, 3)
    _device_entries_for_test(monkeypatch, {"Fake GPU": {(8, n, k): mine}})
    monkeypatch.setattr(G, "device_name_of", lambda device: "Fake GPU" if device.type == "meta" else None)
    on_fake = G.variant_sizes(n, k, 16, torch.device("meta"))
    assert any(gemm_configs.get_config(m, n, k, "Fake GPU") == mine for m in on_fake)
    assert not any(gemm_configs.get_config(m, n, k) == mine for m in G.variant_sizes(n, k, 16))


def test_int8_gemm_launches_its_devices_entry(monkeypatch):
    """int8_gemm looks its config up under the tensors' device name: a card's own entry is the one launched."""
    from eightbit.kernels import int8_gemm as G

    m, n, k = 8, 64, 512
    mine = GemmConfig(16, 32, 512, 1, 1, 2, 3)
    _device_entries_for_test(monkeypatch, {"Fake GPU": {(8, n, k): mine}})
    launched = []
    real_launch = G._launch_dot
    monkeypatch.setattr(G, "_launch_dot", lambda grid, args, **kw: launched.append(args) or real_launch(grid, args, **kw))
    g = _gen(3)
    xq, wq = _int8((m, k), g, "cpu"), _int8((n, k), g, "cpu")
    one_m, one_n = torch.ones(m, 1), torch.ones(n, 1)
    want = R._int8_matmul(xq, wq).float()
    for name, block in ((None, (64, 256)), ("Fake GPU", (32, 512))):  # on the CPU no name: the default config
        monkeypatch.setattr(G, "device_name_of_index", lambda index, name=name: name)
        assert torch.equal(int8_gemm(xq, one_m, wq, one_n, out_dtype=torch.float32), want)
        assert (launched[-1]["BLOCK_N"], launched[-1]["BLOCK_K"]) == block


@pytest.mark.parametrize("n, k", [(6144, 4096), (2048, 2048), (256, 128), (1000, 3000)])  # in the table, and not
@pytest.mark.parametrize("max_m", [1, 2, 15, 16, 17, 300, 1000, 8192])
def test_variant_sizes_meet_every_kernel_variant_up_to_max_m(n, k, max_m):
    """The engine launches each GEMM at these M before serving, so that no step compiles a kernel: every (config,
    PDL, M == 1, M % 16 == 0) that an M in [1, max_m] selects must be met by one of them, none above max_m."""
    from eightbit.kernels.int8_gemm import PDL_MAX_M, variant_sizes

    def variant(m):
        cfg = gemm_configs.get_config(m, n, k)
        return cfg, cfg.pdl, m <= PDL_MAX_M, m == 1, m % 16 == 0

    sizes = variant_sizes(n, k, max_m)
    assert sizes == sorted(set(sizes)) and 1 <= sizes[0] and sizes[-1] <= max_m
    assert {variant(m) for m in sizes} == {variant(m) for m in range(1, max_m + 1)}


# --- the row kernels ----------------------------------------------------------------------


def _assert_quant_close(q, scale, qr, sr, exact):
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.shape == qr.shape and scale.shape == sr.shape
    assert torch.isfinite(scale).all() and not (q == -128).any()
    if exact:
        assert torch.equal(q, qr) and torch.equal(scale, sr)
    else:  # (GPU) a float op of different order upstream may move a value across a rounding edge
        assert (q.int() - qr.int()).abs().max() <= 1
        assert (q != qr).float().mean() < 1e-3
        torch.testing.assert_close(scale, sr, rtol=1e-2, atol=1e-6)


def _assert_activation_close_cpu(y, yr):
    """The interpreter's float32 math (a sum's order, exp, sqrt) is a few float32 roundings from torch's: float32
    outputs agree to 1e-6 relative (4e-7 measured), float16 ones to one ulp (2^-10 relative, 2^-24 below the
    normal range) in a few elements, where a float32 difference crossed a float16 rounding edge (< 0.2% measured).
    A norm over H - 1 instead of H (~1e-3 off) fails both."""
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, yr, rtol=1e-6, atol=0)
    else:
        torch.testing.assert_close(y.float(), yr.float(), rtol=2**-10, atol=2**-24)
        assert (y != yr).float().mean() < 1e-2


@cpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 576), (37, 300), (5, 1), (2, 3, 100)], ids=str)
def test_quant_per_token_cpu(dtype, shape, poison):
    g = _gen(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x.view(-1, shape[-1])[1:2] = 0  # absmax 0 -> scale 0, q 0 (row 1, so that M = 1 is a real row)
    q, s = quant_per_token(x)
    qr, sr = R.quant_per_token(x)
    _assert_quant_close(q, s, qr, sr, exact=True)


@cpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (19, 300)], ids=str)
def test_rmsnorm_quant_cpu(dtype, with_residual, shape, poison):
    g = _gen(5)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    x[1:2] = 0  # a zero row (row 1, so that M = 1 is a real row)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    res = (torch.randn(shape, generator=g)).to(dtype) if with_residual else None
    if res is not None:
        res[1:2] = 0
    q, s, nr = rmsnorm_quant(x, w, 1e-5, res)
    _, _, nrr = R.rmsnorm_quant(x, w, 1e-5, res)
    y, nr2 = rms_norm(x, w, 1e-5, res)
    _assert_activation_close_cpu(y, R.rms_norm(x, w, 1e-5, res)[0])
    # the int8 path quantizes that same activation, bit for bit as the reference quantizer does
    _assert_quant_close(q, s, *R.quant_per_token(y), exact=True)
    if with_residual:
        assert torch.equal(nr, nrr) and torch.equal(nr2, nrr)
    else:
        assert nr is None and nr2 is None


@cpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (13, 2 * 150)], ids=str)
def test_silu_mul_quant_cpu(dtype, shape, poison):
    g = _gen(9)
    gu = (torch.randn(shape, generator=g) * 3).to(dtype)
    gu[1:2] = 0  # a zero row (row 1, so that M = 1 is a real row)
    y = silu_mul(gu)
    _assert_activation_close_cpu(y, R.silu_mul(gu))
    _assert_quant_close(*silu_mul_quant(gu), *R.quant_per_token(y), exact=True)  # that activation, quantized


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=cpu), pytest.param("cuda", marks=[gpu, needs_cuda])])
def test_a_nan_in_a_row_gives_it_a_nan_scale_as_in_torch(device):
    """tl.max drops NaN: a row holding one was quantized to finite values with a finite scale, where the reference
    (torch's amax) gives scale NaN, so the NaN reached no output. Now the row's scale is NaN on both paths. Only the
    compiled kernel can tell whether the max keeps NaN (the interpreter's np.maximum always does)."""
    x = (torch.randn(3, 96, generator=_gen(3)) * 2).to(torch.float16).to(device)
    x[1, 17] = float("nan")
    w = torch.ones(96, dtype=torch.float16, device=device)
    gu = torch.cat([x, x], 1)
    for name, (q, s), (qr, sr) in (
        ("quant_per_token", quant_per_token(x), R.quant_per_token(x)),
        ("rmsnorm_quant", rmsnorm_quant(x, w, 1e-5)[:2], R.rmsnorm_quant(x, w, 1e-5)[:2]),
        ("silu_mul_quant", silu_mul_quant(gu), R.silu_mul_quant(gu)),
    ):
        assert torch.isnan(s[1]).all() and torch.isnan(sr[1]).all(), name
        assert torch.isfinite(s[[0, 2]]).all(), name
        if device == "cpu" or name == "quant_per_token":
            assert torch.equal(q[[0, 2]], qr[[0, 2]]), name
        else:  # compiled, the norm's and SiLU's float math may move a value across a rounding edge
            assert (q[[0, 2]].int() - qr[[0, 2]].int()).abs().max() <= 1, name


@cpu
def test_row_kernels_reject_bad_inputs_cpu():
    with pytest.raises(TypeError, match="quant_per_token: x must be a float tensor, got torch.int32"):
        quant_per_token(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32"):  # float64: the reference's only
        quant_per_token(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        rmsnorm_quant(torch.zeros(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match=r"residual shape \(3, 8\) != x shape \(2, 8\)"):
        rmsnorm_quant(torch.zeros(2, 8), torch.ones(8), 1e-5, residual=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="last dimension must be even"):
        silu_mul_quant(torch.zeros(2, 7))


# --- GPU ------------------------------------------------------------------------------------

TARGET_SHAPES = [  # (N, K): Llama-3-8B, Llama-3.2-1B, SmolLM2-135M
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
    (960, 576), (576, 576), (3072, 576), (576, 1536),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("nk", TARGET_SHAPES, ids=str)
@pytest.mark.parametrize("m", [1, 8, 16, 64, 256, 1024, 4096])
def test_gemm_gpu_table_shapes(nk, m):
    n, k = nk
    g = _gen(m + n + k)
    xq, wq = _int8((m, k), g, "cuda"), _int8((n, k), g, "cuda")
    xq[0, :64] = -128
    wq[0, :64] = -128
    xs = (torch.rand(m, 1, generator=g) * 0.02).cuda()
    ws = (torch.rand(n, 1, generator=g) * 0.02).cuda()
    bias = torch.randn(n, generator=g).cuda().bfloat16()
    out = int8_gemm(xq, xs, wq, ws, bias)
    ref = R.int8_gemm(xq, xs, wq, ws, bias, torch.bfloat16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-3)
    # the accumulator itself: fp32 out, scales of 1 (int32 -> fp32 rounding is the same on both sides)
    one_m, one_n = torch.ones(m, 1, device="cuda"), torch.ones(n, 1, device="cuda")
    acc = int8_gemm(xq, one_m, wq, one_n, out_dtype=torch.float32)
    assert torch.equal(acc, R._int8_matmul(xq, wq).float())


@gpu
@needs_cuda
def test_gemm_gpu_this_devices_entries():
    """On a card with entries of its own (gemm_configs_by_device.json) int8_gemm's lookup returns them, and each
    computes its shape exactly at its bucket's M and at a partial tile of rows (M = bucket - 3, the same bucket
    from 5 rows up); on any other card the lookup is the table's."""
    name = gemm_configs.device_name_of(torch.device("cuda"))
    own = gemm_configs.device_entries(name)
    for (mb, n, k), cfg in gemm_configs.table_entries().items():
        assert gemm_configs.get_config(mb, n, k, name) == own.get((mb, n, k), cfg)
    g = _gen(7)
    for (mb, n, k), cfg in own.items():
        for m in sorted({mb, max(1, mb - 3)}):
            xq, wq = _int8((m, k), g, "cuda"), _int8((n, k), g, "cuda")
            one_m, one_n = torch.ones(m, 1, device="cuda"), torch.ones(n, 1, device="cuda")
            acc = int8_gemm(xq, one_m, wq, one_n, out_dtype=torch.float32)
            assert torch.equal(acc, R._int8_matmul(xq, wq).float()), (name, m, n, k, cfg)


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [SMALL_CONFIGS[1], GemmConfig(16, 64, 256, 1, 8, 4, 4), GemmConfig(128, 256, 128, 8, 1, 8, 3),
                                 GemmConfig(1, 16, 1024, 1, 4, 4, 1, "gemv"), GemmConfig(4, 16, 256, 1, 3, 4, 1, "gemv"),
                                 GemmConfig(8, 8, 512, 1, 1, 4, 1, "gemv"), *WS_CONFIGS],
                         ids=lambda c: "x".join(map(str, c.key())))
@pytest.mark.parametrize("shape", [(1, 50, 100), (33, 20, 32), (70, 96, 200), (64, 4096, 4096), (300, 1000, 1000),
                                   (520, 1040, 2048)], ids=str)
def test_gemm_gpu_configs(cfg, shape):
    # K <= 992 keeps |acc| < 2^24 (exact in fp32); 992 is a multiple of 16, so TMA configs run there
    _check_gemm_exact("cuda", cfg, *shape[:2], min(shape[2], 992), seed=1)
    for bias in (False, True):
        _check_gemm_ref("cuda", cfg, *shape, seed=2, out_dtype=torch.bfloat16, with_bias=bias)


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", WS_CONFIGS, ids=lambda c: "x".join(map(str, c.key())))
@pytest.mark.parametrize("shape", [(1, 2048, 2048), (77, 3072, 2080), (130, 136, 512), (208, 136, 512),
                                   (1000, 1040, 4096)], ids=str)
@pytest.mark.parametrize("pdl", [None, True], ids=["plain", "pdl"])
def test_gemm_gpu_ws_kernel(cfg, shape, pdl, monkeypatch):
    """The warp-specialized Gluon kernel (sm_90): M = 1, M and N off the tile (row blocks past M pulled back to
    overlap their neighbours: 77, 130, 208), K off BLOCK_K (2080 = 32 x 65), fewer K steps than ring slots (512).
    Exact against the int32 product (fp32 out, stored from registers); with scales and bias, bf16 and fp16
    outputs (TMA store) equal the Triton dot kernel's bit for bit (the same epilogue arithmetic). With PDL (in the
    chain) the producer copies its first weight tiles before its wait and arms their slots for the activations
    it copies after; three programs walk every tile then, so that a program's later tiles run on the ring those
    slots started (also after fewer K steps than slots: K = 512)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is compiled for sm_90 only")
    import dataclasses

    from eightbit.kernels import int8_gemm as mod
    from eightbit.kernels import pdl as pdl_mod

    cfg = dataclasses.replace(cfg, pdl=pdl)
    if pdl:
        if not pdl_mod.chain_enabled(torch.device("cuda")):
            pytest.skip("a table mark's PDL launch applies in the PDL chain only (EIGHTBIT_PDL, EIGHTBIT_PDL_CHAIN)")
        monkeypatch.setattr(mod, "sm_count", lambda device: 3)

    launched = _record_launches(monkeypatch, "_launch_ws")
    m, n, k = shape
    _check_equal_to_dot_kernel(cfg, m, n, k)
    assert len(launched) == 5, "every call above should have run the Gluon kernel"


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", SWAP_CONFIGS, ids=lambda c: "x".join(map(str, c.key())))
@pytest.mark.parametrize("shape", [(1, 2048, 2048), (5, 136, 2080), (8, 96, 512), (16, 4096, 4096), (64, 520, 640)],
                         ids=str)
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_gemm_gpu_swap_kernel(cfg, shape, pdl, monkeypatch):
    """The small-M Gluon kernel (sm_90): M = 1 and M off the activation tile (rows past M zero-filled by TMA), N off
    the weight tile (136, 520), K off BLOCK_K (2080, 640), fewer K steps than ring slots (512). Exact against the
    int32 product (fp32 out); with scales and bias, bf16 and fp16 outputs equal the Triton dot kernel's bit for
    bit (the same epilogue arithmetic). An M above the config's rows runs the dot kernel instead."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is compiled for sm_90 only")
    import dataclasses

    from eightbit.kernels import pdl as pdl_mod

    if pdl and not pdl_mod.chain_enabled(torch.device("cuda")):
        pytest.skip("a table mark's PDL launch applies in the PDL chain only (EIGHTBIT_PDL, EIGHTBIT_PDL_CHAIN)")
    cfg = dataclasses.replace(cfg, pdl=pdl)
    launched = _record_launches(monkeypatch, "_launch_swap")
    m, n, k = shape
    runs = m <= cfg.block_m
    _check_equal_to_dot_kernel(cfg, m, n, k)
    assert len(launched) == (5 if runs else 0), "the Gluon kernel runs exactly where M fits its rows"


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg,m", [(GemmConfig(8, 8, 512, 1, 8, 4, 1, "gemv"), 8),
                                   (GemmConfig(16, 32, 256, 1, 8, 4, 4), 16),
                                   (GemmConfig(16, 64, 128, 1, 8, 4, 6), 16),
                                   (GemmConfig(16, 64, 256, 1, 8, 4, 4, "swap"), 16)],
                         ids=["gemv", "dot32", "dot64", "swap"])
def test_gemm_gpu_split_k_hand_off_under_load(cfg, m, monkeypatch):
    """Eight K splits per tile on a real decode shape (Llama-3-8B down), launched back to back many times: the
    last split to arrive must always see every other split's int32 partial (a hand-off that loses one gives a
    wrong sum in some launches, not in all: two stream-K prototypes did, docs/benchmarks/gemm.md)."""
    launched = _count_swap_launches(cfg, monkeypatch)
    g = _gen(12)
    n, k = 4096, 14336
    xq, wq = _int8((m, k), g, "cuda"), _int8((n, k), g, "cuda")
    one_m, one_n = torch.ones(m, 1, device="cuda"), torch.ones(n, 1, device="cuda")
    exact = (xq.double() @ wq.double().t()).float()  # |sum| < 2^31; rounded to fp32 like the kernel's output
    outs = [int8_gemm_with_config(xq, one_m, wq, one_n, None, torch.float32, cfg) for _ in range(60)]
    wrong = sum(not torch.equal(o, exact) for o in outs)
    assert wrong == 0, f"{wrong} of 60 launches lost a split's partial sum"
    assert len(launched) == (60 if cfg.kernel == "swap" else 0)


def _count_swap_launches(cfg, monkeypatch):
    """The launches of the small-M Gluon kernel, recorded: a "swap" config must run it, so off sm_90 its test skips."""
    if cfg.kernel == "swap" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is compiled for sm_90 only")
    return _record_launches(monkeypatch, "_launch_swap")


def _record_launches(monkeypatch, launcher):
    """The configs int8_gemm launches through int8_gemm.<launcher> (a Gluon kernel's launch), recorded as it runs."""
    from eightbit.kernels import int8_gemm as mod

    launched = []
    real_launch = getattr(mod, launcher)
    monkeypatch.setattr(mod, launcher, lambda *a: launched.append(a[-1].key()) or real_launch(*a))
    return launched


def _check_equal_to_dot_kernel(cfg, m, n, k, device="cuda"):
    """cfg exact against the int32 product (fp32 out, scales of 1, K cut to 992 so the sums stay exact in fp32); with
    scales and bias, its bf16 and fp16 outputs equal the Triton dot kernel's bit for bit (5 calls of cfg in all)."""
    _check_gemm_exact(device, cfg, m, n, min(k, 992), seed=3)
    g = _gen(4)
    xq, wq = _int8((m, k), g, device), _int8((n, k), g, device)
    xq[0, :64] = -128
    wq[-1, :64] = -128
    xs = (torch.rand(m, 1, generator=g) * 0.02).to(device)
    ws = (torch.rand(n, 1, generator=g) * 0.02).to(device)
    dot = gemm_configs.dot_config(m, n, k)
    for dtype in (torch.bfloat16, torch.float16):
        for bias in (None, torch.randn(n, generator=g).to(device, dtype)):
            out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
            int8_gemm_with_config(xq, xs, wq, ws, bias, dtype, cfg, out=out)
            assert torch.equal(out, int8_gemm_with_config(xq, xs, wq, ws, bias, dtype, dot))


@gpu
@needs_cuda
def test_gemm_gpu_relaunch_cache_across_m_alignment_and_bias():
    """The second launch of a shape skips Triton's binding (kernels/launch.py): one compiled kernel
    for every M, a new one when an operand's alignment, the bias or the output dtype changes."""
    g = _gen(5)
    n, k = 96, 256
    cfg = GemmConfig(64, 64, 128, group_m=8, split_k=1, num_warps=4, num_stages=2)
    wq = _int8((n, k), g, "cuda")
    ws = torch.rand(n, 1, generator=g).cuda() * 0.01
    base = _int8((300, k + 4), g, "cuda")
    for m, shift, with_bias, dtype in [(70, 0, False, torch.bfloat16), (33, 0, False, torch.bfloat16),
                                       (300, 0, True, torch.bfloat16), (70, 1, False, torch.bfloat16),
                                       (70, 4, True, torch.float16), (129, 0, False, torch.bfloat16)]:
        xq = base[:m, shift:shift + k]  # shift 1: a 1-byte-aligned operand; stride(0) = k + 4 throughout
        xs = torch.rand(m, 1, generator=g).cuda() * 0.01
        bias = torch.randn(n, generator=g).cuda().to(dtype) if with_bias else None
        out = int8_gemm_with_config(xq, xs, wq, ws, bias, dtype, cfg)
        ref = R.int8_gemm(xq, xs, wq, ws, bias, dtype)
        torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-3, msg=f"m={m} shift={shift}")


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [GemmConfig(16, 32, 128, 1, 8, 4, 4), GemmConfig(2, 16, 256, 1, 8, 4, 1, "gemv"),
                                 GemmConfig(16, 64, 256, 1, 6, 4, 4, "swap")], ids=lambda c: c.kernel)
def test_gemm_gpu_split_k_deterministic(cfg, monkeypatch):
    launched = _count_swap_launches(cfg, monkeypatch)
    g = _gen(0)
    xq, wq = _int8((16, 14336), g, "cuda"), _int8((4096, 14336), g, "cuda")
    xs, ws = torch.rand(16, 1, device="cuda"), torch.rand(4096, 1, device="cuda")
    first = int8_gemm_with_config(xq, xs, wq, ws, None, torch.float32, cfg)
    for _ in range(30):
        assert torch.equal(int8_gemm_with_config(xq, xs, wq, ws, None, torch.float32, cfg), first)
    torch.testing.assert_close(first, R.int8_gemm(xq, xs, wq, ws, None, torch.float32), rtol=1e-6, atol=1e-3)
    assert len(launched) == (31 if cfg.kernel == "swap" else 0)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("h", [576, 2048, 4096])
def test_row_kernels_gpu(m, h):
    g = _gen(m * h)
    x = (torch.randn(m, h, generator=g) * 2).cuda().bfloat16()
    x[0] = 0
    w = (torch.rand(h, generator=g) + 0.5).cuda().bfloat16()
    res = torch.randn(m, h, generator=g).cuda().bfloat16()
    for r in (None, res):
        q, s, nr = rmsnorm_quant(x, w, 1e-5, r)
        qr, sr, nrr = R.rmsnorm_quant(x, w, 1e-5, r)
        _assert_quant_close(q, s, qr, sr, exact=False)
        y, _ = rms_norm(x, w, 1e-5, r)
        torch.testing.assert_close(y, R.rms_norm(x, w, 1e-5, r)[0], rtol=1.6e-2, atol=1e-5)
        if r is not None:
            assert torch.equal(nr, nrr)
    q, s = quant_per_token(x)
    _assert_quant_close(q, s, *R.quant_per_token(x), exact=True)
    gu = (torch.randn(m, 2 * h, generator=g) * 3).cuda().bfloat16()
    _assert_quant_close(*silu_mul_quant(gu), *R.silu_mul_quant(gu), exact=False)
    torch.testing.assert_close(silu_mul(gu), R.silu_mul(gu), rtol=1.6e-2, atol=1e-5)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_cuda_graph_capture(m):
    g = _gen(1)
    h, n = 4096, 6144
    x = torch.randn(m, h, generator=g).cuda().bfloat16()
    w = torch.rand(h, generator=g).cuda().bfloat16() + 0.5
    wq = _int8((n, h), g, "cuda")
    ws = torch.rand(n, 1, device="cuda") * 0.01

    def step():
        q, s, _ = rmsnorm_quant(x, w, 1e-5)
        return int8_gemm(q, s, wq, ws)

    eager = step()  # warm-up: compiles and allocates the split-K counters outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(m, h, generator=g).cuda().bfloat16())
    graph.replay()
    torch.testing.assert_close(out, step(), rtol=0, atol=0)
    assert not torch.equal(out, eager)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 64, 256, 512])
def test_pdl_chain_in_graph_matches_without_pdl(m):
    """A stack of norm -> GEMM -> SiLU -> GEMM layers, each kernel reading the one before, replayed from a
    CUDA graph with PDL (the GEMMs start while their producer runs, the norm and SiLU kernels while the GEMM
    before them finishes): equal bit for bit to the same chain launched without PDL, and close to the plain-torch
    reference. A kernel that read its input before `griddepcontrol.wait` would see the previous replay's
    activations (x changes between replays). Every GEMM is launched with PDL here, whatever the table says: at
    M = 256 the Triton kernel, at 512 the Gluon one."""
    import dataclasses

    from eightbit.kernels import pdl
    from eightbit.kernels.gemm_configs import get_config

    if not pdl.pdl_enabled(torch.device("cuda")):
        pytest.skip("PDL is used on sm_90 only (and not with EIGHTBIT_PDL=0)")
    g = _gen(7)
    h, inter, layers = 2048, 4096, 4
    x = torch.randn(m, h, generator=g).cuda().bfloat16()
    norm_w = torch.rand(h, generator=g).cuda().bfloat16() + 0.5
    # every input from g: the global generator's state depends on which tests ran before in this process
    def weights(n, k):
        return _int8((n, k), g, "cuda"), torch.rand(n, 1, generator=g).cuda() * 2e-3

    up = [weights(2 * inter, h) for _ in range(layers)]
    down = [weights(h, inter) for _ in range(layers)]

    def chain(ops):
        y = x
        for (wu, su), (wd, sd) in zip(up, down):
            q, s, _ = ops["rmsnorm_quant"](y, norm_w, 1e-5)
            q, s = ops["silu_mul_quant"](ops["int8_gemm"](q, s, wu, su))
            y = ops["int8_gemm"](q, s, wd, sd)
        return y

    def gemm_pdl(q, s, w, ws):
        cfg = get_config(m, *w.shape, gemm_configs.device_name_of(w.device))
        return int8_gemm_with_config(q, s, w, ws, config=dataclasses.replace(cfg, pdl=True))

    kernels = {"rmsnorm_quant": rmsnorm_quant, "silu_mul_quant": silu_mul_quant, "int8_gemm": gemm_pdl}
    chain(kernels)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(kernels)
    for _ in range(3):
        x.copy_(torch.randn(m, h, generator=g).cuda().bfloat16())
        graph.replay()
        enabled = pdl.ENABLED
        try:
            pdl.ENABLED = False
            plain = chain(kernels)
        finally:
            pdl.ENABLED = enabled
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
    reference = {"rmsnorm_quant": R.rmsnorm_quant, "silu_mul_quant": R.silu_mul_quant, "int8_gemm": R.int8_gemm}
    expected = chain(reference).float()
    assert ((out.float() - expected).norm() / expected.norm()).item() < 0.02


def test_quant_per_token_takes_a_row_of_exactly_max_row_elements():
    from eightbit.kernels.quant_per_token import MAX_ROW

    x = torch.randn(2, MAX_ROW, generator=torch.Generator().manual_seed(0))
    q, s = quant_per_token(x)
    rq, rs = R.quant_per_token(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    with pytest.raises(ValueError, match="longer than the supported"):
        quant_per_token(torch.zeros(1, MAX_ROW + 1))


@pytest.mark.parametrize("quant", [False, True])
def test_rms_norm_reads_a_residual_with_its_own_row_stride(quant):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 48, generator=g)
    wide = torch.randn(5, 2 * 48, generator=g)
    res = wide[:, 16:64]  # last dim contiguous, row stride 96 (x's is 48)
    w = torch.rand(48, generator=g) + 0.5
    want = x.double() + res.double()
    want_out = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    if quant:
        q, s, new_res = rmsnorm_quant(x, w, 1e-6, res)
        rq, rs, _ = R.rmsnorm_quant(x, w, 1e-6, res.contiguous())
        assert torch.equal(q, rq) and torch.equal(s, rs)
    else:
        out, new_res = rms_norm(x, w, 1e-6, res)
        torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_res.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("which", ["x", "w"])
def test_gemv_falls_back_when_only_one_operand_is_misaligned(which):
    from eightbit.kernels.int8_gemm import gemv_ok

    cfg = GemmConfig(2, 16, 32, split_k=1, num_warps=4, num_stages=1, kernel="gemv")
    g = torch.Generator().manual_seed(4)
    big_x = torch.randint(-128, 128, (3, 160), generator=g, dtype=torch.int8)
    big_w = torch.randint(-128, 128, (40, 160), generator=g, dtype=torch.int8)
    xq, wq = big_x[:, 4:160], big_w[:, 4:160]  # K = 156, aligned views
    if which == "x":
        xq = big_x[:, 1:157]
    else:
        wq = big_w[:, 1:157]
    assert not gemv_ok(xq, wq)
    out = int8_gemm_with_config(xq, torch.ones(3, 1), wq, torch.ones(40, 1), None, torch.float32, cfg)
    assert torch.equal(out, (xq.long() @ wq.long().t()).float())


def test_small_m_borrows_a_table_entry_only_up_to_bucket_16(monkeypatch):
    C = gemm_configs
    n, k = 4104, 4104  # a shape no real table holds
    at16, at32 = C.GemmConfig(16, 32, 64, 1, 2, 4, 3), C.GemmConfig(32, 32, 64, 1, 1, 4, 3)
    monkeypatch.setattr(C, "_memo", {})
    monkeypatch.setattr(C, "_table_for", lambda name: {(32, n, k): at32})
    assert C.get_config(8, n, k) == C.default_config(8, n, k)  # 32 is past 16: the default, not the 32 entry
    assert C.get_config(32, n, k) == at32
    monkeypatch.setattr(C, "_memo", {})
    monkeypatch.setattr(C, "_table_for", lambda name: {(16, n, k): at16, (32, n, k): at32})
    assert C.get_config(8, n, k) == at16 and C.get_config(3, n, k) == C.default_config(3, n, k)  # gemv default
