"""Compile every attention kernel, for each entry of kernels/attention_configs.py, for sm_90.

Runs in a subprocess without TRITON_INTERPRET (tests/conftest.py sets it in this process),
through triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)): no GPU needed, so
CI catches kernels that the interpreter accepts but the compiler rejects, and configs whose
shared memory does not fit a Hopper multiprocessor.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from eightbit.kernels import attention_configs as C
    from eightbit.kernels.kv_dequant import _dequant_blocks_kernel
    from eightbit.kernels.kv_write import LAUNCH_OPTIONS as KV_WRITE_OPTIONS, _rope_kv_write_kernel
    from eightbit.kernels.prefill_attention import _prefill_kernel
    from eightbit.kernels.decode_attention import _decode_kernel, _decode_reduce_kernel

    target = GPUTarget("cuda", 90, 32)
    results = []

    # what the launcher specializes: 16-byte-aligned pointers, strides divisible by 16 (without
    # these attributes the loads are not vectorized and the register counts mean nothing)
    DIV16 = ("stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_cb", "stride_cp", "stride_ch", "stride_sb",
             "stride_bt", "stride_qt", "stride_ot", "stride_vb", "stride_vh", "stride_vcb", "stride_vch")

    # the kernels do not specialize on these pointers' alignment (mixed steps pass views at any offset)
    UNALIGNED = ("block_tables_ptr", "seq_lens_ptr")

    def build(name, fn, ptrs, scalars, consts, opts):
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if (a in ptrs or a in DIV16) and a not in UNALIGNED}
        sig = {}
        for a in fn.arg_names:
            if a in consts:
                sig[a] = "constexpr"
            elif a in ptrs:
                sig[a] = ptrs[a]
            else:
                sig[a] = scalars.get(a, "i32")
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target,
                           options=opts)
        ptx = k.asm["ptx"]
        results.append(dict(name=name, shared=k.metadata.shared, num_warps=k.metadata.num_warps,
                            ptx_has_mma=("mma" in ptx), cubin=len(k.asm["cubin"]),
                            byte_loads=ptx.count("ld.global.b8") + ptx.count("ld.shared.b8"),
                            fma_f32=ptx.count("fma.rn.f32"), tf32=ptx.count(".tf32"),
                            pdl_wait=ptx.count("griddepcontrol.wait"),
                            pdl_trigger=ptx.count("griddepcontrol.launch_dependents")))

    def cache_ptrs(kind, float_type="*bf16"):
        if kind == "int8":
            return {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8", "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16"}
        return {"k_cache_ptr": float_type, "v_cache_ptr": float_type, "k_scale_ptr": float_type,
                "v_scale_ptr": float_type}

    which = sys.argv[1]
    if which == "prefill":
        entries = [(f"prefill d{d} {kind}", d, kind, cfg) for (d, kind), cfg in sorted(C.PREFILL.items())]
        entries += [(f"prefill (long) d{d} {kind}", d, kind, cfg) for (d, kind), cfg in sorted(C.PREFILL_LONG.items())]
        entries += [(f"prefill d128 {kind} q=fp32", 128, kind, C.PREFILL[(128, kind)]) for kind in ("float", "int8")]
        for name, d, kind, cfg in entries:
            cfg = dict(cfg)
            q_type = "*fp32" if name.endswith("q=fp32") else "*bf16"
            ptrs = {"q_ptr": q_type, "out_ptr": q_type, **cache_ptrs(kind, q_type), "block_tables_ptr": "*i32",
                    "cu_seqlens_ptr": "*i32", "seq_lens_ptr": "*i32", "tile_seq_ptr": "*i32", "tile_idx_ptr": "*i32"}
            consts = dict(QPK=4, HEAD_DIM=d, GROUP=32 if kind == "int8" else d, PAGE_SIZE=16,
                          BLOCK_M=cfg.pop("BLOCK_M"), BLOCK_N=cfg.pop("BLOCK_N"), QUANT=kind == "int8",
                          COMPILED=True)
            build(name, _prefill_kernel, ptrs, {"qk_scale": "fp32"}, consts, cfg)
        for d in (64, 128):
            ptrs = {"k_ptr": "*i8", "v_ptr": "*i8", "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16",
                    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "k_out_ptr": "*bf16", "v_out_ptr": "*bf16"}
            build(f"kv_dequant d{d}", _dequant_blocks_kernel, ptrs, {}, dict(HKV=8, PAGE=16, D=d, GROUP=32),
                  dict(num_warps=4))
    elif which == "decode":
        for (d, kind), cfg in sorted(C.DECODE.items()):
            for splits, page, q_type in ((1, 16, "*bf16"), (8, 16, "*bf16"), (8, 8, "*bf16"), (8, 32, "*bf16"),
                                         (8, 16, "*fp32")):
                if page != 16 and kind != "int8":
                    continue  # the page size changes the int8 V loads (runs of min(page, 16) keys)
                c = dict(cfg)
                ptrs = {"q_ptr": q_type, "out_ptr": q_type, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                        **cache_ptrs(kind, q_type), "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32"}
                ng = d // 32 if kind == "int8" else 1
                consts = dict(QPK=4, QPK_PAD=max(4, -(-16 // ng)), HQ=32, HEAD_DIM=d, GROUP=32 if kind == "int8" else d,
                              PAGE_SIZE=page, BLOCK_N=c.pop("BLOCK_N"), SPLIT=splits > 1, QUANT=kind == "int8",
                              COMPILED=True)
                q_name = " q=fp32" if q_type == "*fp32" else ""
                build(f"decode d{d} {kind} splits{splits} page{page}{q_name}", _decode_kernel, ptrs, {"qk_scale": "fp32"},
                      consts, c)
            for chunk, opts in sorted(C.REDUCE_CHUNKS.items()):
                build(f"reduce d{d} chunk{chunk}", _decode_reduce_kernel,
                      {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16"}, {},
                      dict(HQ=32, HEAD_DIM=d, CHUNK=chunk), dict(opts))
        for d in (64, 128):
            for kind in ("int8", "float"):
                for rope in (True, False):
                    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "q_out_ptr": "*bf16",
                            "pos_ptr": "*i64", "cos_sin_ptr": "*fp32", **cache_ptrs(kind), "slot_ptr": "*i64"}
                    consts = dict(HQ=32, HKV=8, HQ_PAD=32, HKV_PAD=8, HEAD_DIM=d, GROUP=32 if kind == "int8" else d,
                                  PAGE_SIZE=16, ROPE=rope, QUANT=kind == "int8", PDL=True)
                    build(f"kv_write d{d} {kind} rope={rope}", _rope_kv_write_kernel, ptrs, {}, consts, dict(KV_WRITE_OPTIONS))
    print("RESULTS " + json.dumps(results))
    """
)

