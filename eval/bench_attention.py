"""Benchmark the attention kernels against the HBM limit and SDPA (one process, one GPU).

    python -m eightbit.eval.bench_attention --out DIR [--sweep] [--quick]

1. Device-to-device copy bandwidth (bytes read + written per second): the ceiling.
2. (--sweep) a few block-size candidates per kernel at the goal shapes; the best is used for
   the rest of the run and printed, so it can be committed to kernels/attention_configs.py.
3. Prefill, causal, full-sequence: TFLOP/s of ours (bf16 cache, int8 cache) vs SDPA bf16
   (cuDNN and flash backends, with GQA: enable_gqa, or K/V expanded where a backend refuses it), d in {64, 128},
   seq 512..8192, 32 q / 8 kv heads. Every kernel's output is checked against kernels/reference.py before it is
   timed (a wrong result stops the run).
4. Decode, 32 q / 8 kv heads, d=128: batch (1, 8, 16, 32, 64, 256) x context (512-32k); ours int8 /
   bf16 over a paged cache (random block permutation) and over an identity table (contiguous), vs SDPA
   bf16 on contiguous [B, Hkv, S, D]; each timed by replaying a CUDA graph of calls over several cache
   copies (so small shapes do not sit in L2), pass after pass for ~2 ms a replay (REPLAY_MS). Bytes = the values
   + scales read. Beside it the read ceiling of the int8 call's bytes: a kernel that only reads that many bytes,
   timed the same way (eval/read_ceiling.py), what the call could reach at best at that size.
Writes DIR/attention_bench.json and prints a short table last.
"""

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import time
import traceback

import torch

from eightbit.kernels import reference as R

HQ, HKV, PAGE = 32, 8, 16
GROUP = 32
L2_ROTATE_BYTES = 256 << 20


def rotated_copies(nbytes):
    """How many copies of nbytes a timing rotates through: together past L2_ROTATE_BYTES, 1 to 64."""
    return max(1, min(64, math.ceil(L2_ROTATE_BYTES / nbytes)))


# --- timing ------------------------------------------------------------------------------


# One graph replay calls fns over and over for about this long, so that the replay's own launch and its first call's
# start (with no call before it to overlap) are spread over many calls: the calls run back to back, as bench_gemm
# times the GEMMs and as a decode step runs its kernels. Through the twenty-second session a replay was one pass over
# the cache copies, which at the goal shapes is one or two calls (a copy is sized on the bf16 cache). Same process,
# H100 (docs/benchmarks/attention.md, twenty-third session), one pass -> ~2 ms: the int8 decode 1.9-7.3 us faster a
# call at 16 x 2k to 256 x 8k (32 x 2k 58.1 -> 52.6 us), SDPA's by -1.1 to 5.3 us (32 x 2k 94.1 -> 91.3). Half of
# ours is the graph launch, half the next call's programs starting (PDL) while the last ones of a call finish; with
# EIGHTBIT_PDL=0, 32 x 2k 57.8 -> 54.6 us. --replay-ms 0 gives the old timing.
REPLAY_MS = 2.0


