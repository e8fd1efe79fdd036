"""The OpenAI server against the offline engine, on the same requests and the same engine config.

    python -m eightbit.eval.bench_server [--model llama-3-8b] [--num-requests 2000] [--concurrency 256]
                                         [--stream] [--engine-loop both] [--client-processes 4] [--json OUT.json]

One process builds the engine (dummy weights of a real shape, token-id prompts, ignore_eos so every request
generates exactly its max_tokens). It runs the requests offline twice, the first time to compile every kernel
variant they need, the second timed (all added at once, `step()` until done: the engine's own throughput). Then
it serves them over loopback, with the engine loop in a thread of the server's process (the same engine object),
then in a process of its own (an EngineProcess built from the same config once the first engine is freed). The
clients run in `--client-processes` separate processes (one client process used 2/3 of its CPU time on a 1B run,
90 % streamed), at most `--concurrency` in flight together; that is also the engine's max_num_seqs, so the offline
and served runs batch alike. Printed per engine loop: output tokens/s offline and served and their ratio; the
clients' TTFT (streamed: the first chunk) and end-to-end latency percentiles; the engine loop's time split from
`/metrics`; the clients' CPU time (near processes x wall time, the clients would be the limit). Every request
must come back with exactly its max_tokens, or the run fails.
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


def _client_process(index, url, model, requests, concurrency, stream, results, start):
    import httpx  # noqa: F401  (imported before the clock starts)

    start.wait()  # every client process is up: they start together
    cpu0 = time.process_time()
    t0 = time.time()  # wall clock: comparable across the client processes
    out = asyncio.run(_client(url, model, requests, concurrency, stream))
    results.put((index, t0, time.time(), time.process_time() - cpu0, out))


def run_client(url, model, requests, concurrency, stream, processes=1):
    """The client in `processes` spawned processes, each with its share of the requests (every processes-th) and of
    the concurrency: (wall seconds from the first one's start to the last one's end, their CPU seconds summed,
    per-request results in the order of `requests`)."""
    processes = max(1, min(processes, concurrency, len(requests)))
    ctx = multiprocessing.get_context("spawn")
    results, start = ctx.Queue(), ctx.Barrier(processes)
    procs = [ctx.Process(target=_client_process, args=(i, url, model, requests[i::processes],
                                                       concurrency // processes + (i < concurrency % processes),
                                                       stream, results, start))
             for i in range(processes)]
    for proc in procs:
        proc.start()
    done = {}
    try:
        while len(done) < processes:
            try:
                index, *rest = results.get(timeout=1.0)
                done[index] = rest
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode != 0]
                if dead:  # it died before answering (its traceback is on stderr)
                    raise RuntimeError(f"a client process ended (exit code {dead[0].exitcode}) without results")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    out = [None] * len(requests)
    for i, (_, _, _, res) in done.items():
        out[i::processes] = res
    wall = max(end for _, end, _, _ in done.values()) - min(start for start, _, _, _ in done.values())
    return wall, sum(cpu for _, _, cpu, _ in done.values()), out


def _metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


LOOPS = ("thread", "process")


def bench_server(model, num_requests, concurrency, stream, input_len, output_len, seed=0, client_processes=4,
                 loops=LOOPS, **engine_options):
    """One record per engine loop in `loops` ("thread": AsyncEngine on the offline run's engine; "process": an
    EngineProcess built from the same config, after the offline engine is freed), each with the offline numbers."""
    import gc
    import weakref

    import torch

    from eightbit.engine.server.engine_process import EngineProcess
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
    offline_tok_s = expected / offline["elapsed"]
    common = dict(model=model, num_requests=num_requests, concurrency=concurrency, stream=stream,
                  output_tokens=expected, offline_s=offline["elapsed"], offline_tok_s=offline_tok_s,
                  offline_steps=len(offline["steps"]), client_processes=client_processes)
    if list(loops) != [loop for loop in LOOPS if loop in loops]:
        raise ValueError(f"engine loops {loops!r}: each of {LOOPS} at most once, in that order (the thread serves the "
                         "offline run's engine, which the process's start frees)")
    records = []
    for loop in loops:
        if loop == "process":
            config, offline_engine = engine.config, weakref.ref(engine)
            llm = engine = serving = None  # the engine process needs the memory
            gc.collect()
            if offline_engine() is not None:
                raise RuntimeError("the offline engine is still referenced: its memory would not be freed")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            serving = EngineProcess(config)
        else:
            serving = engine
        served = serve(serving, requests, concurrency, stream, client_processes)
        records.append(dict(common, engine_loop=loop, **served, ratio=served["server_tok_s"] / offline_tok_s))
    return records


def serve(engine, requests, concurrency, stream, client_processes):
    """Serve `requests` from `engine` (an LLMEngine or an engine loop) to the clients; the server's numbers."""
    import httpx

    from eightbit.engine.server.cli import BackgroundServer

    srv = BackgroundServer(engine, port=0).start()
    try:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        # warm-up: the server's first requests (its handlers, tokenizer threads, the engine's first steps)
        run_client(srv.url, name, requests[:concurrency], concurrency, stream, client_processes)
        before = httpx.get(srv.url + "/metrics").text
        wall, client_cpu, results = run_client(srv.url, name, requests, concurrency, stream, client_processes)
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

    return dict(
        server_s=wall, server_tok_s=sum(n for _, n in requests) / wall,
        server_steps=int(delta("eightbit_engine_steps_total")),
        loop_busy_s=delta("eightbit_engine_loop_busy_seconds_total"),
        loop_model_s=delta("eightbit_engine_model_execution_seconds_total"), client_cpu_s=client_cpu,
        ttft_p50_s=percentile([r["ttft"] for r in results if r["ttft"] is not None], 0.5),
        ttft_p99_s=percentile([r["ttft"] for r in results if r["ttft"] is not None], 0.99),
        e2e_p50_s=percentile([r["e2e"] for r in results], 0.5), e2e_p99_s=percentile([r["e2e"] for r in results], 0.99),
    )