HOPPER_SMEM = 232448  # bytes of shared memory one block may use on sm_90


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_attention_kernels_compile_for_sm90(which):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, which], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    results = json.loads(line[len("RESULTS "):])
    assert results
    for r in results:
        assert r["cubin"] > 0, r
        assert r["shared"] <= HOPPER_SMEM, r
        if r["name"].endswith("q=fp32"):  # float32 attention runs in float32, not TF32 (prefill_attention.float_dot)
            assert r["tf32"] == 0, f"{r['name']}: {r['tf32']} TF32 instructions in the PTX"
        elif not r["name"].startswith(("kv_write", "kv_dequant", "reduce")):
            assert r["ptx_has_mma"], f"{r['name']}: no tensor-core instructions in the PTX"
            assert r["tf32"] == 0, r
        if r["name"].startswith("kv_write"):  # kernels/pdl.py: it lets the decode start, and waits for the qkv GEMM
            assert r["pdl_trigger"] >= 1 and r["pdl_wait"] >= 1, r
            # int8 tiles must move by vector copies: byte loads mean a lost contiguity hint or layout
            assert r["byte_loads"] == 0, f"{r['name']}: {r['byte_loads']} single-byte loads in the PTX"
            # the rotation and the quantization round as the reference does, each product on its own
            assert r["fma_f32"] == 0, f"{r['name']}: {r['fma_f32']} fused multiply-adds in the PTX"