def time_graph(fns, min_ms=60.0):
    """Median ms per call of fns (a list of closures), replayed as one CUDA graph that calls them in turn, pass
    after pass, for about REPLAY_MS (at most 64 passes)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    passes = 1
    if REPLAY_MS > 0:
        one = _graph_of(fns, 1)
        per_pass = _median_ms(one.replay, 5.0, max_reps=5)
        del one
        passes = max(1, min(64, math.ceil(REPLAY_MS / max(per_pass, 1e-4))))
    g = _graph_of(fns, passes)
    ms = _median_ms(g.replay, min_ms, max_reps=40)
    del g
    return ms / (passes * len(fns))


def _graph_of(fns, passes):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(passes):
            for f in fns:
                f()
    g.replay()
    return g


def time_eager(fn, min_ms=100.0):
    fn()
    return _median_ms(fn, min_ms, max_reps=30)


def _median_ms(run, min_ms, max_reps):
    """Median CUDA-event ms of run(): one timed call sizes the repetitions to about min_ms (3..max_reps)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) * 1e3
    reps = max(3, min(max_reps, int(min_ms / max(one, 1e-3))))
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        st[i].record()
        run()
        en[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(st, en))
    return times[len(times) // 2]


def copy_bandwidth():
    """GB/s read + written: the best of a memcpy, a torch elementwise copy and a Triton copy kernel of 1 GiB
    (bench_common.measure_copy_bandwidth, what every benchmark uses)."""
    from eightbit.eval.bench_common import measure_copy_bandwidth

    return measure_copy_bandwidth()["best_gbs"]


def check_close(name, out, ref, tol=2e-2):
    """Stop the run unless `out` is within `tol` of the plain-torch reference (NaN fails): a wrong kernel is an
    error, never a timing. Returns the max abs error."""
    err = (out.float() - ref.float()).abs().max().item()
    if not err <= tol:
        raise RuntimeError(f"{name}: max abs error {err:.3g} against kernels/reference.py (> {tol}): not timed")
    return err


# --- inputs --------------------------------------------------------------------------------


def make_cache(num_blocks, d, kind, kv_heads=HKV, device="cuda"):
    from eightbit.kernels.reference import v_cache_shape

    shape = (num_blocks, PAGE, kv_heads, d)
    if kind == "int8":
        kc = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        vc = torch.randint(-127, 128, v_cache_shape(*shape, torch.int8), dtype=torch.int8, device=device)
        sshape = (num_blocks, PAGE, kv_heads, d // GROUP)
        ks = (torch.rand(sshape, device=device) * 0.02 + 0.001).half()
        vs = (torch.rand(sshape, device=device) * 0.02 + 0.001).half()
        return kc, vc, ks, vs
    kc = torch.randn(shape, dtype=torch.bfloat16, device=device)
    vc = torch.randn(shape, dtype=torch.bfloat16, device=device)
    return kc, vc, None, None


def kv_bytes_per_token(d, kind):
    if kind == "int8":
        return HKV * (2 * d + 2 * 2 * (d // GROUP))
    return HKV * 2 * d * 2


def set_config(table, key, cfg):
    from eightbit.kernels import attention_configs as C

    getattr(C, table)[key] = dict(cfg)


# --- precompile in parallel (fills Triton's disk cache) ---------------------------------------


TABLES = {"prefill": "PREFILL", "prefill_long": "PREFILL_LONG", "decode": "DECODE"}  # job kind -> config table


def _warm_job(job):
    try:
        from eightbit.kernels import attention_configs as C
        from eightbit.kernels.decode_attention import decode_attention_splits
        from eightbit.kernels.prefill_attention import prefill_attention

        what, d, kind, cfg = job
        set_config(TABLES[what], (d, kind), cfg)
        if what == "prefill_long":
            C.LONG_PREFILL_TOKENS = 1  # this worker's small warm-up prefill takes the long-prompt table
        caches = make_cache(32, d, kind)
        bt = torch.randperm(32, device="cuda", dtype=torch.int32).view(2, 16).contiguous()
        if what.startswith("prefill"):
            q = torch.randn(2 * 200, HQ, d, device="cuda", dtype=torch.bfloat16)
            cu = torch.tensor([0, 200, 400], device="cuda", dtype=torch.int32)
            sl = torch.tensor([256, 200], device="cuda", dtype=torch.int32)
            prefill_attention(q, *caches, bt, cu, sl, 0.1)
        else:
            q = torch.randn(2, HQ, d, device="cuda", dtype=torch.bfloat16)
            sl = torch.tensor([256, 100], device="cuda", dtype=torch.int32)
            decode_attention_splits(q, *caches, bt, sl, 0.1, 1)
            decode_attention_splits(q, *caches, bt, sl, 0.1, 2)
        torch.cuda.synchronize()
        return None
    except Exception:
        return traceback.format_exc()


def precompile(jobs):
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=min(12, len(jobs)), mp_context=mp.get_context("spawn")) as ex:
        errs = [e for e in ex.map(_warm_job, jobs) if e]
    for e in errs[:3]:
        print("precompile error:", e[-1500:], flush=True)
    print(f"precompiled {len(jobs)} variants in {time.perf_counter() - t0:.0f} s", flush=True)


# --- prefill -------------------------------------------------------------------------------


def prefill_case(d, seq, kinds=("bf16", "int8"), sdpa=True, total_tokens=16384):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from eightbit.kernels.prefill_attention import prefill_attention

    b = max(1, total_tokens // seq)
    flops = 2 * b * HQ * seq * seq * d  # causal: half of 4 * B * H * S^2 * D
    row = dict(d=d, seq=seq, batch=b)
    nblk = b * seq // PAGE
    bt = torch.randperm(nblk, device="cuda", dtype=torch.int32).view(b, seq // PAGE).contiguous()
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * seq
    sl = torch.full((b,), seq, device="cuda", dtype=torch.int32)
    q = torch.randn(b * seq, HQ, d, device="cuda", dtype=torch.bfloat16)
    for kind in kinds:
        caches = make_cache(nblk, d, kind)
        # before timing: the first sequence's output against the plain-torch reference (float32)
        out = prefill_attention(q, *caches, bt, cu, sl, d ** -0.5)[:seq]
        ref = R.prefill_attention(q[:seq], *caches, bt[:1], cu[:2], sl[:1], d ** -0.5)
        row[f"ours_{kind}_max_abs_err"] = check_close(f"prefill_attention {kind} d={d} seq={seq}", out, ref)
        del out, ref
        ms = time_eager(lambda: prefill_attention(q, *caches, bt, cu, sl, d ** -0.5))
        row[f"ours_{kind}_ms"] = ms
        row[f"ours_{kind}_tflops"] = flops / ms / 1e9
        del caches
    if sdpa:  # the same GQA shapes: 32 query heads over 8 kv heads
        qs = torch.randn(b, HQ, seq, d, device="cuda", dtype=torch.bfloat16)
        ks = torch.randn(b, HKV, seq, d, device="cuda", dtype=torch.bfloat16)
        vs = torch.randn_like(ks)
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                row[f"sdpa_{name}_ms"], row[f"sdpa_{name}_kv_heads"] = _time_sdpa_prefill(be, qs, ks, vs)
                row[f"sdpa_{name}_tflops"] = flops / row[f"sdpa_{name}_ms"] / 1e9
            except Exception as e:  # backend not available for this shape
                row[f"sdpa_{name}_error"] = str(e)[:200]
    torch.cuda.empty_cache()
    return row


def _time_sdpa_prefill(backend, q, k, v):
    """ms of causal SDPA on one backend with GQA (enable_gqa); a backend that refuses GQA gets K and V expanded to
    the query heads, as a caller without GQA support would pass them. Returns (ms, the kv heads it ran with)."""
    from torch.nn.attention import sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(backend):
        try:
            sdpa(q, k, v, is_causal=True, enable_gqa=True)
            return time_eager(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True)), k.shape[1]
        except RuntimeError:
            group = q.shape[1] // k.shape[1]
            ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return time_eager(lambda: sdpa(q, ke, ve, is_causal=True)), ke.shape[1]


# --- decode --------------------------------------------------------------------------------


def decode_case(batch, ctx, d=128, kinds=("int8", "bf16"), contiguous=True, sdpa=True, width=None, impls=None):
    """width: block-table columns (the engine's graphs use max_model_len / 16; default ctx / 16).
    impls: {name: decode_attention-like function} timed side by side (default {"ours": decode_attention})."""
    from eightbit.kernels.decode_attention import decode_attention, num_splits_for

    impls = impls or {"ours": decode_attention}
    nb_seq = ctx // PAGE
    per_copy_bf16 = batch * ctx * kv_bytes_per_token(d, "bf16")
    copies = rotated_copies(per_copy_bf16)
    # one block table and one seq_lens for every call, a cache per call, as a step's layers run: the int8 kernel
    # loads its first indices before its PDL wait when the call before took the same ones (decode_attention.
    # _work_order); up to the forty-third session each call had its own table into one large cache
    nblk = batch * nb_seq
    tables = {"paged": torch.randperm(nblk, device="cuda", dtype=torch.int32).view(batch, nb_seq),
              "contig": torch.arange(nblk, device="cuda", dtype=torch.int32).view(batch, nb_seq)}
    if width is not None and width > nb_seq:  # pad the tables to the engine's width (unused columns)
        pad = torch.zeros(batch, width - nb_seq, device="cuda", dtype=torch.int32)
        tables = {k: torch.cat([t, pad], 1) for k, t in tables.items()}
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, HQ, d, device="cuda", dtype=torch.bfloat16)
    row = dict(batch=batch, ctx=ctx, copies=copies, width=tables["paged"].shape[1])
    for kind in kinds:
        caches = [make_cache(nblk, d, kind) for _ in range(copies)]
        nbytes = batch * ctx * kv_bytes_per_token(d, kind) + batch * nb_seq * 4 + 2 * q.numel() * 2
        row[f"{kind}_bytes"] = nbytes
        row[f"{kind}_splits"] = num_splits_for(q, *caches[0], tables["paged"], sl)  # per kernel
        for layout in ("paged", "contig") if contiguous else ("paged",):
            table = tables[layout]
            for name, fn in impls.items():
                # before timing: the first sequences' outputs against the plain-torch reference (float32)
                few = min(batch, 2)
                out = fn(q, *caches[0], table, sl, d ** -0.5)[:few]
                ref = R.decode_attention(q[:few], *caches[0], table[:few], sl[:few], d ** -0.5)
                check_close(f"{name} decode {kind} {layout} {batch} x {ctx}", out, ref)
                del out, ref
                fns = [lambda c=c, t=table, fn=fn: fn(q, *c, t, sl, d ** -0.5) for c in caches]
                ms = time_graph(fns)
                row[f"{name}_{kind}_{layout}_ms"] = ms
                row[f"{name}_{kind}_{layout}_GBs"] = nbytes / ms / 1e6
        del caches
        torch.cuda.empty_cache()
    if sdpa:
        nbytes = batch * ctx * kv_bytes_per_token(d, "bf16") + 2 * q.numel() * 2
        ks = [torch.randn(batch, HKV, ctx, d, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        vs = [torch.randn_like(k) for k in ks]
        qs = q.view(batch, HQ, 1, d)
        try:
            fns = [lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
                   for k, v in zip(ks, vs)]
            ms = time_graph(fns)
            row["sdpa_bf16_ms"] = ms
            row["sdpa_bf16_GBs"] = nbytes / ms / 1e6
        except Exception as e:
            row["sdpa_error"] = str(e)[:200]
        del ks, vs
    torch.cuda.empty_cache()
    return row


# --- sweep ---------------------------------------------------------------------------------

# Candidates of the last sweep (earlier sweeps, same card: docs/benchmarks/attention.md). The prefill
# sweep times 4k prompts, so it tunes the long-prompt table (PREFILL_LONG); the short-prompt table came
# from same-process A/B runs at 512-2k tokens (attention.md, seventh session).
PREFILL_CANDIDATES = {
    (128, "bf16"): [dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=5), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=5),
                    dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4)],
    (128, "int8"): [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=5), dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)],
    (64, "bf16"): [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=5), dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)],
    (64, "int8"): [dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=5), dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3)],
}
DECODE_CANDIDATES = [dict(BLOCK_N=128, num_warps=4, num_stages=2), dict(BLOCK_N=128, num_warps=4, num_stages=3),
                     dict(BLOCK_N=64, num_warps=4, num_stages=2), dict(BLOCK_N=64, num_warps=4, num_stages=3),
                     dict(BLOCK_N=64, num_warps=4, num_stages=4), dict(BLOCK_N=32, num_warps=1, num_stages=3)]
