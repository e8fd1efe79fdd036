"""Tune int8_gemm's launch configurations on the GPU and write the committed table.

    python eval/tune_gemm.py [--out kernels/gemm_configs.json] [--budget-s 240] [--workers 16]

For every target (N, K) (Llama-3-8B and Llama-3.2-1B linear shapes) and every
M bucket of gemm_configs.M_BUCKETS, each candidate configuration is
1. compiled ahead in a pool of worker processes (one compile per config and
   specialization; they fill Triton's on-disk cache, so the timing process only loads),
2. checked: with scales of 1 and an fp32 output the result must equal the exact
   int32 product (torch, float64) bit for bit,
3. timed as CUDA-graph replays over rotated weight copies (eval/bench_gemm.time_graph).
The fastest correct candidate is written with its time and the default's time.
Shapes not finished inside the budget keep the default (gemm_configs.default_config).
"""

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

TARGETS = [  # (N, K), the 8B shapes first
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
]


def candidates(m):
    from eightbit.kernels.gemm_configs import GemmConfig as C

    if m <= 64:
        bm = max(16, m)
        out = []
        for bn, bk, st in ((32, 256, 4), (64, 256, 4), (128, 256, 3), (64, 128, 6), (32, 512, 3), (64, 512, 3)):
            for sk in (1, 2, 4, 8):
                out.append(C(bm, bn, bk, 1, sk, 4, st))
        return out
    if m <= 256:
        return [C(64, 64, 128, 8, 1, 4, 4), C(64, 128, 128, 8, 1, 4, 4), C(64, 128, 128, 8, 2, 4, 4),
                C(128, 128, 128, 8, 1, 8, 4), C(128, 64, 128, 8, 1, 4, 4), C(64, 256, 128, 8, 1, 8, 3),
                C(128, 128, 128, 8, 2, 8, 4), C(64, 64, 256, 8, 2, 4, 4), C(128, 256, 128, 8, 1, 8, 3),
                C(64, 32, 256, 8, 1, 4, 4), C(64, 32, 256, 8, 2, 4, 4), C(64, 64, 256, 8, 4, 4, 4),
                C(128, 64, 128, 8, 2, 4, 4), C(128, 32, 256, 8, 1, 4, 4), C(128, 32, 256, 8, 2, 4, 4),
                C(64, 64, 128, 8, 2, 4, 5), C(64, 64, 128, 8, 4, 4, 5)]
    return [C(128, 128, 128, 8, 1, 8, 4), C(128, 256, 128, 8, 1, 8, 3), C(256, 128, 128, 8, 1, 8, 3),
            C(128, 256, 64, 8, 1, 8, 4), C(128, 128, 64, 8, 1, 4, 5), C(128, 128, 128, 8, 1, 4, 4),
            C(64, 256, 128, 8, 1, 4, 4), C(256, 128, 64, 8, 1, 8, 4), C(128, 256, 128, 16, 1, 8, 3)]


def _inputs(m, n, k, device="cuda"):
    g = torch.Generator(device=device).manual_seed(m * 7 + n + k)
    xq = torch.randint(-128, 128, (m, k), device=device, dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (n, k), device=device, dtype=torch.int8, generator=g)
    return xq, wq


def _warm(jobs):
    """Worker: compile (launch once) each (m, n, k, cfg); returns the failures."""
    from eightbit.kernels.int8_gemm import int8_gemm_with_config

    failed = []
    for m, n, k, cfg in jobs:
        try:
            xq, wq = _inputs(m, n, k)
            int8_gemm_with_config(xq, torch.ones(m, 1, device="cuda"), wq, torch.ones(n, 1, device="cuda"),
                                  None, torch.bfloat16, cfg)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            failed.append((m, n, k, cfg, repr(e)[:200]))
    return failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "kernels", "gemm_configs.json"))
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args(argv)
    t0 = time.time()

    from eightbit.eval.bench_gemm import n_copies, time_graph
    from eightbit.kernels import gemm_configs as gc
    from eightbit.kernels.int8_gemm import int8_gemm_with_config

    jobs = [(mb, n, k, cfg) for (n, k) in TARGETS for mb in gc.M_BUCKETS for cfg in candidates(mb)]
    # one compile per distinct (config, specialization): M=mb is always a multiple of 16 here
    seen, uniq = set(), []
    for m, n, k, cfg in jobs:
        key = (cfg, m == 1, k % cfg.block_k == 0)
        if key not in seen:
            seen.add(key)
            uniq.append((m, n, k, cfg))
    uniq.sort(key=lambda j: j[0] * j[1])  # cheap launches first
    ctx = torch.multiprocessing.get_context("spawn")
    bad = set()
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        chunks = [uniq[i :: args.workers] for i in range(args.workers)]
        for failed in pool.map(_warm, chunks):
            for m, n, k, cfg, why in failed:
                print(f"compile/launch failed: {cfg} at M={m}: {why}", file=sys.stderr)
                bad.add(cfg)
    print(f"warmed {len(uniq)} kernels in {time.time() - t0:.0f}s ({len(bad)} failed)", flush=True)

    entries = []
    for n, k in TARGETS:
        for mb in gc.M_BUCKETS:
            if time.time() - t0 > args.budget_s:
                print(f"budget spent: N={n} K={k} M<={mb} keeps the default", flush=True)
                continue
            m = mb
            xq, wq0 = _inputs(m, n, k)
            ones_m, ones_n = torch.ones(m, 1, device="cuda"), torch.ones(n, 1, device="cuda")
            exact = (xq.double() @ wq0.double().t()).float()
            nc = n_copies(n * k)
            wqs = [wq0] + [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(nc - 1)]
            xs = torch.rand(m, 1, device="cuda") * 0.01
            wss = [torch.rand(n, 1, device="cuda") * 0.01 for _ in range(nc)]
            default = gc.default_config(m, n, k)
            cands = [c for c in candidates(mb) if c not in bad]
            if default not in cands:
                cands.append(default)
            timings = {}
            for cfg in cands:
                try:
                    out = int8_gemm_with_config(xq, ones_m, wq0, ones_n, None, torch.float32, cfg)
                    if not torch.equal(out, exact):
                        print(f"WRONG RESULT: {cfg} at M={m} N={n} K={k}", flush=True)
                        continue
                    timings[cfg] = time_graph(
                        [lambda i=i, c=cfg: int8_gemm_with_config(xq, xs, wqs[i], wss[i], None, torch.bfloat16, c)
                         for i in range(nc)], target_ms=2.0, replays=3)
                except Exception as e:  # noqa: BLE001
                    print(f"failed: {cfg} at M={m} N={n} K={k}: {repr(e)[:150]}", flush=True)
            if not timings:
                continue
            best = min(timings, key=timings.get)
            entries.append(dict(m_bucket=mb, n=n, k=k, config=best.to_dict(), us=round(timings[best], 2),
                                default_us=round(timings.get(default, float("nan")), 2)))
            print(f"N={n:6d} K={k:6d} M<={mb:5d}: {timings[best]:8.1f}us (default {timings.get(default, float('nan')):8.1f}us)"
                  f"  {best.key()}", flush=True)
            del wqs, wss, exact
            torch.cuda.empty_cache()
    table = dict(
        device=torch.cuda.get_device_name(), triton=__import__("triton").__version__, torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"), note="written by eval/tune_gemm.py; key = (m_bucket, n, k)",
        configs=entries,
    )
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
    print(f"wrote {len(entries)} entries to {args.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
