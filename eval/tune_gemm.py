"""Tune int8_gemm's launch configurations on the GPU and write the committed table.

    python eval/tune_gemm.py [--out kernels/gemm_configs.json] [--budget-s 240] [--workers 16]
                             [--buckets 1,2,4,8,16] [--log tune_log.json]

With --buckets only those M buckets are tuned; the other entries of the existing table are kept. A tuned
bucket keeps its committed entry unless the best candidate beats it by --min-gain (2 %) in the same run.

With --behind-quant --buckets B,... every candidate is timed behind a producer, as the engine launches it:
quant_per_token + the GEMM, with PDL in the chain (a GEMM's time depends on how it starts behind the kernel that
produces its input; the committed buckets 128-256 were tuned this way). An entry keeps its config's measured PDL
mark where the config stays; any other is marked "pdl": true, as it was timed, and the entry says "timed":
"behind_quant" (its times include the quantization). Run --pdl on the same buckets afterwards to measure the
marks. Check its picks in the engine before committing them (eval/ab_gemm_table.py): at buckets 1-4 the entries
it picked, each faster here, made the 8B engine 1-3 % slower on an H100 and an H200 (docs/benchmarks/engine.md,
runs 50 and 54), and timing them behind the engine's own producers (rmsnorm_quant, silu_mul_quant) instead of
quant_per_token ranks them no differently (gemm.md, thirty-sixth session), nor, for o, behind the decode attention
as the engine launches it; timed inside a whole decode layer they lose as in the engine (thirty-seventh session).

With --in-layer --buckets B,... every candidate is timed where the engine runs it: inside a stack of decode
layers made of eightbit's kernels (eval/decode_layers.py: norm, qkv, decode attention, quantization, o, norm,
gate_up, SiLU, down, the PDL chain on), the candidate in its GEMM's place and the table's configs (this card's own
entries first) in the others; times are microseconds per layer and the entry says "timed": "in_layer", so
--min-gain is a fraction of a layer's time (0.01 is ~2-3x the spread of repeated timings of one layer on an H200).
Buckets up to MAX_IN_LAYER_M (the engine's default max_num_seqs: larger M are prefill, not decode steps). A
candidate without a PDL mark is launched by int8_gemm's rule, as the engine would launch it. On an H200 this
ranked the 8B o configs at M = 1 and 4 as the engine did where every other timing here did not (gemm.md,
thirty-seventh session); still check the picks in the engine.

With --pdl the configs stay and each entry of the buckets gets its launch measured instead: quant_per_token +
the GEMM, as CUDA-graph replays, with and without programmatic dependent launch (kernels/pdl.py; two timings
each, alternating). The entry is marked "pdl": true or false; the launch int8_gemm would use without the mark
(PDL for the Triton kernels up to int8_gemm.PDL_MAX_M rows, else none) stays unless the other is --min-gain faster.

For every target (N, K) (Llama-3-8B and Llama-3.2-1B linear shapes) and every
M bucket of gemm_configs.M_BUCKETS, each candidate configuration is
1. compiled ahead in a pool of worker processes (one compile per config and
   specialization; they fill Triton's on-disk cache, so the timing process only loads),
2. checked: with scales of 1 the result must equal the exact int32 product (torch,
   float64) bit for bit, as an fp32 output and rounded to a bf16 one (the kernels may
   store the two differently),
3. timed as CUDA-graph replays over rotated weight copies (eval/bench_gemm.time_graph), without the PDL
   chain (kernels/pdl.py): GEMM after GEMM, which the engine never runs, must not overlap through it
   (--behind-quant: behind quant_per_token, in the chain; --in-layer: inside eval/decode_layers.py's stack, per
   layer).
The fastest correct candidate is written with its time and the default's time.
Shapes not finished inside the budget, or with no correct candidate, keep their committed entry (else the
default, gemm_configs.default_config).
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

MAX_IN_LAYER_M = 256  # --in-layer: engine.config.EngineConfig.max_num_seqs's default, the largest decode batch

TARGETS = [  # (N, K), the 8B shapes first
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
]


GEMV_TILES = {  # M bucket -> (block_n, block_k, num_warps): <= ~64 accumulator words per thread
    1: ((16, 1024, 4), (32, 512, 4), (8, 1024, 4), (16, 2048, 8), (32, 1024, 8), (16, 512, 4), (64, 512, 8),
        (16, 2048, 4)),
    2: ((16, 512, 4), (16, 1024, 4), (8, 1024, 4), (32, 512, 8), (16, 1024, 8), (32, 256, 4)),
    4: ((16, 256, 4), (16, 512, 4), (8, 512, 4), (32, 256, 4), (16, 512, 8), (8, 1024, 8)),
    8: ((8, 256, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8), (8, 512, 8)),
}


def ws_candidates():
    """The warp-specialized Gluon kernel (sm_90; int8_gemm_hopper.py): two 64-row consumer warp groups
    (block_m 128, num_warps 4) under 172-213 KB of shared memory for the ring and the output tile. All of
    them are also tried at 64 < M <= 256: there a 128 x 64 tile reads twice its weight bytes of
    activations from L2 per K step, and wider tiles halve that traffic (gate_up at M = 256)."""
    from eightbit.kernels.gemm_configs import GemmConfig as C

    return [C(128, 256, 64, 8, 1, 4, 6, "ws"), C(128, 256, 64, 16, 1, 4, 6, "ws"), C(128, 256, 128, 8, 1, 4, 3, "ws"),
            C(128, 128, 128, 8, 1, 4, 4, "ws"), C(128, 128, 64, 8, 1, 4, 8, "ws"),
            # 192 = 128 + 64 wide: 8B qkv at M = 1024 is 8 x 32 of these (1.94 waves of 132 SMs) against 8 x 24
            # of 256-wide tiles (1.45 waves, so two tile times) or 8 x 48 of 128-wide ones (a slower tile)
            C(128, 192, 64, 8, 1, 4, 6, "ws"), C(128, 192, 64, 8, 1, 4, 7, "ws"), C(128, 192, 128, 8, 1, 4, 4, "ws")]


def ws_narrow_candidates():
    """The Gluon kernel with 128 x 64 tiles, for M <= 256: twice the tiles of 128 x 128 (N = 4096 gives 64
    of those, half the SMs of an H100)."""
    from eightbit.kernels.gemm_configs import GemmConfig as C

    return [C(128, 64, 128, 8, 1, 4, 8, "ws"), C(128, 64, 256, 8, 1, 4, 4, "ws"), C(128, 64, 64, 8, 1, 4, 12, "ws")]


def ws_mid_candidates():
    """96 = 64 + 32 and 160 = 128 + 32 wide tiles, for 256 < M <= 1536. Llama-3.2-1B qkv (N = 3072) at M = 512 is
    4 x 32 of the 96-wide ones, one wave of 132 SMs, against 96 tiles 128 wide (a quarter of the SMs idle) or 192
    tiles 64 wide (two waves). 1B o (N = 2048) at M = 1049 is 9 x 13 of the 160-wide ones (0.89 waves) against
    9 x 11 192-wide (0.75) or 9 x 16 128-wide (1.09): 14.60 -> 14.21 us with the quantization, and 1B qkv at
    M = 658 14.55 -> 13.67 us (H100, gemm.md, thirty-first session)."""
    from eightbit.kernels.gemm_configs import GemmConfig as C

    return [C(128, 96, 128, 8, 1, 4, 6, "ws"), C(128, 96, 64, 8, 1, 4, 12, "ws"), C(128, 160, 128, 8, 1, 4, 5, "ws")]


# The small-M Gluon kernel (int8_gemm_swap.py), (block_n, block_k, num_stages, split_k): the configs that came
# first or second on some 8B or 1B shape at M = 1-16 in a sweep of 445 (H200, gemm.md, fortieth session), and the
# deep rings of one K range (8-12 slots: fewer programs, each with more weight tiles copied before its PDL wait) that
# won inside decode layers and in the 8B engine (forty-first session); rings past the shared memory drop out
SWAP_TILES = ((64, 256, 3, 1), (64, 256, 6, 1), (128, 256, 6, 1), (64, 256, 8, 2), (64, 256, 6, 2), (64, 256, 3, 4),
              (64, 256, 4, 4), (64, 256, 6, 4), (64, 256, 2, 4), (64, 256, 4, 6), (64, 256, 6, 6), (64, 256, 6, 8),
              (128, 256, 4, 8), (128, 256, 3, 6), (64, 128, 8, 6), (128, 128, 8, 1),
              (64, 256, 8, 1), (64, 256, 10, 1), (64, 256, 11, 1), (64, 256, 12, 1))


def swap_candidates(m):
    """"swap" configs for an M bucket: the activation tile the smallest of 8-64 rows that holds it."""
    from eightbit.kernels.gemm_configs import GemmConfig as C

    from eightbit.kernels.int8_gemm_swap import config_ok

    mp = max(8, 1 << (m - 1).bit_length())
    cands = [C(mp, bn, bk, 1, sk, 4, st, "swap") for bn, bk, st, sk in SWAP_TILES] if mp <= 64 else []
    return [c for c in cands if config_ok(c)]  # at 32-64 rows some rings outgrow the shared memory


def candidates(m):
    from eightbit.kernels.gemm_configs import GemmConfig as C

    if m <= 64:
        bm = max(16, m)
        out = []
        for bn, bk, st in ((32, 256, 4), (64, 256, 4), (128, 256, 3), (64, 128, 6), (32, 512, 3), (64, 512, 3),
                           (32, 256, 8), (64, 256, 6)):
            for sk in (1, 2, 4, 8):
                out.append(C(bm, bn, bk, 1, sk, 4, st))
        # 16 columns on one or two warps: more programs per SM, each with its own loads in flight; at M = 8-16
        # they beat the committed entries on the 8B qkv / o and 1B qkv / o shapes by 3-8 %, 8B down by 1.5 %
        # (H100, gemm.md, fifteenth session)
        for bk, st, w in ((256, 6, 1), (256, 8, 1), (512, 4, 2), (512, 6, 2), (512, 3, 1), (512, 4, 1), (512, 3, 2)):
            for sk in (1, 2):
                out.append(C(bm, 16, bk, 1, sk, w, st))
        # 512-wide K steps on one or two warps (above) and 32 columns on two warps: on an H200 they beat the table at
        # 8B qkv / o with M = 8 (16 x 32 x 512, 2 warps: 61-63 -> 73 % and 51 -> 59 % of the copy bandwidth) and by
        # 1-3 points at 8B qkv / down and 1B qkv with M = 16 (gemm.md, thirty-fifth session; unmeasured on an H100)
        out.append(C(bm, 32, 512, 1, 1, 2, 3))
        out += swap_candidates(m)
        gb = m if m in GEMV_TILES else (8 if m <= 16 else None)
        if gb is not None:
            for bn, bk, w in GEMV_TILES[gb]:
                for sk in (1, 2, 4, 8):
                    out.append(C(gb, bn, bk, 1, sk, w, 1, "gemv"))
        return out
    small = [C(64, 64, 128, 8, 1, 4, 4), C(64, 128, 128, 8, 1, 4, 4), C(64, 128, 128, 8, 2, 4, 4),
                C(128, 128, 128, 8, 1, 8, 4), C(128, 64, 128, 8, 1, 4, 4), C(64, 256, 128, 8, 1, 8, 3),
                C(128, 128, 128, 8, 2, 8, 4), C(64, 64, 256, 8, 2, 4, 4), C(128, 256, 128, 8, 1, 8, 3),
                C(64, 32, 256, 8, 1, 4, 4), C(64, 32, 256, 8, 2, 4, 4), C(64, 64, 256, 8, 4, 4, 4),
                C(128, 64, 128, 8, 2, 4, 4), C(128, 32, 256, 8, 1, 4, 4), C(128, 32, 256, 8, 2, 4, 4),
                C(64, 64, 128, 8, 2, 4, 5), C(64, 64, 128, 8, 4, 4, 5),
                # behind quant_per_token (--behind-quant) 64 x 64 x 256 beat the committed 64 x 32 tiles on 1B o at
                # M = 192-256 by 10-11 %, and 5 stages of 64 x 32 at M = 128 (H100, gemm.md, twentieth session)
                C(64, 64, 256, 8, 1, 4, 4), C(64, 64, 256, 8, 1, 4, 3), C(64, 32, 256, 8, 1, 4, 5),
                # won gate_up at M 128 and 256 (seventh session); 256-row tiles (one M tile for the whole
                # batch) lost every shape at M = 256 by 8-76 %: there these GEMMs are bound by the MMA
                # pipeline, not by reading the weights (docs/benchmarks/gemm.md)
                C(128, 128, 128, 8, 1, 8, 3)] + ws_candidates() + ws_narrow_candidates()
    large = ws_candidates() + [C(128, 128, 128, 8, 1, 8, 4), C(128, 256, 128, 8, 1, 8, 3), C(256, 128, 128, 8, 1, 8, 3),
                               C(128, 256, 64, 8, 1, 8, 4), C(128, 128, 64, 8, 1, 4, 5), C(128, 128, 128, 8, 1, 4, 4),
                               C(64, 256, 128, 8, 1, 4, 4), C(256, 128, 64, 8, 1, 8, 4), C(128, 256, 128, 16, 1, 8, 3)]
    if m <= 256:
        return small
    if m <= 1024:  # a few 128-row tiles: the small shapes' waves may want 64-row or narrow ones
        return small + ws_mid_candidates() + [c for c in large if c not in small]
    if m <= 1536:
        return large + ws_mid_candidates()
    return large


def previous_entry(table, mb, n, k):
    """The config a table {(m_bucket, n, k): config} runs at M = mb: its own entry, else, for a bucket it lacks (a
    bucket added since), the next bucket up's, which served these M until now; None if it holds neither."""
    above = sorted(b for (b, bn, bk) in table if (bn, bk) == (n, k) and b >= mb)
    return table[(above[0], n, k)] if above else None


