"""How much of a decode step is host time the GPU waits for.

python scripts/gpu_step_gap.py [model] [batch ...]     (default llama-3-8b, batches 1 64)

For W8A8 + int8 KV on a dummy model, per batch size:
  * engine: the time per decode step of `generate` (the latency benchmark's TPOT);
  * replay: the same step's GPU work queued back to back with no host work in between (the
    decode graph, the lm_head on the sampled rows and the argmax, 50 times, one sync);
  * the difference: host work per step the GPU does not overlap.
Then a cProfile of the engine's steps (top functions by own time) shows where the host time goes.
"""

import cProfile
import pstats
import sys
import time

import torch

from eightbit import LLM, SamplingParams


def tpot(llm, batch, new_tokens=64, prompt_len=512):
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    llm.generate(prompts, many, use_tqdm=False)  # warm-up
    times = []
    for params in (one, many):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return (times[1] - times[0]) / new_tokens


def replay_only(llm, batch, steps=50):
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    b = next(s for s in graphs.buckets if s >= batch)
    graphs.seq_lens[:batch].fill_(513)
    graphs.slot_mapping[:b].fill_(-1)
    rows = torch.arange(batch, device=runner.device)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        graphs.graphs[b].replay()
        runner.model.compute_logits(graphs.hidden[rows]).argmax(-1)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
    batches = [int(b) for b in sys.argv[2:]] or [1, 64]
    llm = LLM(model, load_format="dummy", quantization="w8a8", kv_cache_dtype="int8", gpu_memory_utilization=0.5)
    rows = []
    for batch in batches:
        engine_ms, gpu_ms = tpot(llm, batch) * 1e3, replay_only(llm, batch) * 1e3
        rows.append((batch, engine_ms, gpu_ms))
        print(f"batch {batch}: engine {engine_ms:.3f} ms/step, replay {gpu_ms:.3f} ms/step", flush=True)
    prompts = [[(7 * j) % 1000 + 10 for j in range(512)]]
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=65, ignore_eos=True), use_tqdm=False)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    print("batch  engine ms/step  replay ms/step  host gap ms  gap %")
    for batch, e, g in rows:
        print(f"{batch:5d}  {e:14.3f}  {g:14.3f}  {e - g:11.3f}  {100 * (e - g) / e:5.1f}")


if __name__ == "__main__":
    main()