WS_SCRIPT = textwrap.dedent(
    r"""
    import json, re, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    from eightbit.kernels import decode_attention_hopper as H

    def desc(shape, block):
        t = torch.zeros(*shape, dtype=torch.int8)
        return mangle_type(TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.int8)))

    def _producer_ops_until_first_mbarrier_wait(ptx):
        # the prefetching partition's instructions from its start (after the register hand-over) up to its
        # first mbarrier wait, in order: global loads (.cg or not), prefetches, and the PDL wait
        first_prefetch = ptx.find("prefetch.global.L2")
        if first_prefetch < 0:
            return []
        start = ptx.rfind("setmaxnreg", 0, first_prefetch)
        part = ptx[start:ptx.find("mbarrier.try_wait", first_prefetch)]
        return re.findall(r"ld\.global\.cg|ld\.global|prefetch\.global\.L2|griddepcontrol\.wait", part)

    def _consumer_ops_until_its_wait(ptx):
        # the math partition's global loads from its start (its register grant, the first in the PTX) to its wait
        start = ptx.find("setmaxnreg.inc")
        return re.findall(r"ld\.global\.cg|ld\.global", ptx[start:ptx.find("griddepcontrol.wait", start)])

    fn = H._decode_ws_kernel
    results = []
    def _tile_loop(ptx):
        # the math warps' tile loop: from the label of the block holding the slot wait to the branch back to it
        i = ptx.find("wait_slot:")
        if i < 0:
            return ""
        label = re.findall(r"^(\$L__BB\d+_\d+):", ptx[:i], re.M)[-1]
        end = re.search(r"bra(?:\.uni)?\s+" + re.escape(label) + ";", ptx[i:])
        return ptx[ptx.rfind(label + ":", 0, i):i + end.end()] if end else ""

    # (split, merge, head_dim, query heads per kv head, the PDL chain, WARP_RELEASE, EARLY_INDICES)
    cases = [(False, False, 128, 4, True, True, False), (True, False, 128, 4, True, True, False),
             (True, True, 128, 4, True, True, False), (True, True, 64, 4, True, True, False),
             (True, True, 256, 2, True, True, False), (True, True, 128, 4, False, True, False),
             (True, True, 128, 4, True, False, False), (True, True, 128, 4, True, True, True),
             (False, False, 64, 4, True, True, True)]
    for split, merge, d, qpk, chain, warp_release, early in cases:
        ng = d // 32
        sig = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
               "count_ptr": "*i32",
               "k_desc": desc([64, 16, 8 * d], [1, 16, d]),
               "v_desc": mangle_type(TensorDescriptor.from_tensor(torch.zeros(64 * 8, d // 8, 128, dtype=torch.int8),
                                                                  [1, d // 8, 128], H.V_LAYOUT)),
               "k_ptr": "*i8", "v_ptr": "*i8",
               "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
               "order_ptr": "*i32",
               "qk_scale": "fp32"}
        sig.update({a: "i32" for a in fn.arg_names if a not in sig})
        consts = dict(QPK=qpk, QPK_PAD=16 // ng, HQ=8 * qpk, HKV=8, NG=ng, STAGES=H.STAGES, SPLIT=split, MERGE=merge,
                      KW=H.KW, PDL=True, TRIGGER=chain, PREFETCH_TILES=1, WARP_RELEASE=warp_release,
                      EARLY_INDICES=early)
        sig.update({n: "constexpr" for n in consts})
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
                 for a in ("q_ptr", "out_ptr", "part_out_ptr", "part_lse_ptr", "k_scale_ptr", "v_scale_ptr",
                           "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_sb")}
        k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": H.MAXNREG})
        ptx = k.asm["ptx"]
        loop = _tile_loop(ptx)
        results.append(dict(split=split, merge=merge, d=d, chain=chain, warp_release=warp_release, early=early,
                            stages=H.STAGES,
                            offsets=H.ring_barrier_offsets(ptx), loop_len=len(loop),
                            loop_release="@lead mbarrier.arrive" in loop,
                            loop_bar_syncs=loop.count("bar.sync"), atomics=ptx.count("atom.global"),
                            shared=k.metadata.shared, cubin=len(k.asm["cubin"]),
                            mma=ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"),
                            tma=ptx.count("cp.async.bulk.tensor.3d"),
                            scale_copies=len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
                            async_arrive=ptx.count("cp.async.mbarrier.arrive.shared.b64"),
                            setmaxnreg=ptx.count("setmaxnreg"), byte_loads=ptx.count("ld.shared.b8") + ptx.count("ld.shared.v2.b8"),
                            pdl_wait=ptx.count("griddepcontrol.wait"),
                            pdl_trigger=ptx.count("griddepcontrol.launch_dependents"),
                            prefetch=ptx.count("prefetch.global.L2"),
                            prefetch_start=_producer_ops_until_first_mbarrier_wait(ptx),
                            consumer_start=_consumer_ops_until_its_wait(ptx)))
    print("RESULTS " + json.dumps(results))
    """
)


