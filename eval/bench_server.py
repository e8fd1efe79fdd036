"""The OpenAI server against the offline engine, on the same requests and the same engine object.

    python -m eightbit.eval.bench_server [--model llama-3-8b] [--num-requests 2000] [--concurrency 256]
                                         [--stream] [--json OUT.json]

One process holds the engine (dummy weights of a real shape, token-id prompts, ignore_eos so every request
generates exactly its max_tokens). It runs the requests offline twice, the first time to compile every kernel
variant they need, the second timed (all added at once, `step()` until done: the engine's own throughput). Then
it serves them over loopback to a client in a separate process (so the client's HTTP work does not share the
server's interpreter lock), at most `--concurrency` in flight; that is also the engine's max_num_seqs, so both
runs batch alike. Printed: output tokens/s of both and their ratio; the client's TTFT (streamed: the first chunk)
and end-to-end latency percentiles; the engine loop's time split from `/metrics`; the client's CPU time (near the
wall time, the client would be the limit). Every request must come back with exactly its max_tokens, or the run
fails.
"""

import argparse
import asyncio
import json
import multiprocessing
import queue
import sys
import time

ENGINE_OPTIONS = dict(load_format="dummy", enable_prefix_caching=False)


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


async def _one(client, sem, body, stream, t_run):
    """POST one completion: {tokens, ttft (streamed only), e2e, start} or {error, start, at} (seconds; start and at
    from the client's start)."""
    async with sem:
        t0 = time.perf_counter()
        try:
            tokens, first = await _post(client, body, stream, t0)
        except Exception as e:  # reported with when it happened: a connection error early, late, or mid-run
            return dict(error=repr(e), start=t0 - t_run, at=time.perf_counter() - t_run)
        return dict(tokens=tokens, ttft=first, e2e=time.perf_counter() - t0, start=t0 - t_run)


