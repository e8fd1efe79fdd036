"""CPU decode speed of the embedded model: python scripts/cpu_speed.py [float32|bfloat16]"""

import sys
import time

from eightbit import LLM, SamplingParams

llm = LLM(dtype=sys.argv[1] if len(sys.argv) > 1 else "float32", device="cpu", kv_cache_memory_gb=0.5,
          max_model_len=2048)
prompt = "Write a long story about a robot who learns to paint."
for batch in (1, 16):
    llm.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([prompt + f" Chapter {i}." for i in range(batch)],
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"batch {batch}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s")