def choose_pdl(off_us, on_us, default, min_gain=0.02):
    """PDL or not for a table entry, from its times without and with it: as with configs, the launch it would get
    without a mark (default) stays unless the other is min_gain faster."""
    if default:
        return not off_us < (1 - min_gain) * on_us
    return on_us < (1 - min_gain) * off_us


def choose(timings, committed=None, min_gain=0.02):
    """The fastest of {config: us}; but the committed entry (if timed) stays unless the fastest beats it by
    min_gain, so that a re-tune replaces entries for clear gains, not for the run's noise."""
    best = min(timings, key=timings.get)
    if committed in timings and timings[best] > (1 - min_gain) * timings[committed]:
        return committed
    return best


def _inputs(m, n, k, device="cuda"):
    g = torch.Generator(device=device).manual_seed(m * 7 + n + k)
    xq = torch.randint(-128, 128, (m, k), device=device, dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (n, k), device=device, dtype=torch.int8, generator=g)
    return xq, wq


def _warm(jobs, chain):
    """Worker: compile (launch once) each (m, n, k, cfg), with the PDL chain on or off as the timing process will
    launch it; returns the failures."""
    from eightbit.kernels import pdl
    from eightbit.kernels.int8_gemm import int8_gemm_with_config
    from eightbit.kernels.launch import is_sm90

    pdl.CHAIN = chain
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
    ap.add_argument("--buckets", default="", help="comma-separated M buckets to tune (default: all)")
    ap.add_argument("--log", help="write every candidate's time here (JSON)")
    ap.add_argument("--min-gain", type=float, default=0.02,
                    help="keep a committed entry unless the best candidate beats it by this fraction in the same run")
    ap.add_argument("--kernels", default="",
                    help="comma-separated kernels whose candidates to time (dot, gemv, ws, swap; default: all); the "
                         "committed entry and the default are timed as well, whatever their kernel")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--pdl", action="store_true", help="measure each entry's launch with and without PDL instead")
    mode.add_argument("--behind-quant", action="store_true",
                      help="time each candidate behind quant_per_token in the PDL chain (check the picks in the engine)")
    mode.add_argument("--in-layer", action="store_true",
                      help="time each candidate inside a stack of decode layers (eval/decode_layers.py), per layer; "
                           f"needs --buckets (up to {MAX_IN_LAYER_M}); --min-gain is then of a layer's time; check "
                           "the picks in the engine (eval/ab_gemm_table.py)")
    mode.add_argument("--device-overrides", metavar="TABLE",
                      help="no tuning: file TABLE's entries (a table tune_gemm wrote on another card) that differ from "
                           "the committed table, in --buckets if given, become that card's own entries in "
                           "kernels/gemm_configs_by_device.json (check them in the engine first)")
    args = ap.parse_args(argv)
    if args.device_overrides:
        from eightbit.kernels import gemm_configs as gc

        if not args.buckets:
            ap.error("--device-overrides needs --buckets: the buckets whose entries were checked in the engine")
        buckets = {int(b) for b in args.buckets.split(",") if b}
        return write_device_entries(args.device_overrides, gc.TABLE_PATH, gc.BY_DEVICE_PATH, buckets)
    from eightbit.kernels.gemm_configs import KERNELS

    unknown = {kind for kind in args.kernels.split(",") if kind} - set(KERNELS)
    if unknown:
        ap.error(f"--kernels: unknown {', '.join(sorted(unknown))} (kernels: {', '.join(KERNELS)})")
    if args.behind_quant and not args.buckets:
        ap.error("--behind-quant needs --buckets (the committed table's buckets 128-256 were tuned that way)")
    if args.in_layer and not args.buckets:
        ap.error("--in-layer needs --buckets: it times decode layers at batch = each bucket")
    if args.in_layer and max(int(b) for b in args.buckets.split(",") if b) > MAX_IN_LAYER_M:
        ap.error(f"--in-layer times decode steps, of at most {MAX_IN_LAYER_M} sequences (max_num_seqs): larger M "
                 "buckets are prefill GEMMs; tune those without --in-layer")
    if not torch.cuda.is_available():
        raise SystemExit("tune_gemm times the int8 GEMM kernels on a CUDA GPU, and this machine has none")
    if args.pdl:
        return tune_pdl(args)
    t0 = time.time()

    from eightbit.eval.bench_gemm import n_copies, time_graph
    from eightbit.kernels import gemm_configs as gc
    from eightbit.kernels import pdl
    from eightbit.kernels.int8_gemm import int8_gemm_with_config

    in_chain = args.behind_quant or args.in_layer
    if in_chain and not pdl.chain_enabled(torch.device("cuda")):
        raise SystemExit(f"--{'behind-quant' if args.behind_quant else 'in-layer'} times the chain's launches: it "
                         "needs an sm_90 GPU with EIGHTBIT_PDL and EIGHTBIT_PDL_CHAIN not 0")
    # configs are timed GEMM after GEMM, which the engine never runs (a producer always sits between two GEMMs):
    # without the chain, so that one GEMM's late trigger does not overlap the next; the PDL marks are --pdl's job.
    # --behind-quant and --in-layer time them behind a producer instead, launched as the chain launches them.
    if not in_chain:
        pdl.CHAIN = False

    def timed(cfg):  # the launch a candidate is checked and timed with
        return dataclasses.replace(cfg, pdl=True) if args.behind_quant else cfg

    buckets = [int(b) for b in args.buckets.split(",") if b] or list(gc.M_BUCKETS)
    # the table being replaced (--out, else the one the package reads): its entries are timed again as a baseline
    # and the buckets not tuned now are kept (a non-editable install may not carry the package's json)
    old_entries, note = _load_entries(args.out)
    old = {gc.entry_key(e): e for e in old_entries}
    prev_table = {key: gc.GemmConfig(**e["config"]) for key, e in old.items()}
    # the baseline is what this card runs now: its own entries (gemm_configs_by_device.json) where it has them
    prev_table.update(gc.device_entries(gc.device_name_of(torch.device("cuda"))))

    def prev_of(mb, n, k):
        return previous_entry(prev_table, mb, n, k) or gc.dot_config(mb, n, k)

    kernels = {kind for kind in args.kernels.split(",") if kind}
    if not is_sm90(torch.device("cuda")):  # the Gluon kernels' entries would time the dot kernel they fall back to
        kernels = (kernels or set(gc.KERNELS)) - {"ws", "swap"}

    def cands_for(mb, n, k):
        out = [c for c in candidates(mb) if not kernels or c.kernel in kernels]
        for extra in (gc.default_config(mb, n, k), prev_of(mb, n, k)):
            if extra is not None and extra not in out:
                out.append(extra)
        return out

    jobs = [(mb, n, k, cfg) for (n, k) in TARGETS for mb in buckets for cfg in cands_for(mb, n, k)]
    # one compile per distinct (config, specialization): M=mb is always a multiple of 16 here
    seen, uniq = set(), []
    for m, n, k, cfg in jobs:
        key = (cfg, m == 1, k % cfg.block_k == 0)
        if key not in seen:
            seen.add(key)
            uniq.append((m, n, k, timed(cfg)))
    uniq.sort(key=lambda j: j[0] * j[1])  # cheap launches first
    ctx = torch.multiprocessing.get_context("spawn")
    bad = set()
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        chunks = [uniq[i :: args.workers] for i in range(args.workers)]
        for failed in pool.map(_warm, chunks, [pdl.CHAIN] * len(chunks)):
            for m, n, k, cfg, why in failed:
                print(f"compile/launch failed: {cfg} at M={m}: {why}", file=sys.stderr)
                bad.add(cfg)
    print(f"warmed {len(uniq)} kernels in {time.time() - t0:.0f}s ({len(bad)} failed)", flush=True)

    entries, log = [], []
    mode = "in_layer" if args.in_layer else "behind_quant" if args.behind_quant else "gemm"  # how times were taken

    def carry_over(mb, n, k):
        """A bucket that was not re-timed keeps its committed entry (with its recorded times), if it has one."""
        if (mb, n, k) in old:
            entries.append(old[(mb, n, k)])

    for n, k in TARGETS:
        for mb in buckets:
            if time.time() - t0 > args.budget_s:
                print(f"budget spent: N={n} K={k} M<={mb} keeps " + ("its committed entry" if (mb, n, k) in old
                      else "the default"), flush=True)
                carry_over(mb, n, k)
                continue
            m = mb
            xq, wq0 = _inputs(m, n, k)
            ones_m, ones_n = torch.ones(m, 1, device="cuda"), torch.ones(n, 1, device="cuda")
            exact = (xq.double() @ wq0.double().t()).float()
            nc = 1 if args.in_layer else n_copies(n * k)  # a layer stack holds its own weights
            if args.in_layer:
                model, time_in_layer = in_layer_timer(n, k, m)
            wqs = [wq0] + [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(nc - 1)]
            xs = torch.rand(m, 1, device="cuda") * 0.01
            x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) if args.behind_quant else None
            wss = [torch.rand(n, 1, device="cuda") * 0.01 for _ in range(nc)]
            default = gc.default_config(m, n, k)
            prev = prev_of(mb, n, k)
            cands = [c for c in cands_for(mb, n, k) if c not in bad]
            timings = {}
            for cfg in cands:
                try:
                    tc = timed(prev if cfg == prev else cfg)  # the entry in use with its PDL mark
                    out = int8_gemm_with_config(xq, ones_m, wq0, ones_n, None, torch.float32, tc)
                    out16 = int8_gemm_with_config(xq, ones_m, wq0, ones_n, None, torch.bfloat16, tc)
                    if not (torch.equal(out, exact) and torch.equal(out16, exact.to(torch.bfloat16))):
                        print(f"WRONG RESULT: {cfg} at M={m} N={n} K={k}", flush=True)
                        continue
                    if args.in_layer:
                        timings[cfg] = time_in_layer(tc)
                        continue
                    if args.behind_quant:
                        calls = _behind_quant(x16, wqs, wss, tc)
                    else:
                        calls = [lambda i=i, c=tc: int8_gemm_with_config(xq, xs, wqs[i], wss[i], None,
                                                                         torch.bfloat16, c) for i in range(nc)]
                    timings[cfg] = time_graph(calls, target_ms=1.0, replays=3)
                except Exception as e:  # noqa: BLE001
                    print(f"failed: {cfg} at M={m} N={n} K={k}: {repr(e)[:150]}", flush=True)
            log += [dict(m_bucket=mb, n=n, k=k, config=c.to_dict(), us=round(t, 3), timed=mode)
                    for c, t in timings.items()]
            time_in_layer = None  # frees the layer stack
            if not timings:
                carry_over(mb, n, k)
                continue
            best = choose(timings, prev if (mb, n, k) in prev_table else None, args.min_gain)
            config = best.to_dict()
            if prev.pdl is not None and best == prev:
                config["pdl"] = prev.pdl  # the same config keeps its measured launch
            elif args.behind_quant:
                config["pdl"] = True  # as it was timed
                print(f"N={n} K={k} M<={mb}: marked pdl: true, as timed (no measured mark for this config): "
                      "re-run --pdl", flush=True)
            elif prev.pdl is not None:
                print(f"N={n} K={k} M<={mb}: a new config, its PDL mark dropped: re-run --pdl", flush=True)
            entry = dict(m_bucket=mb, n=n, k=k, config=config, us=round(timings[best], 2),
                         default_us=round(timings.get(default, float("nan")), 2),
                         prev_us=round(timings.get(prev, float("nan")), 2), prev_config=prev.to_dict())
            if mode != "gemm":  # behind_quant: times include quant_per_token; in_layer: microseconds per decode layer
                entry["timed"] = mode
            entries.append(entry)
            what = ("quant + GEMM" if args.behind_quant else f"a {model} decode layer" if args.in_layer
                    else f"{n * k / timings[best] / 1e3:6.0f} GB/s")
            t_default, t_prev = timings.get(default, float("nan")), timings.get(prev, float("nan"))
            print(f"N={n:6d} K={k:6d} M<={mb:5d}: {timings[best]:8.1f}us (default {t_default:8.1f}us,"
                  f" before {t_prev:8.1f}us, {what})  {best.key()}", flush=True)
            del wqs, wss, exact, x16
            torch.cuda.empty_cache()
    kept = [e for (mb, n, k), e in old.items() if mb not in buckets]  # with their recorded times
    if args.log:
        with open(args.log, "w") as f:
            json.dump(log, f)
    _write_table(args.out, kept + entries, t0, note)


