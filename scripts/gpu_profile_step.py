"""Where a decode step's time goes: host-side profile (cProfile) of batch-1 decode on a dummy model.

python scripts/gpu_profile_step.py [model] [quantization] [kv_cache_dtype]
"""

import cProfile
import io
import pstats
import sys
import time

import torch

from eightbit import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
opts = dict(quantization="w8a8", kv_cache_dtype="int8") if "int8" in sys.argv[2:] else {}
llm = LLM(model, load_format="dummy", gpu_memory_utilization=0.5, **opts)
prompt = [[(7 * j) % 1000 + 10 for j in range(512)]]
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
torch.cuda.synchronize()
t = time.perf_counter()
llm.generate(prompt, params, use_tqdm=False)
torch.cuda.synchronize()
print(f"{model} {opts}: batch 1 {128 / (time.perf_counter() - t):.0f} tok/s")
prof = cProfile.Profile()
prof.enable()
llm.generate(prompt, params, use_tqdm=False)
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
print(s.getvalue()[-6000:])
