"""Benchmark the W8A8 GEMM and the fused quantizers on the GPU against bf16 cuBLAS and torch._int_mm.

    python eval/bench_gemm.py [--json results.json] [--md table.md] [--quick | --decode | --sweep 129:1500:23]

One process measures, on the same card: the device-to-device copy bandwidth (bytes
read + written per second of a 1 GiB copy), then for Llama-3-8B and Llama-3.2-1B's
linear shapes (qkv, o, gate_up, down) and M in {1, 8, ..., 8192}:

* bf16  F.linear (cuBLAS), bf16 weights
* int_mm  torch._int_mm + dequant in plain torch (M > 16 only: it refuses smaller M);
  int_mm_only (in the JSON) is torch._int_mm alone, int32 out
* ours_gemm  int8_gemm alone (the activation already quantized), GEMM after GEMM in the PDL chain
  (kernels/pdl.py, sm_90): each call's programs start, and prefetch their first weight lines, while the call
  before finishes, as a decode GEMM's do behind its producer in the engine
* ours_gemm_nochain  the same without the chain: no call lets the next start early (at M <= 128 each is still
  launched with PDL, so its programs are set up as the last ones of the call before exit; EIGHTBIT_PDL=0: none)
* ours  quant_per_token + int8_gemm (what a linear layer without a fused producer costs)
* read ceiling  per shape, a kernel that only reads the int8 weight bytes (eval/read_ceiling.py), timed the same
  way: what a weight-bound GEMM of that size can reach on this card (at 25 MB well below the copy bandwidth)

With --sweep START:STOP:STEP it times only quant_per_token + int8_gemm against bf16 at those M (on --sweep-shapes,
by default Llama-3.2-1B and Llama-3-8B qkv and o) and lists the cells slower than bf16: the "never slower at any M"
goal between the tuned buckets, whose configs were tuned at another M.

Before any timing, our GEMM's output is checked against the exact product (float64, scales applied in
float32, rounded to bf16) and _int_mm's against the same: a wrong result stops the run, it is never timed.
M also takes values between the tuned table's buckets (MID_M), whose configs were tuned at another M.

Every variant is timed as CUDA-graph replays (no launch gaps) over several copies
of the weights, rotated, so their bytes exceed the L2 cache and every call reads
its weights from HBM. Reported: microseconds, TOP/s and % of the int8 dense
tensor-core peak (1979 TOP/s for H100/H200 SXM), weight GB/s and % of the copy
bandwidth, and speedups. Then rmsnorm_quant / silu_mul_quant bandwidth.
"""

import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F

INT8_PEAK_TOPS = 1979.0
MODELS = {
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llama3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}
M_LIST = (1, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192)
MID_M = (12, 48, 100, 160, 320, 600, 900, 1280, 2500, 5000)  # between gemm_configs.M_BUCKETS
ROTATE_BYTES = 320 * 2**20  # weight copies per variant: at least this many bytes, > the 50-60 MB L2


def n_copies(nbytes, cap=48):
    return max(1, min(cap, math.ceil(ROTATE_BYTES / max(1, nbytes))))


