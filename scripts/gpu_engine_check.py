"""GPU engine check: CUDA-graph decode vs eager, int8 vs bf16 on a dummy model, quick decode speed.

Run on a CUDA machine: python scripts/gpu_engine_check.py [model]   (default llama-3.2-1b)
"""

import sys
import time

import torch

from eightbit import LLM, SamplingParams


def timed_decode(llm, batch, prompt_len=512, new_tokens=128):
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return outs, batch * new_tokens / dt


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    prompts = [[(13 * i + j) % 5000 + 1 for j in range(40 + 17 * i)] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rows = []
    for name, opts in [("bf16", {}), ("w8a8+kv8", dict(quantization="w8a8", kv_cache_dtype="int8"))]:
        eager = LLM(model, load_format="dummy", enforce_eager=True, gpu_memory_utilization=0.45, **opts)
        ref = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy, use_tqdm=False)]
        del eager
        torch.cuda.empty_cache()
        llm = LLM(model, load_format="dummy", gpu_memory_utilization=0.45, **opts)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        same = sum(a == b for a, b in zip(ref, got))
        print(f"{name}: graph vs eager greedy identical for {same}/{len(ref)} prompts", flush=True)
        for batch in (1, 16, 64):
            _, tps = timed_decode(llm, batch)
            rows.append((name, batch, tps))
            print(f"{name} batch {batch}: {tps:.0f} tok/s (prompt 512 + 128)", flush=True)
        print(f"{name}: kv blocks {llm.engine.block_manager.num_blocks}, kv bytes/token {llm.engine.kv_bytes_per_token:.0f}")
        del llm
        torch.cuda.empty_cache()
    print("\nconfig      batch  tok/s")
    for name, batch, tps in rows:
        print(f"{name:10s} {batch:5d} {tps:8.0f}")


if __name__ == "__main__":
    main()