async def _post(client, body, stream, t0):
    if not stream:
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], None
    first, tokens = None, None
    body = dict(body, stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, first


async def _client(url, model, requests, concurrency, stream):
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        bodies = [dict(model=model, prompt=list(p), max_tokens=n, temperature=0, ignore_eos=True) for p, n in requests]
        t_run = time.perf_counter()
        return await asyncio.gather(*(_one(client, sem, b, stream, t_run) for b in bodies))


def _client_process(url, model, requests, concurrency, stream, results):
    t0, cpu0 = time.perf_counter(), time.process_time()
    out = asyncio.run(_client(url, model, requests, concurrency, stream))
    results.put((time.perf_counter() - t0, time.process_time() - cpu0, out))


def run_client(url, model, requests, concurrency, stream):
    """The client in a spawned process: (wall seconds, its CPU seconds, per-request results)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_client_process, args=(url, model, requests, concurrency, stream, results))
    proc.start()
    try:
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():  # it died before answering (its traceback is on stderr)
                    raise RuntimeError(f"the client process ended (exit code {proc.exitcode}) without results")
    finally:
        proc.join()


def _metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def bench_server(model, num_requests, concurrency, stream, input_len, output_len, seed=0, **engine_options):
    import httpx

    from eightbit.engine.server.cli import BackgroundServer
    from eightbit.eval.bench_common import make_requests
    from eightbit.eval.bench_engine import build_llm, run_requests

    # max_num_seqs = concurrency: the offline run batches at most as many requests as the client keeps in flight
    llm = build_llm(engine_options.pop("system", "eightbit-int8"), model, max_num_seqs=concurrency, **engine_options)
    engine = llm.engine
    listed = make_requests(num_requests, input_len, output_len, engine.hf_config.vocab_size, seed)
    requests = [(r.prompt, r.output_len) for r in listed]
    prompts, output_lens = [r.prompt for r in listed], [r.output_len for r in listed]
    expected = sum(output_lens)
    # The warm-up is the offline run itself, untimed: Triton compiles a kernel variant the first time a step's sizes
    # need it (seconds over a run like this one), and a shorter warm-up left the timed offline run paying for some.
    run_requests(engine, prompts, output_lens)
    offline = run_requests(engine, prompts, output_lens)
    if offline["generated"] != expected:
        raise RuntimeError(f"offline: {offline['generated']} tokens generated, {expected} expected")

    srv = BackgroundServer(engine, port=0).start()
    try:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        run_client(srv.url, name, requests[:concurrency], concurrency, stream)  # connections, handlers, imports
        before = httpx.get(srv.url + "/metrics").text
        wall, client_cpu, results = run_client(srv.url, name, requests, concurrency, stream)
        after = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    errors = [r for r in results if "error" in r]
    wrong = [i for i, (r, (_, n)) in enumerate(zip(results, requests)) if "error" not in r and r["tokens"] != n]
    if errors or wrong:
        raise RuntimeError(f"of {len(results)} requests over {wall:.1f} s, {len(errors)} failed "
                           f"({[(e['error'], round(e['start'], 2), round(e['at'], 2)) for e in errors[:4]]}: error, "
                           f"started, failed at s), {len(wrong)} got other than max_tokens")

    def delta(name):
        return _metric(after, name) - _metric(before, name)

    busy = delta("eightbit_engine_loop_busy_seconds_total")
    model_s = delta("eightbit_engine_model_execution_seconds_total")
    offline_tok_s = expected / offline["elapsed"]
    return dict(
        model=model, num_requests=num_requests, concurrency=concurrency, stream=stream, output_tokens=expected,
        offline_s=offline["elapsed"], offline_tok_s=offline_tok_s, offline_steps=len(offline["steps"]),
        server_s=wall, server_tok_s=expected / wall, ratio=expected / wall / offline_tok_s,
        server_steps=int(delta("eightbit_engine_steps_total")), loop_busy_s=busy, loop_model_s=model_s,
        client_cpu_s=client_cpu,
        ttft_p50_s=percentile([r["ttft"] for r in results if r["ttft"] is not None], 0.5),
        ttft_p99_s=percentile([r["ttft"] for r in results if r["ttft"] is not None], 0.99),
        e2e_p50_s=percentile([r["e2e"] for r in results], 0.5), e2e_p99_s=percentile([r["e2e"] for r in results], 0.99),
    )


def summary_line(r) -> str:
    ms = lambda s: "-" if s is None else f"{s * 1e3:.0f} ms"  # noqa: E731
    return (f"{r['model']}, {r['num_requests']} requests at concurrency {r['concurrency']}, "
            f"{'streamed' if r['stream'] else 'not streamed'}: offline {r['offline_tok_s']:.0f} tok/s "
            f"({r['offline_steps']} steps), server {r['server_tok_s']:.0f} tok/s ({r['server_steps']} steps) = "
            f"{r['ratio']:.2f}x offline; engine loop busy {r['loop_busy_s']:.1f} s, model {r['loop_model_s']:.1f} s; "
            f"client CPU {r['client_cpu_s']:.1f} s; "
            f"TTFT p50 / p99 {ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])}; e2e p50 / p99 {ms(r['e2e_p50_s'])} / "
            f"{ms(r['e2e_p99_s'])}")


def main(argv=None) -> int:
    from eightbit.eval.bench_engine import ENGINE_SYSTEMS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="a dummy shape (llama-3-8b, llama-3.2-1b, llama-tiny)")
    p.add_argument("--system", default="eightbit-int8", choices=sorted(ENGINE_SYSTEMS))
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--input-len", default="32:512")
    p.add_argument("--output-len", default="16:128")
    p.add_argument("--stream", action="store_true", help="stream the completions (TTFT measured by the client)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 (float32 on the CPU tests)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--json", default=None, help="append the record (one JSON line) to this file")
    args = p.parse_args(argv)
    options = dict(ENGINE_OPTIONS, system=args.system, device=args.device)
    if args.dtype:
        options["dtype"] = args.dtype
    if args.kv_cache_memory_gb:
        options["kv_cache_memory_gb"] = args.kv_cache_memory_gb
    record = bench_server(args.model, args.num_requests, args.concurrency, args.stream, args.input_len,
                          args.output_len, **options)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(summary_line(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
