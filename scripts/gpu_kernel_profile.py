"""Where a decode step's GPU time goes: torch.profiler kernel table for batch-1 decode on a dummy model.

python scripts/gpu_kernel_profile.py [model] [int8]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from eightbit import LLM, SamplingParams
from eightbit.eval.bench_common import kernel_times

model = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
opts = dict(quantization="w8a8", kv_cache_dtype="int8") if "int8" in sys.argv[2:] else {}
llm = LLM(model, load_format="dummy", gpu_memory_utilization=0.5, **opts)
prompt = [[(7 * j) % 1000 + 10 for j in range(512)]]
llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
steps = 32
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
kernels = kernel_times(prof.events())
total = sum(us for us, _ in kernels.values())
print(f"{model} {opts}: GPU time per decode step ~{total / steps / 1000:.3f} ms (incl. one 512-token prefill)")
for name, (us, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{us / steps:9.1f} us/step  {calls / steps:6.1f} calls/step  {name[:90]}")