DECODE_SWEEP_SHAPES = [(64, 8192), (1, 32768), (16, 2048), (256, 2048)]
# FlashDecoding split heuristic candidates (programs per SM, min keys per split, max splits), int8 cache
SPLIT_CANDIDATES = [(2, 128, 128), (4, 128, 128), (4, 256, 64), (8, 128, 128)]
SPLIT_SWEEP_SHAPES = [(1, 32768), (1, 8192), (16, 2048), (16, 8192), (32, 2048), (64, 2048), (128, 2048)]


def sweep(results, save):
    from eightbit.kernels import attention_configs as C

    jobs = [("prefill_long", d, kind, c) for (d, kind), cs in PREFILL_CANDIDATES.items() for c in cs]
    jobs += [("decode", 128, kind, c) for kind in ("bf16", "int8") for c in DECODE_CANDIDATES]
    jobs = [(w, d, "float" if k == "bf16" else k, c) for w, d, k, c in jobs]
    precompile(jobs)
    chosen = {}
    for (d, kind), cands in PREFILL_CANDIDATES.items():
        if True:
            key = (d, "float" if kind == "bf16" else kind)
            best = None
            for c in cands:
                set_config("PREFILL_LONG", key, c)
                try:
                    r = prefill_case(d, 4096, kinds=(kind,), sdpa=False)
                    tf = r[f"ours_{kind}_tflops"]
                except Exception as e:
                    tf = 0.0
                    print("sweep error", c, e, flush=True)
                results["sweep"].append(dict(kernel="prefill", d=d, kind=kind, cfg=c, tflops=tf))
                print(f"sweep prefill d{d} {kind} {c}: {tf:.0f} TFLOP/s", flush=True)
                if best is None or tf > best[0]:
                    best = (tf, c)
            set_config("PREFILL_LONG", key, best[1])
            chosen[f"prefill (long prompts) d{d} {kind}"] = best[1]
            save()
    for kind in ("int8", "bf16"):
        key = (128, "float" if kind == "bf16" else kind)
        best = None
        for c in DECODE_CANDIDATES:
            set_config("DECODE", key, c)
            logt = 0.0
            try:
                for bsz, ctx in DECODE_SWEEP_SHAPES:
                    r = decode_case(bsz, ctx, kinds=(kind,), contiguous=False, sdpa=False)
                    logt += math.log(r[f"ours_{kind}_paged_ms"])
                    results["sweep"].append(dict(kernel="decode", kind=kind, cfg=c, batch=bsz, ctx=ctx,
                                                 GBs=r[f"ours_{kind}_paged_GBs"]))
                    print(f"sweep decode {kind} {c} {bsz}x{ctx}: {r[f'ours_{kind}_paged_GBs']:.0f} GB/s", flush=True)
            except Exception as e:
                logt = float("inf")
                print("sweep error", c, e, flush=True)
            if best is None or logt < best[0]:
                best = (logt, c)
        set_config("DECODE", key, best[1])
        chosen[f"decode d128 {kind}"] = best[1]
        # d=64 decode uses the same choice
        set_config("DECODE", (64, key[1]), best[1])
        save()
    chosen["decode splits"] = sweep_splits(results)
    save()
    results["chosen"] = chosen
    print("CHOSEN", json.dumps(chosen), flush=True)
    return C


