"""The prefill launch choices in kernels/attention_configs.py, measured in one process (GPU, sm_90).

    python scripts/gpu_prefill_sweep.py ws [head_dim]   # PREFILL_WS: the Gluon kernel's (keys, ring slots)
    python scripts/gpu_prefill_sweep.py int8            # PREFILL_INT8_VIA_FLOAT_*: copy + Gluon vs int8 Triton

`ws`: bf16 cache, 32/8 heads, causal, 16k tokens per call at 256-8k tokens per prompt; the Triton kernel, then
each (BLOCK_N, STAGES) candidate of the Gluon kernel, TFLOP/s (outputs checked against the Triton kernel's).
`int8`: full prefills and chunks at the end of long contexts, the int8 Triton kernel against the dequantized
bf16 copy + the Gluon kernel (thresholds lifted so every case takes the copy), µs and speed-up. Eager calls timed
by CUDA events (eval/bench_attention.time_eager), so the smallest cases include the host's launch time.
The thirteenth session's runs of the same measurements (ignored copies of this code: bench_base/s13_*_sweep.py)
are in docs/benchmarks/attention.md; this script has not yet run in this form.
"""

import sys

import torch

from eightbit.eval.bench_attention import HQ, PAGE, make_cache, time_eager
from eightbit.kernels import attention_configs as C
from eightbit.kernels.prefill_attention import prefill_attention

WS_CANDIDATES = [(128, 2), (128, 3), (128, 4), (64, 3), (64, 4)]


def inputs(batch, ctx, nq, d, kind):
    width = ctx // PAGE
    bt = torch.randperm(batch * width, device="cuda", dtype=torch.int32).view(batch, width).contiguous()
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * nq
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch * nq, HQ, d, device="cuda", dtype=torch.bfloat16)
    return (q, *make_cache(batch * width, d, kind), bt, cu, sl, d ** -0.5)


def causal_flops(batch, ctx, nq, d):
    return 4 * batch * HQ * d * nq * (ctx - nq / 2)  # each query sees its prefix


def sweep_ws(d):
    saved = C.PREFILL_WS.get(d)
    for seq in (256, 512, 1024, 2048, 4096, 8192):
        b = 16384 // seq
        args = inputs(b, seq, seq, d, "bf16")
        flops = causal_flops(b, seq, seq, d)
        C.PREFILL_WS.pop(d, None)
        ref = prefill_attention(*args)
        row = {"triton": flops / time_eager(lambda: prefill_attention(*args)) / 1e9}
        for bn, stages in WS_CANDIDATES:
            C.PREFILL_WS[d] = dict(BLOCK_N=bn, STAGES=stages)
            diff = (prefill_attention(*args).float() - ref.float()).abs().max().item()
            assert diff < 0.05, f"{bn} x {stages}: max difference {diff} from the Triton kernel"
            row[f"{bn}x{stages}"] = flops / time_eager(lambda: prefill_attention(*args)) / 1e9
        print(f"d {d} seq {seq:5d}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()), flush=True)
    C.PREFILL_WS.pop(d, None)
    if saved is not None:
        C.PREFILL_WS[d] = saved


def sweep_int8(d=128):
    C.PREFILL_INT8_VIA_FLOAT_MIN_TOKENS = 1
    C.PREFILL_INT8_VIA_FLOAT_MAX_BYTES = 1 << 40
    cases = [(16384 // s, s, s) for s in (64, 128, 256, 512, 1024, 2048, 4096, 8192)]
    cases += [(b, ctx, nq) for b in (1, 4) for ctx in (2048, 8192, 32768) for nq in (16, 64, 256, 1024)
              if b * ctx <= 65536]
    for b, ctx, nq in cases:
        args = inputs(b, ctx, nq, d, "int8")
        times = {}
        for via_copy in (False, True):
            C.PREFILL_INT8_VIA_FLOAT = via_copy
            times[via_copy] = time_eager(lambda: prefill_attention(*args)) * 1e3
        tflops = causal_flops(b, ctx, nq, d) / times[True] / 1e6
        print(f"batch {b:3d} context {ctx:6d} queries {nq:5d}: int8 Triton {times[False]:8.1f} us, "
              f"copy + Gluon {times[True]:8.1f} us ({tflops:.0f} TFLOP/s), x{times[False] / times[True]:.2f}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    what = sys.argv[1] if len(sys.argv) > 1 else "ws"
    if what == "ws":
        sweep_ws(int(sys.argv[2]) if len(sys.argv) > 2 else 128)
    elif what == "int8":
        sweep_int8()
    else:
        sys.exit(f"unknown sweep {what!r}: ws [head_dim] | int8")