def summary_line(r) -> str:
    ms = lambda s: "-" if s is None else f"{s * 1e3:.0f} ms"  # noqa: E731
    return (f"{r['model']}, {r['num_requests']} requests at concurrency {r['concurrency']}, "
            f"{'streamed' if r['stream'] else 'not streamed'}: offline {r['offline_tok_s']:.0f} tok/s "
            f"({r['offline_steps']} steps), server (engine loop in a {r['engine_loop']}) {r['server_tok_s']:.0f} tok/s "
            f"({r['server_steps']} steps) = "
            f"{r['ratio']:.2f}x offline; engine loop busy {r['loop_busy_s']:.1f} s, model {r['loop_model_s']:.1f} s; "
            f"client CPU {r['client_cpu_s']:.1f} s over {r['client_processes']} processes; "
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
    p.add_argument("--client-processes", type=int, default=4,
                   help="client processes sharing the requests and the concurrency (default 4: one reached 2/3 of "
                        "its CPU over a 1B run on an H100, and 90 %% streamed)")
    p.add_argument("--engine-loop", choices=[*LOOPS, "both"], default="both",
                   help="serve from the engine loop in a thread of the server's process, in a process of its own "
                        "(`eightbit serve`'s default), or both one after the other (default)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 (float32 on the CPU tests)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--json", default=None, help="append the records (a JSON line per engine loop) to this file")
    args = p.parse_args(argv)
    options = dict(ENGINE_OPTIONS, system=args.system, device=args.device)
    if args.dtype:
        options["dtype"] = args.dtype
    if args.kv_cache_memory_gb:
        options["kv_cache_memory_gb"] = args.kv_cache_memory_gb
    loops = LOOPS if args.engine_loop == "both" else (args.engine_loop,)
    records = bench_server(args.model, args.num_requests, args.concurrency, args.stream, args.input_len,
                           args.output_len, client_processes=args.client_processes, loops=loops, **options)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    for r in records:
        print(summary_line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
