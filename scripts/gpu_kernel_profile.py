"""Where a decode step's GPU time goes: torch.profiler kernel tables of decode-only steps on a dummy model.

python scripts/gpu_kernel_profile.py [model] [int8|bf16|both] [--batch B] [--prompt L] [--steps N]

Adds B requests of L-token prompts, steps the engine until every sequence is past its prefill,
times N decode steps (wall), profiles N more (CUDA-graph replays) and prints, per system, the kernel
time per step grouped by what the kernel does (int8 / bf16 GEMM, attention, norms, ...), the wall
time per step (kernel time well below it: the host is the limit) and the top kernels.
"""

import argparse
import gc
import time

import torch
from torch.profiler import ProfilerActivity, profile

from eightbit import LLM, SamplingParams
from eightbit.eval.bench_common import kernel_times

GROUPS = [  # (group, substrings of the kernel name), first match wins
    ("int8 GEMM", ("_int8_gemm",)),
    ("attention", ("_decode_kernel", "_decode_reduce", "_prefill_kernel")),
    ("rope + kv write", ("_rope_kv_write",)),
    ("norm / silu / quant", ("_rmsnorm", "_silu_mul", "_quant_per_token")),
    ("bf16 GEMM (cuBLAS)", ("gemm", "nvjet", "cutlass", "xmma", "sm90")),
]
SYSTEMS = {"bf16": {}, "int8": dict(quantization="w8a8", kv_cache_dtype="int8")}


def group_of(name):
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), "other")


def profile_system(model, opts, batch, prompt_len, steps):
    llm = LLM(model, load_format="dummy", gpu_memory_utilization=0.85, **opts)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * j + 13 * i) % 1000 + 10 for j in range(prompt_len)], params)
    seqs = [r.seqs[0] for r in engine.requests.values()]
    while any(len(s.output_token_ids) < 4 for s in seqs):  # every prefill (chunked) done, a few decode steps
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):  # unprofiled: the wall time per step
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1000 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = kernel_times(prof.events())
    for request_id in list(engine.requests):
        engine.abort(request_id)
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return kernels, wall_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="llama-3-8b")
    ap.add_argument("systems", nargs="?", default="both", choices=["int8", "bf16", "both"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    names = ["int8", "bf16"] if args.systems == "both" else [args.systems]
    summary = {}
    for name in names:
        kernels, wall_ms = profile_system(args.model, SYSTEMS[name], args.batch, args.prompt, args.steps)
        per_group = {}
        for kname, (us, _) in kernels.items():
            per_group[group_of(kname)] = per_group.get(group_of(kname), 0.0) + us / args.steps
        per_group["wall"] = wall_ms * 1000
        summary[name] = per_group
        total = sum(per_group.values()) - per_group["wall"]
        print(f"\n{args.model} {name}: batch {args.batch}, prompt {args.prompt}: GPU kernel time {total / 1000:.3f} "
              f"ms/step, wall {wall_ms:.3f} ms/step (unprofiled)")
        for kname, (us, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]:
            print(f"{us / args.steps:9.1f} us/step  {calls / args.steps:6.1f} calls/step  {kname[:90]}")
    groups = [g for g, _ in GROUPS] + ["other"]
    print(f"\nkernel time per decode step, µs (batch {args.batch}, context ~{args.prompt})")
    print(f"{'group':<22}" + "".join(f"{n:>10}" for n in names))
    for g in groups + ["total", "wall"]:
        vals = [sum(v for k, v in summary[n].items() if k != "wall") if g == "total" else summary[n].get(g, 0.0)
                for n in names]
        print(f"{g:<22}" + "".join(f"{v:10.0f}" for v in vals))


if __name__ == "__main__":
    main()