def time_graph(fns, target_ms=3.0, replays=5):
    """Median microseconds per call of the callables in fns (called in turn), timed as CUDA-graph replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:  # warm-up (compiles, allocates) outside capture
            f()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for f in fns:
            f()
        end.record()
        torch.cuda.synchronize()
        est_ms = max(start.elapsed_time(end), 1e-3)
        reps = max(1, min(200, int(target_ms / est_ms)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                for f in fns:
                    f()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / (reps * len(fns)))
    del graph
    torch.cuda.synchronize()
    return statistics.median(times)


def copy_bandwidth():
    """Bytes read + written per second of a 1 GiB device-to-device copy (GB/s): the best of a memcpy, a torch
    elementwise copy and a Triton copy kernel (bench_common.measure_copy_bandwidth, what every benchmark uses)."""
    from eightbit.eval.bench_common import measure_copy_bandwidth

    return measure_copy_bandwidth()["best_gbs"]


def check_gemm(name, out, want):
    """Stop the run if `out` (bf16) is not `want` (the exact product, scaled, in bf16) up to one bf16 rounding."""
    if not torch.allclose(out.float(), want.float(), rtol=2**-7, atol=1e-6):
        err = (out.float() - want.float()).abs().max().item()
        raise RuntimeError(f"{name} gives a wrong result (max abs error {err:.3g}): not timed")


def with_chain(enabled, fn):
    """fn() with the PDL chain (kernels/pdl.CHAIN) on or off."""
    from eightbit.kernels import pdl

    saved, pdl.CHAIN = pdl.CHAIN, enabled
    try:
        return fn()
    finally:
        pdl.CHAIN = saved


def int8_weights(n, k):
    """Rotated int8 weight copies [N, K] and their per-channel scales (n_copies of them: their bytes exceed L2)."""
    nc = n_copies(n * k)
    return ([torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(nc)],
            [torch.rand(n, 1, device="cuda") * 0.01 for _ in range(nc)])


def bf16_weights(n, k):
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(n_copies(2 * n * k))]


def exact_gemm(xq, xs, wq, ws):
    """The exact int8 product (float64), scaled in float32, rounded to bf16: what check_gemm compares with."""
    return ((xq.double() @ wq.double().t()).float() * xs * ws.view(1, -1)).to(torch.bfloat16)


def quant_gemm_calls(x, wq, ws):
    """One callable per weight copy: quant_per_token(x) + int8_gemm, a linear layer without a fused producer."""
    from eightbit.kernels.int8_gemm import int8_gemm
    from eightbit.kernels.quant_per_token import quant_per_token

    def ours(i):
        q, s = quant_per_token(x)
        return int8_gemm(q, s, wq[i], ws[i])

    return [lambda i=i: ours(i) for i in range(len(wq))]


def bench_linear(m, n, k, with_int_mm=True):
    from eightbit.kernels.int8_gemm import int8_gemm
    from eightbit.kernels.quant_per_token import quant_per_token

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quant_per_token(x)
    res = {}
    wq, ws = int8_weights(n, k)
    want = exact_gemm(xq, xs, wq[0], ws[0])
    check_gemm(f"int8_gemm at M={m} N={n} K={k}", int8_gemm(xq, xs, wq[0], ws[0]), want)
    gemm_calls = [lambda i=i: int8_gemm(xq, xs, wq[i], ws[i]) for i in range(len(wq))]
    res["ours_gemm"] = time_graph(gemm_calls)
    res["ours_gemm_nochain"] = with_chain(False, lambda: time_graph(gemm_calls))
    res["ours"] = time_graph(quant_gemm_calls(x, wq, ws))
    if with_int_mm and m > 16:
        wt = [w.t() for w in wq]  # [K, N] column-major: cuBLAS's int8 "TN" layout

        def int_mm(i):
            acc = torch._int_mm(xq, wt[i])
            return (acc.float() * xs * ws[i].view(1, -1)).to(torch.bfloat16)

        try:
            check_gemm(f"torch._int_mm + dequant at M={m} N={n} K={k}", int_mm(0), want)
            res["int_mm"] = time_graph([lambda i=i: int_mm(i) for i in range(len(wt))])
            res["int_mm_only"] = time_graph([lambda i=i: torch._int_mm(xq, wt[i]) for i in range(len(wt))])
        except RuntimeError as e:
            print(f"  _int_mm failed at M={m} N={n} K={k}: {str(e)[:100]}", file=sys.stderr)
    del wq, ws, want
    wb = bf16_weights(n, k)
    res["bf16"] = time_graph([lambda i=i: F.linear(x, wb[i]) for i in range(len(wb))])
    del wb
    torch.cuda.empty_cache()
    return res


SWEEP_SHAPES = "llama3.2-1b:o,llama3.2-1b:qkv,llama3-8b:o,llama3-8b:qkv"


def parse_sweep(spec, shapes=SWEEP_SHAPES):
    """'START:STOP:STEP' (STOP included when the steps reach it) and 'model:op,...' -> (M values, [(model, op)])."""
    try:
        start, stop, step = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"--sweep takes START:STOP:STEP (integers), got {spec!r}") from None
    if start < 1 or stop < start or step < 1:
        raise ValueError(f"--sweep needs 1 <= START <= STOP and STEP >= 1, got {spec!r}")
    pairs = [tuple(item.split(":", 1)) for item in shapes.split(",") if item]
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in MODELS or pair[1] not in MODELS[pair[0]]:
            known = ", ".join(f"{m}:{o}" for m in MODELS for o in MODELS[m])
            raise ValueError(f"--sweep-shapes: unknown shape {':'.join(pair)!r} (known: {known})")
    return list(range(start, stop + 1, step)), pairs


def sweep_linear(model, op, ms):
    """quant_per_token + int8_gemm (the committed table and launch) against bf16 F.linear at every M in ms, each
    output checked against the exact product first: the "never slower than bf16 at any M" goal between the buckets."""
    from eightbit.kernels.int8_gemm import int8_gemm
    from eightbit.kernels.quant_per_token import quant_per_token

    n, k = MODELS[model][op]
    (wq, ws), wb = int8_weights(n, k), bf16_weights(n, k)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = quant_per_token(x)
        check_gemm(f"int8_gemm at M={m} N={n} K={k}", int8_gemm(xq, xs, wq[0], ws[0]), exact_gemm(xq, xs, wq[0], ws[0]))
        us_ours = time_graph(quant_gemm_calls(x, wq, ws))
        us_bf16 = time_graph([lambda i=i: F.linear(x, wb[i]) for i in range(len(wb))])
        rows.append(dict(model=model, op=op, m=m, n=n, k=k, us_ours=us_ours, us_bf16=us_bf16))
        print(f"{model:12s} {op:8s} M={m:5d}  bf16 {us_bf16:8.2f}us  ours {us_ours:8.2f}us  x{us_bf16 / us_ours:.3f}",
              flush=True)
    del wq, ws, wb
    torch.cuda.empty_cache()
    return rows


def run_sweep(args, ms, pairs, dev_name):
    rows = [r for model, op in pairs for r in sweep_linear(model, op, ms)]
    slower = [r for r in rows if r["us_bf16"] < r["us_ours"]]
    lines = [f"Device: {dev_name}. quant_per_token + int8_gemm against bf16 F.linear, M = {args.sweep}.", "",
             f"{len(rows)} cells, {len(slower)} slower than bf16" + (":" if slower else "."), ""]
    if slower:
        lines += ["| model | op | M | bf16 µs | ours µs | bf16/ours |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['op']} | {r['m']} | {r['us_bf16']:.2f} | {r['us_ours']:.2f} | "
                  f"{r['us_bf16'] / r['us_ours']:.3f} |" for r in slower]
    write_results(args, dict(device=dev_name, sweep=args.sweep, rows=rows), "\n".join(lines) + "\n")


def write_results(args, results, md):
    """results to --json, the markdown table to --md (each if given); the table to stdout last."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    print(md)


