"""Compile every committed int8_gemm configuration (and the defaults) for sm_90 on the CPU.

No GPU is needed: triton.compile with a GPUTarget runs the whole pipeline down to
a cubin with the ptxas shipped in the triton wheel. This catches configurations
that cannot be built (shared memory over the limit, bad block shapes, int8 dots
with BLOCK_K < 32) before they reach the GPU. It runs in a subprocess so that
TRITON_INTERPRET, which tests/conftest.py sets for the interpreted kernel tests, is not in effect.
"""

import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest

HOPPER_SMEM = 232448  # bytes of shared memory a block may use on sm_90


def _gemm_jobs():
    from eightbit.kernels import gemm_configs as gc

    jobs = {(gc.GemmConfig(1, 16, 1024, 1, 4, 4, 1, "gemv"), True), (gc.GemmConfig(8, 8, 512, 1, 2, 4, 1, "gemv"), False),
            (gc.GemmConfig(128, 256, 64, 8, 1, 4, 6, "ws"), True),
            (gc.GemmConfig(128, 128, 128, 8, 1, 4, 4, "ws"), True),
            (gc.GemmConfig(128, 192, 64, 8, 1, 4, 6, "ws"), True),
            # the small-M Gluon kernel: every activation-tile height, both weight-tile heights, one and several splits
            (gc.GemmConfig(8, 64, 256, 1, 4, 4, 6, "swap"), True), (gc.GemmConfig(16, 128, 128, 1, 1, 4, 4, "swap"), True),
            (gc.GemmConfig(32, 64, 128, 1, 2, 4, 8, "swap"), True), (gc.GemmConfig(64, 128, 64, 1, 3, 4, 3, "swap"), True),
            (gc.GemmConfig(32, 128, 256, 1, 2, 4, 4, "swap"), False)}
    shapes = {(n, k) for (_, n, k) in gc.table_entries()} | {(4096, 4096), (576, 576), (2048, 8192)}
    for (mb, n, k), cfg in gc.table_entries().items():
        jobs.add((cfg, k % cfg.block_k == 0))
    for name in gc.devices_with_entries():  # the per-device entries (gemm_configs_by_device.json)
        for (mb, n, k), cfg in gc.device_entries(name).items():
            jobs.add((cfg, k % cfg.block_k == 0))
    for n, k in shapes:
        for m in gc.M_BUCKETS:
            cfg = gc.default_config(m, n, k)
            jobs.add((cfg, k % cfg.block_k == 0))
    return sorted(jobs, key=lambda j: (j[0].key(), j[1]))


def _assert_pdl(ptx, partitions=1):
    """Every partition waits for the previous kernel before its first global access (kernels/pdl.py; the Gluon
    GEMM's producer copies weight tiles before its wait, which _assert_weights_before_wait checks; this text-order
    check passes for it because the producer's code comes last in the PTX), and the kernel after the GEMM may
    start after the K loop."""
    assert ptx.count("griddepcontrol.wait") >= partitions, "the sm_90 build must wait for the previous kernel"
    first_wait = ptx.index("griddepcontrol.wait")
    for access in ("ld.global", "cp.async", "st.global", "atom.global"):
        pos = ptx.find(access)
        assert pos == -1 or pos > first_wait, f"{access} before griddepcontrol.wait"
    assert "griddepcontrol.launch_dependents" in ptx, "the kernel after it may be scheduled early"


def _assert_weight_prefetch(ptx):
    """With PREFETCH > 0 the Triton GEMMs prefetch weight lines into L2, all before their PDL wait."""
    assert "prefetch.global.L2" in ptx, "the weight rows' L2 prefetch is missing"
    assert ptx.rindex("prefetch.global.L2") < ptx.index("griddepcontrol.wait"), "prefetch after the wait"


def _descriptor_register(ptx, nth):
    """The register the PTX addresses the kernel's `nth` TMA descriptor through (each descriptor is passed as a
    128-byte parameter, in the order of the kernel's arguments)."""
    import re

    param = re.findall(r"\.param \.align 64 \.b8 (\w+)\[128\]", ptx)[nth]
    staged = re.search(rf"mov\.b64\s+(%rd\d+), {param};", ptx).group(1)
    return re.search(rf"cvta\.param\.u64\s+(%rd\d+), {staged};", ptx).group(1)