def sweep_splits(results):
    """Pick the split heuristic's constants for the int8 cache by the geometric mean time."""
    from eightbit.kernels import attention_configs as C

    best = None
    for pps, min_tok, max_splits in SPLIT_CANDIDATES:
        C.DECODE_PROGRAMS_PER_SM, C.DECODE_MIN_TOKENS_PER_SPLIT, C.DECODE_MAX_SPLITS = pps, min_tok, max_splits
        logt = 0.0
        for bsz, ctx in SPLIT_SWEEP_SHAPES:
            r = decode_case(bsz, ctx, kinds=("int8",), contiguous=False, sdpa=False)
            logt += math.log(r["ours_int8_paged_ms"])
            results["sweep"].append(dict(kernel="decode splits", cfg=[pps, min_tok, max_splits], batch=bsz, ctx=ctx,
                                         splits=r["int8_splits"], GBs=r["ours_int8_paged_GBs"]))
            print(f"sweep splits {pps}/{min_tok}/{max_splits} {bsz}x{ctx}: {r['int8_splits']} splits "
                  f"{r['ours_int8_paged_GBs']:.0f} GB/s", flush=True)
        if best is None or logt < best[0]:
            best = (logt, (pps, min_tok, max_splits))
    C.DECODE_PROGRAMS_PER_SM, C.DECODE_MIN_TOKENS_PER_SPLIT, C.DECODE_MAX_SPLITS = best[1]
    return best[1]