def bench_rows(copy_gbs):
    from eightbit.kernels.rmsnorm_quant import rmsnorm_quant
    from eightbit.kernels.silu_mul_quant import silu_mul_quant

    rows = []
    for m in (1, 64, 4096, 16384):
        h = 4096
        nc = n_copies(m * h * 2)
        xs = [torch.randn(m, h, device="cuda", dtype=torch.bfloat16) for _ in range(nc)]
        rs = [torch.randn(m, h, device="cuda", dtype=torch.bfloat16) for _ in range(nc)]
        w = torch.rand(h, device="cuda", dtype=torch.bfloat16)
        us = time_graph([lambda i=i: rmsnorm_quant(xs[i], w, 1e-5, rs[i]) for i in range(nc)])
        nbytes = m * h * (2 + 2 + 2 + 1) + m * 4 + h * 2  # x, residual in; residual, q, scale out
        rows.append(("rmsnorm_quant+residual", m, h, us, nbytes / us / 1e3))
        del xs, rs
        i_ = 14336
        nc = n_copies(m * 2 * i_ * 2)
        gus = [torch.randn(m, 2 * i_, device="cuda", dtype=torch.bfloat16) for _ in range(nc)]
        us = time_graph([lambda i=i: silu_mul_quant(gus[i]) for i in range(nc)])
        nbytes = m * i_ * (4 + 1) + m * 4
        rows.append(("silu_mul_quant", m, i_, us, nbytes / us / 1e3))
        del gus
        torch.cuda.empty_cache()
    return [dict(op=o, m=m, n=n, us=us, gbs=g, pct_copy=100 * g / copy_gbs) for o, m, n, us, g in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--quick", action="store_true", help="8B shapes, fewer M")
    ap.add_argument("--decode", action="store_true", help="both models, M in 1, 2, 4, 8, 16 only, no row kernels")
    ap.add_argument("--sweep", metavar="START:STOP:STEP",
                    help="only quant + GEMM against bf16 at these M (e.g. 129:1500:23), on --sweep-shapes")
    ap.add_argument("--sweep-shapes", default=SWEEP_SHAPES, help=f"model:op,... (default {SWEEP_SHAPES})")
    args = ap.parse_args(argv)
    if args.sweep:
        try:
            sweep = parse_sweep(args.sweep, args.sweep_shapes)
        except ValueError as e:
            ap.error(str(e))
    torch.manual_seed(0)
    dev_name = torch.cuda.get_device_name()
    if args.sweep:
        return run_sweep(args, *sweep, dev_name)
    copy_gbs = copy_bandwidth()  # also warms the clocks up
    copy_gbs = max(copy_gbs, copy_bandwidth())
    print(f"device: {dev_name}; copy bandwidth {copy_gbs:.0f} GB/s (read + write)", flush=True)
    models = {"llama3-8b": MODELS["llama3-8b"]} if args.quick else MODELS
    m_list = (1, 16, 64, 1024, 4096) if args.quick else tuple(sorted(M_LIST + MID_M))
    if args.decode:
        models, m_list = MODELS, (1, 2, 4, 8, 16)
    lin = []
    for model, shapes in models.items():
        for name, (n, k) in shapes.items():
            for m in m_list:
                r = bench_linear(m, n, k)
                row = dict(model=model, op=name, m=m, n=n, k=k, **{f"us_{v}": t for v, t in r.items()})
                ops = 2.0 * m * n * k
                for v, t in r.items():
                    row[f"tops_{v}"] = ops / t / 1e6
                    wbytes = n * k * (2 if v == "bf16" else 1)
                    row[f"wgbs_{v}"] = wbytes / t / 1e3
                lin.append(row)
                print(
                    f"{model:12s} {name:8s} M={m:5d}  bf16 {r['bf16']:9.1f}us  int_mm {r.get('int_mm', float('nan')):9.1f}us  "
                    f"ours {r['ours']:9.1f}us  gemm {r['ours_gemm']:9.1f}us  x{r['bf16'] / r['ours']:.2f}",
                    flush=True,
                )
    ceilings = read_ceilings(models)
    copy_end = copy_bandwidth()
    print(f"copy bandwidth at the end: {copy_end:.0f} GB/s", flush=True)
    rows = [] if args.decode else bench_rows(copy_gbs)
    write_results(args, dict(device=dev_name, copy_gbs=copy_gbs, linear=lin, rows=rows, read_ceiling=ceilings),
                  render_markdown(dev_name, copy_gbs, lin, rows, ceilings))


def read_ceilings(models):
    """Per shape, the best read-only kernel over the int8 weight bytes (eval/read_ceiling.py), timed as our GEMM."""
    from eightbit.eval.read_ceiling import read_ceiling

    out = []
    for model, shapes in models.items():
        for name, (n, k) in shapes.items():
            try:
                c = read_ceiling(n * k, time_graph, n_copies(n * k))
            except Exception as e:  # the GEMM results stand without it
                print(f"{model:12s} {name:8s} read ceiling failed: {e!r:.200}", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
                continue
            out.append(dict(model=model, op=name, n=n, k=k, **c))
            print(f"{model:12s} {name:8s} read ceiling {c['gbs']:7.0f} GB/s ({c['us']:.1f} us)", flush=True)
    return out


def render_markdown(dev_name, copy_gbs, lin, rows, ceilings=()):
    out = [f"Device: {dev_name}; device-to-device copy {copy_gbs:.0f} GB/s (read + write). "
           f"int8 peak taken as {INT8_PEAK_TOPS:.0f} TOP/s.", ""]
    out.append("`gemm` is timed GEMM after GEMM in the PDL chain (sm_90: each call starts while the one before "
               "finishes), `no chain` without it (still PDL-launched at M <= 128: EIGHTBIT_PDL=0 for none); `int_mm` is torch._int_mm alone (int32 out), "
               "`+dq` with its dequantization in plain torch. M values between the tuned buckets use the next "
               "bucket's config.")
    out.append("")
    out.append("| model | op | M | bf16 µs | int_mm µs | int_mm+dq µs | ours µs (quant+gemm) | gemm µs | gemm µs, no chain "
               "| gemm TOP/s | % int8 peak | gemm weight GB/s | % copy bw | % copy bw, no chain | bf16/ours | bf16/gemm "
               "| bf16/gemm, no chain | int_mm+dq/gemm |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def opt(v, fmt="{:.1f}"):
        return fmt.format(v) if v else "—"

    for r in lin:
        im, nc = r.get("us_int_mm"), r.get("us_ours_gemm_nochain")
        out.append(
            f"| {r['model']} | {r['op']} | {r['m']} | {r['us_bf16']:.1f} | {opt(r.get('us_int_mm_only'))} | {opt(im)} | "
            f"{r['us_ours']:.1f} | {r['us_ours_gemm']:.1f} | {opt(nc)} | {r['tops_ours_gemm']:.0f} | "
            f"{100 * r['tops_ours_gemm'] / INT8_PEAK_TOPS:.0f}% | {r['wgbs_ours_gemm']:.0f} | "
            f"{100 * r['wgbs_ours_gemm'] / copy_gbs:.0f}% | "
            f"{opt(nc and 100 * r['n'] * r['k'] / nc / 1e3 / copy_gbs, '{:.0f}%')} | {r['us_bf16'] / r['us_ours']:.2f} | "
            f"{r['us_bf16'] / r['us_ours_gemm']:.2f} | {opt(nc and r['us_bf16'] / nc, '{:.2f}')} | "
            f"{opt(im and im / r['us_ours_gemm'], '{:.2f}')} |")
    out += render_ceilings(copy_gbs, lin, ceilings)
    out += ["", "| fused op | M | row | µs | GB/s | % copy bw |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['op']} | {r['m']} | {r['n']} | {r['us']:.1f} | {r['gbs']:.0f} | {r['pct_copy']:.0f}% |")
    return "\n".join(out) + "\n"


def render_ceilings(copy_gbs, lin, ceilings):
    """The read ceiling per shape beside our GEMM's weight bandwidth at the smallest M of the run."""
    if not ceilings:
        return []
    small = sorted({r["m"] for r in lin if r["m"] <= 16})
    pct = {(r["model"], r["op"], r["m"]): 100 * r["wgbs_ours_gemm"] / copy_gbs for r in lin}
    out = ["", "Read ceiling: a kernel that only reads the shape's int8 weight bytes, timed as `gemm` is (best of a "
           "few launch geometries; eval/read_ceiling.py): about what a weight-bound GEMM of that size can reach (ours, "
           "in the PDL chain, passes it by a few points at some shapes).", "",
           "| model | op | weight MB | read µs | read GB/s | read % copy bw | geometry | "
           + " | ".join(f"gemm % copy bw, M = {m}" for m in small) + " |",
           "|---|---|---:|---:|---:|---:|---|" + "---:|" * len(small)]
    for c in ceilings:
        cells = [f"{pct[(c['model'], c['op'], m)]:.0f}%" if (c["model"], c["op"], m) in pct else "—" for m in small]
        out.append(f"| {c['model']} | {c['op']} | {c['n'] * c['k'] / 1e6:.1f} | {c['us']:.1f} | {c['gbs']:.0f} | "
                   f"{100 * c['gbs'] / copy_gbs:.0f}% | {c['programs']} × {c['warps']} warps × {c['step_bytes'] // 1024} KB"
                   " | " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    main()
