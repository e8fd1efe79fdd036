"""Where a batch-1 prefill (TTFT) goes: bf16 vs W8A8+KV8 on a dummy model, one process.

python scripts/gpu_prefill_profile.py [model] [prompt_len] [--cprofile]

For each system: median wall time of `generate(max_tokens=1)` (= TTFT offline), the GPU
busy time of one such call (sum of kernel times) and its kernel table.
"""

import gc
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from eightbit import LLM, SamplingParams
from eightbit.eval.bench_common import kernel_times

model = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 512
SYSTEMS = {"bf16": {}, "int8": dict(quantization="w8a8", kv_cache_dtype="int8")}
params = SamplingParams(temperature=0, max_tokens=1)
summary = []
for name, opts in SYSTEMS.items():
    llm = LLM(model, load_format="dummy", gpu_memory_utilization=0.5, **opts)
    walls = []
    for i in range(12):
        prompt = [[(7 * j + i) % 1000 + 10 for j in range(prompt_len)]]  # new tokens: no prefix-cache hit
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls[2:]) * 1e3
    prompt = [[(11 * j) % 1000 + 10 for j in range(prompt_len)]]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
    kernels = kernel_times(prof.events())
    gpu = sum(v[0] for v in kernels.values()) / 1e3
    print(f"\n== {model} {name}: prefill {prompt_len} tokens, wall {wall:.2f} ms, GPU busy {gpu:.2f} ms")
    for kname, (us, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"{us / 1e3:8.3f} ms  {calls:5d} calls  {kname[:100]}")
    summary.append((name, wall, gpu))
    if "--cprofile" in sys.argv:  # where the host time goes
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for i in range(5):
            llm.generate([[(13 * j + i) % 1000 + 10 for j in range(prompt_len)]], params, use_tqdm=False)
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(40)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
print(f"\n{torch.cuda.get_device_name()}  {model}, batch 1, prompt {prompt_len}")
print("system  TTFT wall ms  GPU busy ms  host-bound ms")
for name, wall, gpu in summary:
    print(f"{name:6}  {wall:12.2f}  {gpu:11.2f}  {wall - gpu:13.2f}")