def _assert_weights_before_wait(ptx, fn, activations=0, weights=1):
    """A Gluon GEMM's producer (the last partition in the PTX) copies weight tiles before its PDL wait, and
    activation tiles (the previous kernel's output) only after it; activations / weights: the positions of their
    descriptors among the kernel's arguments (the "ws" kernel: a_desc, b_desc; the "swap" kernel: w_desc,
    x_desc). A text-order check against the producer's first wait (the first after a TMA copy: only the producer
    copies; LLVM may duplicate the wait into later blocks): a layout that put the producer elsewhere would fail it,
    not pass it."""
    import re

    copies = [(m.start(), m.group(1)) for m in
              re.finditer(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\S* \[%r\d+\], \[(%rd\d+),", ptx)]
    assert copies, "no TMA copies found"
    producer_wait = ptx.index("griddepcontrol.wait", copies[0][0])
    assert all(fn.arg_names[i].endswith("_desc") for i in (activations, weights)), "descriptor positions"
    a_reg, b_reg = _descriptor_register(ptx, activations), _descriptor_register(ptx, weights)
    assert any(reg == b_reg and pos < producer_wait for pos, reg in copies), "no weight copy before the wait"
    assert all(pos > producer_wait for pos, reg in copies if reg == a_reg), "an activation copy before the wait"
    assert any(reg == a_reg for _, reg in copies), "the activation copies were not found"


def _compile_gemm(job):
    import triton
    from triton.backends.compiler import GPUTarget

    from eightbit.kernels.int8_gemm import PREFETCH_LINES, _int8_gemv_kernel

    cfg, even_k = job
    if cfg.kernel == "gemv":
        fn = _int8_gemv_kernel
        sig = {
            "a_ptr": "*i32", "xs_ptr": "*fp32", "b_ptr": "*i32", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
            "c_ptr": "*bf16", "acc_ptr": "*i32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "KW": "i32",
            "stride_am": "i32", "stride_bn": "i32", "stride_cm": "i32", "stride_cn": "constexpr",
        }
        consts = {"stride_cn": 1, "HAS_BIAS": True, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                  "BLOCK_KW": cfg.block_k // 4, "SPLIT_K": cfg.split_k, "EVEN_K": even_k, "USE_ASM": True,
                  "PDL": True, "LATE_TRIGGER": True, "PREFETCH": PREFETCH_LINES}  # as the chain launches it
        for name in consts:
            sig[name] = "constexpr"
        div16 = ["a_ptr", "xs_ptr", "b_ptr", "ws_ptr", "bias_ptr", "c_ptr", "acc_ptr", "lock_ptr",
                 "N", "KW", "stride_am", "stride_bn", "stride_cm"]
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=_options(cfg))
        _assert_pdl(k.asm["ptx"])
        _assert_weight_prefetch(k.asm["ptx"])
        return cfg.key(), even_k, k.metadata.shared, None
    if cfg.kernel == "ws":
        return _compile_ws(cfg)
    if cfg.kernel == "swap":
        return _compile_swap(cfg)
    from eightbit.kernels.int8_gemm import TRIGGER_AHEAD_STEPS

    k = _compile_dot(cfg, even_k, TRIGGER_AHEAD_STEPS)
    ptx = k.asm["ptx"]
    _assert_pdl(ptx)
    _assert_weight_prefetch(ptx)
    if TRIGGER_AHEAD_STEPS > 0:
        assert ptx.count("griddepcontrol.launch_dependents") >= 2, "the trigger inside the K loop is missing"
    return cfg.key(), even_k, k.metadata.shared, k.n_regs if hasattr(k, "n_regs") else None


def _compile_dot(cfg, even_k, trigger_ahead):
    import triton
    from triton.backends.compiler import GPUTarget

    from eightbit.kernels.int8_gemm import PREFETCH_LINES, _int8_gemm_kernel

    fn = _int8_gemm_kernel
    sig = {
        "a_ptr": "*i8", "xs_ptr": "*fp32", "b_ptr": "*i8", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
        "c_ptr": "*bf16", "part_ptr": "*i32", "lock_ptr": "*i32",
        "M": "i32", "N": "i32", "K": "i32",
        "stride_am": "i32", "stride_ak": "constexpr", "stride_bn": "i32", "stride_bk": "constexpr",
        "stride_cm": "i32", "stride_cn": "constexpr",
    }
    consts = {
        "stride_ak": 1, "stride_bk": 1, "stride_cn": 1, "HAS_BIAS": True,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
        "SPLIT_K": cfg.split_k, "EVEN_K": even_k, "PDL": True, "LATE_TRIGGER": True,
        "PREFETCH": PREFETCH_LINES, "TRIGGER_AHEAD": trigger_ahead,
    }
    for name in consts:
        sig[name] = "constexpr"
    div16 = ["a_ptr", "xs_ptr", "b_ptr", "ws_ptr", "bias_ptr", "c_ptr", "part_ptr", "lock_ptr",
             "N", "K", "stride_am", "stride_bn", "stride_cm"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=_options(cfg))


def _options(cfg):
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False}


def _trigger_keeps_pipeline(cfg):
    """The trigger inside the K loop leaves the loop as pipelined as the one after it: the same async copies
    (cp.async and their waits) and the same shared memory."""
    from eightbit.kernels.int8_gemm import TRIGGER_AHEAD_STEPS

    after, inside = (_compile_dot(cfg, True, t) for t in (0, max(1, TRIGGER_AHEAD_STEPS)))
    ops = ("cp.async.cg", "cp.async.wait_group", "wgmma.wait_group")
    counts = [(k.metadata.shared, *(k.asm["ptx"].count(op) for op in ops)) for k in (after, inside)]
    assert counts[0] == counts[1] and counts[0][1] > 0, f"{cfg}: (shared, {', '.join(ops)}) {counts[0]} -> {counts[1]}"
    return cfg.key(), "trigger inside the loop: pipeline unchanged", counts[1]


def _compile_ws(cfg):
    """The Gluon kernel, for a bf16 output (TMA store) and an fp32 one (stored from registers)."""
    import re

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from eightbit.kernels import int8_gemm_hopper as H

    def desc(dtype, block):
        t = torch.zeros(256, 512, dtype=dtype)
        return mangle_type(TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, H._GL_DTYPES.get(dtype, gl.int8))))

    fn = H._int8_gemm_ws_kernel
    bn0, bn1 = H.split_width(cfg.block_n)
    shared = 0
    for out, tma_store in ((torch.bfloat16, True), (torch.float32, False)):
        c_block = [64, bn0] if tma_store else [8, 16]
        sig = {"a_desc": desc(torch.int8, [64, cfg.block_k]), "b_desc": desc(torch.int8, [bn0, cfg.block_k]),
               "b1_desc": desc(torch.int8, [bn1 or bn0, cfg.block_k]), "c_desc": desc(out, c_block),
               "c1_desc": desc(out, [64, bn1] if bn1 and tma_store else c_block), "xs_ptr": "*fp32", "ws_ptr": "*fp32",
               "bias_ptr": "*bf16", "c_ptr": "*bf16" if tma_store else "*fp32", "M": "i32", "N": "i32", "K": "i32",
               "stride_cm": "i32"}
        consts = {"HAS_BIAS": True, "TMA_STORE": tma_store, "GROUP_M": cfg.group_m, "STAGES": cfg.num_stages,
                  "LAYOUT": H.accumulator_layout(bn0), "TAIL": bn1 > 0, "LAYOUT1": H.accumulator_layout(bn1 or bn0),
                  "PDL": True, "EARLY_B": True}
        sig.update({name: "constexpr" for name in consts})
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
                 for a in ("xs_ptr", "ws_ptr", "bias_ptr", "c_ptr", "N", "K", "stride_cm")}
        k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
        ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
        assert "wgmma.mma_async.sync.aligned" in ptx and "s32.s8.s8" in ptx, "int8 wgmma expected"
        assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx, "TMA copies and warp specialization expected"
        _assert_pdl(ptx, partitions=3)  # two consumer warp groups and the producer warp
        _assert_weights_before_wait(ptx, fn)
        in_flight = str(2 if bn1 else 1)  # one step's wgmmas stay in flight (two with a second accumulator)
        assert in_flight in re.findall(r"warp_group_dot_wait.*pendings = (\d+)", ttgir), "one step must stay in flight"
        if bn1:
            assert f"m64n{bn1}k32" in ptx, "the second accumulator's wgmma expected"
        shared = max(shared, k.metadata.shared)
    return cfg.key(), True, shared, None


