"""Load test of `eightbit serve` on the GPU: N requests at concurrency C on a dummy model over loopback.

python scripts/gpu_server_load.py [requests=2000] [concurrency=256] [model=llama-3-8b]

Dummy models have no tokenizer, so prompts are token ids and completions are measured in tokens
(`usage`), not text. Client side: every request must succeed with exactly its max_tokens. Server side
(`/metrics` histograms): TTFT and TPOT percentiles, read off the bucket bounds.
"""

import asyncio
import random
import sys
import time

import httpx

from eightbit import EngineConfig, LLMEngine
from eightbit.engine.server.cli import BackgroundServer


def histogram_quantile(metrics_text, name, q):
    buckets = []
    for line in metrics_text.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= q * total)


async def run(url, model, requests, concurrency):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(prompt, max_tokens):
            async with sem:
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json=dict(model=model, prompt=prompt, max_tokens=max_tokens,
                                                                   temperature=0))
                r.raise_for_status()
                usage = r.json()["usage"]
                return usage["completion_tokens"] == max_tokens, usage["completion_tokens"], time.perf_counter() - t0

        return await asyncio.gather(*(one(p, m) for p, m in requests), return_exceptions=True)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    c = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    model = sys.argv[3] if len(sys.argv) > 3 else "llama-3-8b"
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", quantization="w8a8", kv_cache_dtype="int8"))
    srv = BackgroundServer(engine, port=0).start()
    name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    rng = random.Random(0)
    vocab = engine.hf_config.vocab_size
    requests = [([rng.randrange(10, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 128))
                for _ in range(n)]
    t = time.perf_counter()
    results = asyncio.run(run(srv.url, name, requests, c))
    wall = time.perf_counter() - t
    errors = [r for r in results if isinstance(r, BaseException)]
    ok = [r for r in results if not isinstance(r, BaseException) and r[0]]
    tokens = sum(r[1] for r in results if not isinstance(r, BaseException))
    metrics = httpx.get(srv.url + "/metrics").text
    ttft = [histogram_quantile(metrics, "eightbit_time_to_first_token_seconds", q) for q in (0.5, 0.99)]
    tpot = [histogram_quantile(metrics, "eightbit_time_per_output_token_seconds", q) for q in (0.5, 0.99)]
    used = next(line for line in metrics.splitlines() if line.startswith("eightbit_kv_cache_blocks_used"))
    srv.stop()
    print(f"errors: {errors[:3]}")
    print(f"SUMMARY {model} W8A8+KV8, {n} requests at concurrency {c}: {len(ok)} complete with their exact "
          f"max_tokens, {len(errors)} failed, {n - len(ok) - len(errors)} short; {wall:.1f} s, {n / wall:.1f} req/s, "
          f"{tokens / wall:.0f} output tok/s; TTFT p50 <= {ttft[0] * 1e3:g} ms, p99 <= {ttft[1] * 1e3:g} ms; "
          f"TPOT p50 <= {tpot[0] * 1e3:g} ms, p99 <= {tpot[1] * 1e3:g} ms (histogram bucket bounds); after: {used}")


if __name__ == "__main__":
    main()