def in_layer_timer(n, k, m):
    """(model, config -> us per layer): --in-layer's timing of the (N, K) GEMM at M = m, in its place in a stack of
    decode layers of the model it belongs to (eval/decode_layers.py), the table's configs in the others."""
    from eightbit.eval.decode_layers import DecodeLayers, role_of

    model, role = role_of(n, k)
    stack = DecodeLayers(model, m)
    return model, lambda cfg: stack.time_us({role: cfg})


def _behind_quant(x16, wqs, wss, cfg):
    """quant_per_token of x16, then the GEMM with each rotated weight copy, as the engine pairs them: the calls
    to time."""
    from eightbit.kernels.int8_gemm import int8_gemm_with_config
    from eightbit.kernels.quant_per_token import quant_per_token

    return [lambda i=i: int8_gemm_with_config(*quant_per_token(x16), wqs[i], wss[i], config=cfg)
            for i in range(len(wqs))]


def _write_table(path, entries, t0, note=None):
    entries = sorted(entries, key=lambda e: (TARGETS.index((e["n"], e["k"])) if (e["n"], e["k"]) in TARGETS else 99,
                                             e["m_bucket"]))
    table = dict(
        device=torch.cuda.get_device_name(), triton=__import__("triton").__version__, torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"), note=note or "written by eval/tune_gemm.py; key = (m_bucket, n, k)",
        configs=entries,
    )
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    print(f"wrote {len(entries)} entries to {path} in {time.time() - t0:.0f}s")