def _spill_bytes(ptx):
    """Spill stores ptxas reports for this PTX on sm_90 (the ptxas shipped with Triton)."""
    import re
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(90).path, "-v", "-arch=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stdout + out.stderr))


def _compile_swap(cfg):
    """The small-M Gluon kernel as int8_gemm launches it in the PDL chain (64 registers a thread)."""
    import re

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon import language as gl
    from triton.runtime.jit import mangle_type

    from eightbit.kernels import int8_gemm_hopper as H
    from eightbit.kernels import int8_gemm_swap as S

    def desc(block):
        t = torch.zeros(256, 512, dtype=torch.int8)
        return mangle_type(TensorDescriptor.from_tensor(t, block, H._shared_layout(tuple(block), gl.int8)))

    fn = S._int8_gemm_swap_kernel
    sig = {"w_desc": desc([cfg.block_n, cfg.block_k]), "x_desc": desc([cfg.block_m, cfg.block_k]),
           "xs_ptr": "*fp32", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "c_ptr": "*bf16", "acc_ptr": "*i32",
           "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32"}
    consts = {"HAS_BIAS": True, "SPLIT_K": cfg.split_k, "STAGES": cfg.num_stages,
              "LAYOUT": S.accumulator_layout(cfg.block_m), "PDL": True, "TRIGGER": True}
    sig.update({name: "constexpr" for name in consts})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("xs_ptr", "ws_ptr", "bias_ptr", "c_ptr",
                                                                          "acc_ptr", "lock_ptr", "N", "K")}
    regs = S.maxnreg(cfg)
    k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "enable_fp_fusion": False, "maxnreg": regs})
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.block_m}k32.s32.s8.s8" in ptx, "the swapped int8 wgmma expected"
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx, "TMA copies and warp specialization expected"
    assert f".maxnreg {regs}" in ptx, "launched with few registers, so the next kernel can share the SM"
    assert _spill_bytes(ptx) == 0, f"{cfg}: {regs} registers a thread spill"
    _assert_pdl(ptx, partitions=2)
    _assert_weights_before_wait(ptx, fn, activations=1, weights=0)
    assert "1" in re.findall(r"warp_group_dot_wait.*pendings = (\d+)", ttgir), "one wgmma must stay in flight"
    assert ("atom.global" in ptx) == (cfg.split_k > 1), "split-K partials by integer atomics, only with splits"
    return cfg.key(), True, k.metadata.shared, None


