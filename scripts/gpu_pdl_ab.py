"""Programmatic dependent launch A/B for the int8 GEMMs at decode sizes, in one process (GPU).

    python scripts/gpu_pdl_ab.py [M list, default 16,32,128,192,256]   -> $OUT/pdl_ab.json (or /tmp)

For Llama-3-8B and Llama-3.2-1B's linear shapes: quant_per_token + int8_gemm ("quant+GEMM", what the
"never slower than bf16" goal counts) and back-to-back int8_gemm calls ("GEMM"), with kernels/pdl.py's
switch off, on, off, on (CUDA-graph replays over rotated weights, as eval/bench_gemm.py times them), and
whether the outputs are bit-identical. PDL_MAX_M is lifted so that the M > 128 cells show what PDL would do
there (the twelfth session's numbers in docs/benchmarks/gemm.md were taken this way).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

from eightbit.eval.bench_gemm import MODELS, copy_bandwidth, n_copies, time_graph
from eightbit.kernels import int8_gemm as gemm_module
from eightbit.kernels import pdl
from eightbit.kernels.int8_gemm import int8_gemm
from eightbit.kernels.quant_per_token import quant_per_token

PASSES = (("off", False), ("on", True), ("off2", False), ("on2", True))


def bench_shape(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quant_per_token(x)
    nc = n_copies(n * k)
    wq = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(nc)]
    ws = [torch.rand(n, 1, device="cuda") * 0.01 for _ in range(nc)]

    def quant_gemm(i):
        q, s = quant_per_token(x)
        return int8_gemm(q, s, wq[i], ws[i])

    r, outs = {}, []
    for name, on in PASSES:
        pdl.ENABLED = on
        outs.append(int8_gemm(xq, xs, wq[0], ws[0]))
        r["gemm_" + name] = time_graph([lambda i=i: int8_gemm(xq, xs, wq[i], ws[i]) for i in range(nc)])
        r["quant_gemm_" + name] = time_graph([lambda i=i: quant_gemm(i) for i in range(nc)])
    pdl.ENABLED = True
    r["bit_identical"] = all(torch.equal(o, outs[0]) for o in outs)
    wq.clear()
    ws.clear()
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(n_copies(2 * n * k))]
    r["bf16"] = time_graph([lambda w=w: F.linear(x, w) for w in wb])
    wb.clear()
    torch.cuda.empty_cache()
    return r


def main():
    ms = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 32, 128, 192, 256]
    gemm_module.PDL_MAX_M = 1 << 30
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy {bw:.0f} GB/s; µs, PDL off -> on (means of two passes)", flush=True)
    rows = []
    for model, shapes in MODELS.items():
        for op, (n, k) in shapes.items():
            for m in ms:
                r = bench_shape(m, n, k)
                rows.append(dict(model=model, op=op, m=m, **r))
                mean = lambda key, a, b: (r[f"{key}_{a}"] + r[f"{key}_{b}"]) / 2  # noqa: E731
                print(f"{model:12s} {op:8s} M={m:4d} bf16 {r['bf16']:7.2f} | quant+GEMM "
                      f"{mean('quant_gemm', 'off', 'off2'):7.2f} -> {mean('quant_gemm', 'on', 'on2'):7.2f} | GEMM "
                      f"{mean('gemm', 'off', 'off2'):7.2f} -> {mean('gemm', 'on', 'on2'):7.2f} | "
                      f"bit-identical {r['bit_identical']}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "pdl_ab.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