def _launch_of(entry):
    """What an entry launches: its config's key and PDL (a missing mark: int8_gemm's rule)."""
    from eightbit.kernels.gemm_configs import GemmConfig
    from eightbit.kernels.int8_gemm import pdl_by_rule

    cfg = GemmConfig(**entry["config"])
    return cfg.key(), cfg.pdl if cfg.pdl is not None else pdl_by_rule(entry["m_bucket"], cfg)


def write_device_entries(table_path, base_path, out_path, buckets):
    """The entries of the table at table_path (its "device" names the card) in `buckets` that launch differently
    from the committed table at base_path become that card's entries in the per-device file at out_path; its earlier
    entries in those buckets go, those in other buckets and other cards' stay (a card left with none is dropped).
    Each filed entry records its source table and that table's date; one the card already had, unchanged, keeps its
    earlier record."""
    from eightbit.kernels import gemm_configs as gc

    with open(table_path) as f:
        table = json.load(f)
    with open(base_path) as f:
        base_table = json.load(f)
    base = {gc.entry_key(e): e for e in base_table["configs"]}
    device = table.get("device")
    if not device:
        raise SystemExit(f"{table_path} names no device: write it with tune_gemm on the card it is for")
    if device == base_table.get("device"):
        raise SystemExit(f"the committed table was tuned on {device} itself: change the table, not its overrides")
    data = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            data = json.load(f)

    earlier = data.get(device, {})
    # entries filed before entries named their source keep the one their card's header named
    before = {gc.entry_key(e): e if "source" in e else {**e, "source": earlier.get("source"), "date": earlier.get("date")}
              for e in earlier.get("configs", [])}
    mine = {key: e for key, e in before.items() if e["m_bucket"] not in buckets}
    for e in table["configs"]:
        key = gc.entry_key(e)
        if e["m_bucket"] in buckets and (key not in base or _launch_of(e) != _launch_of(base[key])):
            if key in before and _launch_of(before[key]) == _launch_of(e):
                mine[key] = before[key]  # filed again unchanged: it keeps the record of the run that chose it
            else:
                mine[key] = dict(e, source=os.path.basename(table_path), date=table.get("date"))
    if mine:  # each entry names the table it came from; the card's entries may come from several filings
        data[device] = dict(triton=table.get("triton"), torch=table.get("torch"),
                            configs=sorted(mine.values(), key=gc.entry_key))
    else:
        data.pop(device, None)
    with open(out_path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"{device}: {len(mine)} entries of its own in {out_path}")
    return 0