def test_decode_ws_kernel_compiles_for_sm90():
    """The Gluon decode kernel (no CPU interpreter exists for Gluon) at head_dim 64 / 128 / 256, with and without the
    PDL chain: float16 tensor-core mma, TMA page copies, cp.async scale copies that arrive on the ring's barrier,
    warp specialization, int8 operands read as 32-bit words (not bytes), shared memory for two programs per
    multiprocessor, in the chain the L2 prefetch before the wait, and with WARP_RELEASE a math warp's tile loop
    without a barrier across the warps, its ring barriers' offsets readable from the PTX (the launch needs them).
    With EARLY_INDICES the producer loads its first work item's indices before the wait, from L2, once, and
    prefetches its first tile from them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", WS_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    results = json.loads(line[len("RESULTS "):])
    assert results  # an empty list passed every check below
    for r in results:
        assert r["cubin"] > 0 and r["mma"] > 0 and r["tma"] > 0 and r["setmaxnreg"] > 0, r
        assert r["scale_copies"] > 0 and r["async_arrive"] > 0, r
        assert r["byte_loads"] <= 1, r  # one scalar byte load outside the loop is Triton's; the tiles are words
        assert r["pdl_wait"] >= 2, r  # the producer waits before its first copies, the consumers before q
        # in the chain, the producer lets the next kernel start once its copies are issued
        assert (r["pdl_trigger"] >= 1) == r["chain"], r
        assert (r["atomics"] > 0) == r["merge"], r  # the merge counters: only where the kernel merges its splits
        assert 2 * r["shared"] <= HOPPER_SMEM, r
        if r["warp_release"]:
            ready, empty = r["offsets"]
            assert ready != empty and max(ready, empty) + 8 * r["stages"] <= r["shared"], r
            assert r["loop_len"] > 0 and r["loop_release"] and r["loop_bar_syncs"] == 0, r
        else:  # Gluon's waits: the launch's bind finds no offsets to fill in, and the loop syncs the warps
            assert r["offsets"] is None and r["loop_len"] == 0, r
        if not r["chain"]:  # EIGHTBIT_PDL_CHAIN=0 restores the old launch: no prefetch
            assert r["prefetch"] == 0, r
            continue
        # the producer's L2 prefetch of its first tile, before its wait, from indices loaded around L1
        # (a stale line there would be read again after the wait)
        start = r["prefetch_start"]
        assert r["prefetch"] > 0 and "griddepcontrol.wait" in start, r
        before_wait = start[:start.index("griddepcontrol.wait")]
        assert "prefetch.global.L2" in before_wait and "prefetch.global.L2" not in start[len(before_wait):], r
        assert set(before_wait) == {"ld.global.cg", "prefetch.global.L2"}, r
        # the prefetch's own hint-only indices: order, length, a vector of page numbers. EARLY_INDICES: the first
        # item's order, length and four page numbers instead, loaded once, before the prefetch made from them;
        # the math warps its order and length (and nothing before their wait without it)
        loads = before_wait.count("ld.global.cg")
        assert loads == (6 if r["early"] else 4), r
        assert "ld.global.cg" not in before_wait[before_wait.index("prefetch.global.L2"):], r
        assert r["consumer_start"] == ["ld.global.cg"] * 2 * r["early"], r


WS_PREFILL_SCRIPT = textwrap.dedent(
    r"""
    import json, re, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    from eightbit.kernels import attention_configs as C
    from eightbit.kernels import prefill_attention_hopper as P

    fn = P._prefill_ws_kernel
    results = []
    for d, cfg in C.PREFILL_WS.items():
        for dtype, ptr in ((torch.bfloat16, "*bf16"), (torch.float16, "*fp16")):
            q_layout, kv_layout, s_l, o_l = P._layouts(cfg["BLOCK_N"], d, dtype)

            def desc(block, layout):
                t = torch.zeros(256, 8 * d, dtype=dtype)
                return mangle_type(TensorDescriptor(t, [256, 8 * d], [8 * d, 1], block, layout))

            sig = {"q_desc": desc([P.HALF_ROWS, d], q_layout), "k_desc": desc([16, d], kv_layout),
                   "v_desc": desc([16, d], kv_layout), "out_ptr": ptr, "qk_scale": "fp32"}
            sig.update({a: "*i32" for a in fn.arg_names if a.endswith("_ptr") and a not in sig})
            sig.update({a: "i32" for a in fn.arg_names if a not in sig})
            consts = dict(HQ=32, QPK=4, BN=cfg["BLOCK_N"], STAGES=cfg["STAGES"], S_L=s_l, O_L=o_l, KV_LAYOUT=kv_layout)
            sig.update({n: "constexpr" for n in consts})
            attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("out_ptr", "stride_ot", "stride_oh")}
            k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            ptx = k.asm["ptx"]
            results.append(dict(d=d, dtype=ptr, shared=k.metadata.shared, cubin=len(k.asm["cubin"]),
                                wgmma=ptx.count("wgmma.mma_async"), tma=ptx.count("cp.async.bulk.tensor.2d"),
                                setmaxnreg=ptx.count("setmaxnreg"), fence=ptx.count("fence.proxy.async"),
                                partition_barrier=len(re.findall(r"bar\.sync\s+[1-9]\d*,\s*128;", ptx))))
    print("RESULTS " + json.dumps(results))
    """
)


def test_prefill_ws_kernel_compiles_for_sm90():
    """The Gluon prefill kernel, for every head_dim of attention_configs.PREFILL_WS and both float dtypes:
    wgmma tensor-core instructions, TMA copies, warp specialization, the fence and the consumer-only barrier
    of V's tail zeroing, and shared memory that fits a Hopper multiprocessor."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", WS_PREFILL_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    results = json.loads(line[len("RESULTS "):])
    assert len(results) >= 2 and any(r["d"] == 128 for r in results)
    for r in results:
        assert r["cubin"] > 0 and r["wgmma"] > 0 and r["tma"] > 0 and r["setmaxnreg"] > 0, r
        assert r["fence"] > 0 and r["partition_barrier"] > 0, r
        assert r["shared"] <= HOPPER_SMEM, r
