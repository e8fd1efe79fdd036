"""SmoothQuant calibration variants, each measured on the full WikiText-2 test set (issue 3).

For every variant: `quantize()` on the GPU with that calibration, then W8A8+KV8 (and W8A8
alone) perplexity through the engine on all windows, against the engine's bf16 in the same
process. Prints one table; writes sweep.json (with each variant's calibration summary) to --out.

    python scripts/gpu_sq_sweep.py --gguf smol.gguf --data .evaldata --out $OUT \
        --variants s128:128:default s128-coarse:128:coarse
A variant is NAME:SAMPLES:GRID[:SAMPLE_TOKENS] (GRID: default = ALPHA_GRID, 0.05..1.0 in 0.05 steps | coarse = the
earlier 0.3..0.95 grid).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from eightbit.calibrate.smoothquant import ALPHA_GRID
from eightbit.eval.configs import CONFIGS, EngineScorer, load_tokenizer
from eightbit.eval.perplexity import evaluate_perplexity, make_windows, wikitext_text
from eightbit.quant.cli import quantize

GRIDS = {"coarse": (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95), "default": ALPHA_GRID}


def ppl(config_name, windows, model=None, sq=None):
    scorer = EngineScorer(CONFIGS[config_name], model=model, device="cuda", sq_checkpoint=sq,
                          kv_cache_memory_gb=8, max_model_len=2064)
    result = evaluate_perplexity(scorer, windows, progress=False)
    scorer.close()
    torch.cuda.empty_cache()
    return result["ppl"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--windows", type=int, default=None)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    calib = Path(args.data) / "wikitext-2" / "wiki.valid.raw"

    ids = load_tokenizer(args.gguf)(wikitext_text(args.data), add_special_tokens=False).input_ids
    windows = make_windows(ids, 2048, args.windows)
    print(f"{len(windows)} windows, {len(ids):,} tokens", flush=True)
    base = ppl("bf16", windows, model=args.gguf)
    print(f"bf16 {base:.4f}", flush=True)
    rows = []
    for spec in args.variants:
        name, samples, grid, *rest = spec.split(":")
        sample_tokens = int(rest[0]) if rest else 2048
        ckpt = Path("/tmp/sq-" + name)
        t0 = time.time()
        summary = quantize(args.gguf, ckpt, calib_data=str(calib), num_samples=int(samples), overwrite=True,
                           progress=False, device="cuda", alpha_grid=GRIDS[grid], sample_tokens=sample_tokens)
        q_s = time.time() - t0
        row = {"variant": name, "samples": int(samples), "grid": grid, "sample_tokens": sample_tokens,
               "quantize_s": round(q_s, 1), "mean_error": summary["mean_error"], "summary": summary}
        for cfg in ("w8a8-sq+kv8", "w8a8-sq"):
            row[cfg] = ppl(cfg, windows, sq=ckpt)
            row[cfg + " delta%"] = 100 * (row[cfg] / base - 1)
        rows.append(row)
        print(f"{name}: quantize {q_s:.0f} s, W8A8+KV8 {row['w8a8-sq+kv8']:.4f} ({row['w8a8-sq+kv8 delta%']:+.3f}%), "
              f"W8A8 {row['w8a8-sq']:.4f} ({row['w8a8-sq delta%']:+.3f}%)", flush=True)
        (out / "sweep.json").write_text(json.dumps({"bf16": base, "windows": len(windows), "rows": rows}, indent=1))

    print(f"\n{torch.cuda.get_device_name()}, {len(windows)} windows, bf16 ppl {base:.4f}")
    print("| variant | samples | grid | sample tokens | W8A8+KV8 ppl | Δ% | W8A8 ppl | Δ% | mean error qkv/gate_up/o/down |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        e = r["mean_error"]
        print(f"| {r['variant']} | {r['samples']} | {r['grid']} | {r['sample_tokens']} | {r['w8a8-sq+kv8']:.4f} | "
              f"{r['w8a8-sq+kv8 delta%']:+.3f} | {r['w8a8-sq']:.4f} | {r['w8a8-sq delta%']:+.3f} | "
              + "/".join(f"{e[p]:.2e}" for p in ("qkv", "gate_up", "o", "down")) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