def _compile_row(job):
    import triton
    from triton.backends.compiler import GPUTarget

    from eightbit.kernels.quant_per_token import _quant_per_token_kernel, row_launch_params
    from eightbit.kernels.rmsnorm_quant import _rmsnorm_kernel
    from eightbit.kernels.silu_mul_quant import _silu_mul_kernel

    which, n, quant = job
    block, num_warps = row_launch_params(n)
    if which == "rms":
        fn = _rmsnorm_kernel
        sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
               "q_ptr": "*i8", "scale_ptr": "*fp32", "H": "i32", "eps": "fp32", "stride_x": "i32",
               "stride_res": "i32", "stride_out": "i32", "stride_res_out": "i32", "stride_q": "i32"}
        consts = {"HAS_RESIDUAL": True, "QUANT": quant, "CUDA_SCALE": True, "BLOCK_H": block, "PDL": True}
    elif which == "quant":
        fn = _quant_per_token_kernel
        sig = {"x_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32", "K": "i32", "stride_xm": "i32",
               "stride_qm": "i32"}
        consts = {"CUDA_SCALE": True, "BLOCK_K": block, "PDL": True}
    else:
        fn = _silu_mul_kernel
        sig = {"gu_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32", "I": "i32",
               "stride_gu": "i32", "stride_out": "i32", "stride_q": "i32"}
        consts = {"QUANT": quant, "CUDA_SCALE": True, "BLOCK_I": block, "PDL": True, "MUFU": True}
    for name in consts:
        sig[name] = "constexpr"
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "enable_fp_fusion": False})
    _assert_pdl(k.asm["ptx"])  # behind a GEMM it waits for the GEMM's output; the GEMM after it may start early
    if which == "silu":  # the bare MUFU ops, not div.full.f32's range checks (silu_mul_quant's docstring)
        ptx = k.asm["ptx"]
        assert "ex2.approx.ftz.f32" in ptx and "rcp.approx.ftz.f32" in ptx and "div.full" not in ptx, job
    return job


def main():
    from eightbit.kernels.gemm_configs import GemmConfig

    # a decode-size and a mid-size dot config (the early trigger's range, int8_gemm.TRIGGER_AHEAD_MAX_M)
    pipeline_checks = [GemmConfig(16, 16, 256, 1, 1, 1, 6), GemmConfig(64, 64, 256, 8, 1, 4, 4)]
    jobs = _gemm_jobs()
    rows = [("rms", 4096, True), ("rms", 576, False), ("silu", 14336, True), ("silu", 1536, False),
            ("quant", 4096, True)]
    failed = []
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        futures = [(j, pool.submit(_compile_gemm, j)) for j in jobs] + [(r, pool.submit(_compile_row, r)) for r in rows]
        futures += [(c, pool.submit(_trigger_keeps_pipeline, c)) for c in pipeline_checks]
        for job, fut in futures:
            try:
                res = fut.result()
                if isinstance(res, tuple) and len(res) == 4 and res[2] > HOPPER_SMEM:
                    failed.append((job, f"shared memory {res[2]} > {HOPPER_SMEM}"))
                print("ok", res, flush=True)
            except Exception as e:  # noqa: BLE001
                failed.append((job, repr(e)[:300]))
    print(f"compiled {len(jobs)} gemm configs, {len(rows)} row kernels and {len(pipeline_checks)} pipeline checks; "
          f"{len(failed)} failed")
    for job, why in failed:
        print("FAILED", job, why)
    sys.exit(1 if failed else 0)


def test_every_gemm_config_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"compile failures:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


if __name__ == "__main__":
    main()