def main():
    global REPLAY_MS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--replay-ms", type=float, default=REPLAY_MS,
                    help="decode: CUDA-graph passes over the calls per replay, in ms (0: one pass, the timing before "
                         "the twenty-third session)")
    args = ap.parse_args()
    REPLAY_MS = args.replay_ms
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results = dict(device=props.name, sm=props.multi_processor_count, torch=torch.__version__,
                   date=time.strftime("%Y-%m-%d"), decode_replay_ms=REPLAY_MS, prefill=[], decode=[], sweep=[])
    import triton

    results["triton"] = triton.__version__
    path = os.path.join(args.out, "attention_bench.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    bw = copy_bandwidth()
    results["copy_GBs"] = bw
    print(f"device {props.name}, copy bandwidth {bw:.0f} GB/s (read+write)", flush=True)
    save()
    if args.sweep:
        sweep(results, save)
    else:
        from eightbit.kernels import attention_configs as C

        jobs = [(w, d, k, getattr(C, TABLES[w])[(d, k)]) for w in ("prefill", "prefill_long")
                for d in (64, 128) for k in ("float", "int8")]
        jobs += [("decode", 128, k, C.DECODE[(128, k)]) for k in ("float", "int8")]
        precompile(jobs)

    seqs = [512, 1024, 2048, 4096, 8192] if not args.quick else [4096]
    for d in (128, 64):
        for s in seqs:
            try:
                r = prefill_case(d, s)
            except Exception as e:
                r = dict(d=d, seq=s, error=repr(e)[:300])
            results["prefill"].append(r)
            print("prefill", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
            save()
    # the issue's batches, and 16: its decode goals start at batch 16
    batches = [1, 8, 16, 32, 64, 256] if not args.quick else [1, 32]
    ctxs = [512, 2048, 8192, 32768] if not args.quick else [2048, 32768]
    for bsz in batches:
        for ctx in ctxs:
            if bsz * ctx > (4 << 20) or (bsz * ctx > (2 << 20) and props.total_memory < (100 << 30)):
                continue
            try:
                r = decode_case(bsz, ctx)
            except Exception as e:
                r = dict(batch=bsz, ctx=ctx, error=repr(e)[:300])
                torch.cuda.empty_cache()
            if "int8_bytes" in r:
                r.update(read_ceiling_of(r["int8_bytes"]))
            results["decode"].append(r)
            print("decode", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
            save()
    save()
    print_tables(results)


def read_ceiling_of(nbytes):
    """{read_ceiling_GBs, read_ceiling_ms}: the best read-only kernel over nbytes (eval/read_ceiling.py), timed as the
    decode calls are, over enough rotated buffers to exceed L2; {read_ceiling_error} if it could not run (the decode
    numbers stand without it)."""
    from eightbit.eval.read_ceiling import read_ceiling

    try:
        c = read_ceiling(nbytes, lambda fns: time_graph(fns) * 1e3, rotated_copies(nbytes))
    except Exception as e:  # a missing ceiling column must not cost the decode row
        torch.cuda.empty_cache()
        return dict(read_ceiling_error=repr(e)[:200])
    return dict(read_ceiling_GBs=c["gbs"], read_ceiling_ms=c["us"] / 1e3)


def print_tables(res):
    bw = res["copy_GBs"]
    print(f"\n== {res['device']}  copy {bw:.0f} GB/s  ({res['date']}, torch {res['torch']}, triton {res['triton']}, "
          f"decode graph replays of ~{res.get('decode_replay_ms', 0):g} ms)")
    if res.get("chosen"):
        print("chosen configs:", json.dumps(res["chosen"]))
    print("\nprefill causal, 32q/8kv heads, TFLOP/s (SDPA kv heads: 8 = GQA, 32 = K/V expanded for a backend "
          "without it); each kernel checked against kernels/reference.py before timing")
    print(f"{'d':>4} {'seq':>5} {'B':>3} | {'ours bf16':>9} {'ours int8':>9} | {'cudnn':>6} {'flash':>6} | {'/flash':>6} {'/cudnn':>6}"
          f" | sdpa kv heads")
    for r in res["prefill"]:
        if "error" in r:
            print(r)
            continue
        ob, oi = r.get("ours_bf16_tflops", 0), r.get("ours_int8_tflops", 0)
        cd, fl = r.get("sdpa_cudnn_tflops", float("nan")), r.get("sdpa_flash_tflops", float("nan"))
        heads = f"{r.get('sdpa_cudnn_kv_heads', '-')}/{r.get('sdpa_flash_kv_heads', '-')}"
        print(f"{r['d']:>4} {r['seq']:>5} {r['batch']:>3} | {ob:9.0f} {oi:9.0f} | {cd:6.0f} {fl:6.0f} | {ob / fl:6.2f} {ob / cd:6.2f}"
              f" | {heads}")
    print("\ndecode d=128 32q/8kv, GB/s (% of copy bw); time ratios: SDPA / int8 paged (> 1: ours faster), "
          "bf16 contiguous / bf16 paged")
    print(f"{'B':>4} {'ctx':>6} {'sp i8/bf':>9} | {'int8 paged':>15} {'int8 ctg':>8} | {'bf16 paged':>15} {'bf16 ctg':>8} | "
          f"{'sdpa bf16':>15} | {'sdpa/i8 t':>9} {'ctg/pg t':>11} | {'int8 ms':>8} | {'read ceiling':>15}")
    for r in res["decode"]:
        if "error" in r:
            print(r)
            continue

        def g(k):
            return r.get(k, float("nan"))

        print(f"{r['batch']:>4} {r['ctx']:>6} {r.get('int8_splits', 0):>4}/{r.get('bf16_splits', 0):<4} | {g('ours_int8_paged_GBs'):7.0f} ({100 * g('ours_int8_paged_GBs') / bw:4.0f}%) "
              f"{g('ours_int8_contig_GBs'):8.0f} | {g('ours_bf16_paged_GBs'):7.0f} ({100 * g('ours_bf16_paged_GBs') / bw:4.0f}%) "
              f"{g('ours_bf16_contig_GBs'):8.0f} | {g('sdpa_bf16_GBs'):7.0f} ({100 * g('sdpa_bf16_GBs') / bw:4.0f}%) | "
              f"{g('sdpa_bf16_ms') / g('ours_int8_paged_ms'):9.2f} {g('ours_bf16_contig_ms') / g('ours_bf16_paged_ms'):11.2f} | "
              f"{g('ours_int8_paged_ms'):8.4f} | {g('read_ceiling_GBs'):7.0f} ({100 * g('read_ceiling_GBs') / bw:4.0f}%)")


if __name__ == "__main__":
    main()