def _load_entries(path):
    """(entries, note) of the table at path, else of the one the package reads; ([], None) if neither exists."""
    from eightbit.kernels import gemm_configs as gc

    for p in (path, gc.table_path()):
        if os.path.exists(p):
            with open(p) as f:
                data = json.load(f)
            return data.get("configs", []), data.get("note")
    return [], None


def tune_pdl(args):
    """--pdl: every entry of the buckets timed behind quant_per_token with and without PDL; sets its "pdl"."""
    from eightbit.eval.bench_gemm import n_copies, time_graph
    from eightbit.kernels import gemm_configs as gc
    from eightbit.kernels.int8_gemm import PDL_MAX_M, int8_gemm_with_config
    from eightbit.kernels.pdl import chain_enabled
    from eightbit.kernels.quant_per_token import quant_per_token

    if not chain_enabled(torch.device("cuda")):
        raise SystemExit("--pdl needs the PDL chain (an sm_90 GPU, EIGHTBIT_PDL and EIGHTBIT_PDL_CHAIN not 0): "
                         "without it both launches are the same and the marks would be noise")
    t0 = time.time()
    entries, note = _load_entries(args.out)
    if not entries:
        raise SystemExit(f"no table at {args.out} or in the package: --pdl measures an existing table's entries")
    buckets = {int(b) for b in args.buckets.split(",") if b} or set(gc.M_BUCKETS)
    log = []
    for e in entries:
        if e["m_bucket"] not in buckets:
            continue
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: N={e['n']} K={e['k']} M<={e['m_bucket']} not measured, keeps "
                  f"{'its mark' if 'pdl' in e['config'] else 'no mark'}", flush=True)
            continue
        m, n, k = e["m_bucket"], e["n"], e["k"]
        cfg = gc.GemmConfig(**e["config"])
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nc = n_copies(n * k)
        wqs = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(nc)]
        wss = [torch.rand(n, 1, device="cuda") * 0.01 for _ in range(nc)]
        variants = {flag: dataclasses.replace(cfg, pdl=flag) for flag in (False, True)}
        outs = [int8_gemm_with_config(*quant_per_token(x), wqs[0], wss[0], config=c) for c in variants.values()]
        if not torch.equal(outs[0], outs[1]):
            raise SystemExit(f"PDL changed the result: M={m} N={n} K={k} {cfg}")
        times = {False: [], True: []}
        for order in ((False, True), (True, False)):
            for flag in order:
                times[flag].append(time_graph(
                    _behind_quant(x, wqs, wss, variants[flag]), target_ms=2.0, replays=3))
        off, on = (sum(times[f]) / 2 for f in (False, True))
        e["config"]["pdl"] = choose_pdl(off, on, cfg.kernel != "ws" and m <= PDL_MAX_M, args.min_gain)
        log.append(dict(m_bucket=m, n=n, k=k, off_us=times[False], on_us=times[True], pdl=e["config"]["pdl"]))
        print(f"N={n:6d} K={k:6d} M<={m:5d} {cfg.kernel:4s}: quant + GEMM {off:8.2f} us, with PDL {on:8.2f} us"
              f" -> pdl {e['config']['pdl']}", flush=True)
        del wqs, wss
        torch.cuda.empty_cache()
    if args.log:
        with open(args.log, "w") as f:
            json.dump(log, f)
    _write_table(args.out, entries, t0, note)


if __name__ == "__main__":
    main()
