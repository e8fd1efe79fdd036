"""eightbit's own benchmarks: offline throughput, TTFT/TPOT with the roofline, KV-cache capacity.

Systems: `eightbit-int8` (W8A8 linears + int8 KV cache) and `eightbit-bf16` (bf16 linears and KV),
both on random weights of a real shape (`load_format="dummy"`), token-id prompts.

- throughput: every request of the list added at once (offline, like vLLM's `LLM.generate`), then
  `step()` until all finish; output tokens/s counts each request's own output length (ignore_eos, so
  exactly `max_tokens`), checked per request.
- latency: B requests of `prompt_len` random tokens, `new_tokens` each, added at once. TTFT = from a
  request's add to the step that returned its first token; TPOT = (last - first token time) / (n - 1),
  both averaged over the batch. A batch of fewer than 8,192 prompt tokens prefills in a few ms, where
  one sample is host-jitter noise: it repeats a max_tokens=1 prefill of fresh prompts 9 times and
  reports the median as TTFT (the single sample stays in `ttft_ms_single`). The decode-only steps (every request already has its first token) give
  the achieved bandwidth: per step the shared weights (linears, lm_head, norms) once, one embedding row
  per sequence and each sequence's K/V at its current context; / the step's wall time; vs the copy
  bandwidth measured in the same process (% of roofline).
- capacity: the engine built with int8 KV and with bf16 KV at the same `gpu_memory_utilization`
  (W8A8 weights both times: the KV format alone), plus bf16 weights + bf16 KV (the whole bf16 system);
  tokens = num_blocks x block_size.

Prefix caching is off by default here: the runs reuse prompts (warm-up, prefix runs) and a cache hit
would fake a fast prefill. Wall times come from `time.perf_counter()` around `step()`, which returns
only after the sampled tokens reach the host.
"""

import gc
import itertools
import statistics
import time

import torch

from eightbit.eval.bench_common import (
    make_requests,
    random_prompts,
    short_error,
    weight_bytes,
)

ENGINE_SYSTEMS = {
    "eightbit-int8": dict(quantization="w8a8", kv_cache_dtype="int8"),
    "eightbit-bf16": dict(quantization=None, kv_cache_dtype="auto"),
}

_request_ids = itertools.count()


class Deadline:
    """A wall-clock budget: `left()` seconds remain; None = no limit."""

    def __init__(self, seconds=None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def passed(self) -> bool:
        return self.left() <= 0


def build_llm(system, model, device=None, freeze=True, **engine_options):
    """An LLM for `system` (a key of ENGINE_SYSTEMS) on dummy weights of `model`'s shape; its start-up heap frozen
    out of later garbage collections unless freeze=False (llm_engine.freeze_startup_heap)."""
    from eightbit import LLM
    from eightbit.engine.llm_engine import freeze_startup_heap

    if system not in ENGINE_SYSTEMS:
        raise ValueError(f"unknown eightbit system {system!r}; known: {sorted(ENGINE_SYSTEMS)}")
    options = dict(load_format="dummy", dtype="bfloat16", enable_prefix_caching=False)
    options.update(engine_options)
    options.update(ENGINE_SYSTEMS[system])
    llm = LLM(model=model, device=device, **options)
    if freeze:
        freeze_startup_heap()  # as `eightbit serve` does: a benchmark's process is the engine's
    return llm


def engine_info(llm) -> dict:
    e = llm.engine
    return dict(
        kv_bytes_per_token=e.kv_bytes_per_token,
        num_blocks=e.block_manager.num_blocks,
        block_size=e.config.block_size,
        capacity_tokens=e.block_manager.num_blocks * e.config.block_size,
        weights=weight_bytes(e.model),
        vocab_size=e.hf_config.vocab_size,
        max_model_len=e.max_model_len,
        enforce_eager=e.config.enforce_eager,
        async_scheduling=e.config.async_scheduling,
        max_num_seqs=e.config.max_num_seqs,
        max_num_batched_tokens=e.config.max_num_batched_tokens,
        enable_prefix_caching=e.config.enable_prefix_caching,
    )


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_requests(engine, prompts, output_lens, deadline=None, final_only=False):
    """Add every request at once, step until all finish (or the deadline: the rest are aborted).

    Returns per-request add / first-token / last-token times and token counts, and per step
    (wall seconds, number of sequences that got a token, sum of their attended context lengths,
    whether it was a decode-only step). Each request is reported at every step with its whole output so far
    (the engine's default), or with final_only only at its first token and its end (as the server adds a request
    that is not streamed, about as `LLM.generate` does: less host work a step); then only the steps that reported
    something are in the per-step list.
    """
    from eightbit import SamplingParams

    deadline = deadline or Deadline()
    rids = [f"bench-{next(_request_ids)}" for _ in prompts]
    prompt_len = {r: len(p) for r, p in zip(rids, prompts)}
    wanted = dict(zip(rids, output_lens))
    t_add, first, last, ntok = {}, {}, {}, {}
    steps = []
    generated0 = engine.num_generated_tokens
    _sync(engine.config.device)
    t0 = time.perf_counter()
    for rid, prompt, n in zip(rids, prompts, output_lens):
        engine.add_request(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                           final_only=final_only, first_token_output=final_only)
        t_add[rid] = time.perf_counter()
    unfinished = set(rids)
    aborted = False
    while engine.has_unfinished_requests():
        if deadline.passed():
            for rid in unfinished:
                engine.abort(rid, report=False)
            aborted = True
            break
        decode_only = all(r in first for r in unfinished)
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        ctx = 0
        for out in outs:
            rid = out.request_id
            n = len(out.outputs[0].token_ids)
            if n:
                first.setdefault(rid, te)
                last[rid] = te
                ntok[rid] = n
                ctx += prompt_len[rid] + n - 1  # the step's input token sat at position prompt + n - 2
            if out.finished:
                unfinished.discard(rid)
        if outs:
            steps.append((te - ts, len(outs), ctx, decode_only))
    elapsed = time.perf_counter() - t0
    return dict(
        rids=rids, prompt_len=prompt_len, wanted=wanted, t_add=t_add, first=first, last=last, ntok=ntok,
        steps=steps, elapsed=elapsed, generated=engine.num_generated_tokens - generated0, aborted=aborted,
        unfinished=len(unfinished),
    )


# --- latency -----------------------------------------------------------------------------


def latency_stats(run, weights, kv_bytes_per_token, copy_gbs=None) -> dict:
    """TTFT / TPOT / tok/s / bytes per token / achieved GB/s / % of roofline from a run_requests result."""
    rids = [r for r in run["rids"] if r in run["first"]]
    ttft = [run["first"][r] - run["t_add"][r] for r in rids]
    tpot = [(run["last"][r] - run["first"][r]) / (run["ntok"][r] - 1) for r in rids if run["ntok"][r] > 1]
    decode = [s for s in run["steps"] if s[3]]
    decode_time = sum(s[0] for s in decode)
    decode_tokens = sum(s[1] for s in decode)
    decode_bytes = sum(
        weights["shared"] + n * weights["embedding_row"] + kv_bytes_per_token * ctx for _, n, ctx, _ in decode
    )
    out = dict(
        ttft_ms=1e3 * sum(ttft) / len(ttft) if ttft else None,
        ttft_ms_max=1e3 * max(ttft) if ttft else None,
        tpot_ms=1e3 * sum(tpot) / len(tpot) if tpot else None,
        tok_s=run["generated"] / run["elapsed"] if run["elapsed"] > 0 else None,
        decode_steps=len(decode),
        decode_tok_s=decode_tokens / decode_time if decode_time > 0 else None,
        bytes_per_token=decode_bytes / decode_tokens if decode_tokens else None,
        achieved_gbs=decode_bytes / decode_time / 1e9 if decode_time > 0 else None,
        elapsed_s=run["elapsed"],
        generated_tokens=run["generated"],
    )
    out["copy_gbs"] = copy_gbs
    out["roofline_pct"] = (
        100.0 * out["achieved_gbs"] / copy_gbs if copy_gbs and out["achieved_gbs"] is not None else None
    )
    return out


TTFT_SAMPLE_TOKENS = 8192  # batches smaller than this many prompt tokens repeat their prefill


def ttft_samples(engine, batch, prompt_len, vocab, seed, deadline, repeats=None) -> list[float]:
    """Extra TTFT measurements (seconds, mean over the batch) of fresh prompts with max_tokens=1,
    for batches whose prefill is short: up to 9 when batch * prompt_len < TTFT_SAMPLE_TOKENS."""
    if repeats is None:
        repeats = 9 if batch * prompt_len < TTFT_SAMPLE_TOKENS else 0
    out = []
    for i in range(repeats):
        if deadline.passed():
            break
        run = run_requests(engine, random_prompts(batch, prompt_len, vocab, seed + 104729 * (i + 1) + batch),
                           [1] * batch, deadline)
        got = [run["first"][r] - run["t_add"][r] for r in run["rids"] if r in run["first"]]
        if got and not run["aborted"]:
            out.append(sum(got) / len(got))
    return out


def bench_latency(llm, batch_sizes=(1, 16, 64), prompt_len=512, new_tokens=128, seed=0, deadline=None,
                  copy_gbs=None, warmup=True, base=None) -> list[dict]:
    """One record per batch size (an error or a skip is a record too)."""
    deadline = deadline or Deadline()
    engine = llm.engine
    info = engine_info(llm)
    vocab = info["vocab_size"]
    records = []
    for batch in batch_sizes:
        rec = dict(base or {}, bench="latency", batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                   weights=info["weights"], kv_bytes_per_token=info["kv_bytes_per_token"], ok=False, error=None)
        try:
            if deadline.passed():
                raise TimeoutError("skipped: the time cap was reached before this batch size")
            if warmup:  # compile / capture at this batch; different prompts (no prefix hits anyway)
                run_requests(engine, random_prompts(batch, prompt_len, vocab, seed + 7919 + batch),
                             [min(4, new_tokens)] * batch, deadline)
            prompts = random_prompts(batch, prompt_len, vocab, seed + batch)
            run = run_requests(engine, prompts, [new_tokens] * batch, deadline)
            rec.update(latency_stats(run, info["weights"], info["kv_bytes_per_token"], copy_gbs))
            samples = ttft_samples(engine, batch, prompt_len, vocab, seed, deadline)
            if samples:  # a small batch's one prefill is a few ms: one sample is host-jitter noise
                rec["ttft_ms_single"] = rec["ttft_ms"]
                rec["ttft_ms"] = 1e3 * statistics.median(samples)
                rec["ttft_samples"] = len(samples)
            rec["partial"] = run["aborted"]
            if run["aborted"]:
                rec["note"] = f"stopped at the time cap after {run['generated']} of {batch * new_tokens} tokens"
            rec["ok"] = True
        except Exception as e:
            rec["error"] = short_error(e)
        records.append(rec)
    return records


# --- throughput --------------------------------------------------------------------------


def bench_throughput(llm, requests, deadline=None, warmup=True, base=None, num_requests_total=None,
                     seed=0) -> dict:
    """Offline throughput over `requests` (a list of BenchRequest)."""
    deadline = deadline or Deadline()
    engine = llm.engine
    info = engine_info(llm)
    rec = dict(base or {}, bench="throughput", num_requests=len(requests),
               num_requests_total=num_requests_total or len(requests), ok=False, error=None, partial=False)
    try:
        if warmup:  # the same length mix, other tokens, few outputs: prefill shapes and decode batches
            k = min(len(requests), 32)
            lo = min(len(r.prompt) for r in requests)
            hi = max(len(r.prompt) for r in requests)
            warm = make_requests(k, (lo, hi), (1, 8), info["vocab_size"], seed=seed + 104729)
            run_requests(engine, [r.prompt for r in warm], [r.output_len for r in warm], deadline)
        if deadline.passed():
            raise TimeoutError("skipped: the time cap was reached during the warm-up")
        run = run_requests(engine, [r.prompt for r in requests], [r.output_len for r in requests], deadline)
        finished = [r for r in run["rids"] if run["ntok"].get(r, 0) == run["wanted"][r]]
        elapsed = run["elapsed"]
        prompt_tokens = sum(len(r.prompt) for r in requests)
        rec.update(
            output_tokens=run["generated"],
            expected_output_tokens=sum(r.output_len for r in requests),
            prompt_tokens=prompt_tokens,
            finished_requests=len(finished),
            elapsed_s=elapsed,
            output_tok_s=run["generated"] / elapsed,
            total_tok_s=(run["generated"] + prompt_tokens) / elapsed if not run["aborted"] else None,
            req_s=len(finished) / elapsed,
            steps=len(run["steps"]),
            capacity_tokens=info["capacity_tokens"],
        )
        if run["aborted"]:
            rec["partial"] = True
            rec["note"] = (f"stopped at the time cap: {len(finished)} of {len(requests)} requests finished; "
                           "tok/s over the tokens generated until then")
        elif len(finished) != len(requests):
            raise RuntimeError(f"{len(requests) - len(finished)} requests did not get exactly their output length")
        rec["ok"] = True
    except Exception as e:
        rec["error"] = short_error(e)
    return rec


# --- capacity ----------------------------------------------------------------------------

CAPACITY_CONFIGS = {
    "w8a8 + int8 KV": dict(quantization="w8a8", kv_cache_dtype="int8"),
    "w8a8 + bf16 KV": dict(quantization="w8a8", kv_cache_dtype="auto"),
    "bf16 + bf16 KV": dict(quantization=None, kv_cache_dtype="auto"),
}


def bench_capacity(model, device=None, deadline=None, base=None, **engine_options) -> dict:
    """KV tokens that fit (num_blocks x block_size) per config, each engine built, measured and freed in turn."""
    from eightbit import LLM

    deadline = deadline or Deadline()
    rec = dict(base or {}, bench="capacity", configs={}, ok=False, error=None)
    options = dict(load_format="dummy", dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False)
    options.update(engine_options)
    rec["gpu_memory_utilization"] = options.get("gpu_memory_utilization", 0.9)
    for name, cfg in CAPACITY_CONFIGS.items():
        entry = {}
        try:
            if deadline.passed():
                raise TimeoutError("skipped: time cap")
            llm = LLM(model=model, device=device, **dict(options, **cfg))
            e = llm.engine
            entry = dict(num_blocks=e.block_manager.num_blocks, block_size=e.config.block_size,
                         tokens=e.block_manager.num_blocks * e.config.block_size,
                         kv_bytes_per_token=e.kv_bytes_per_token, weight_bytes=weight_bytes(e.model)["shared"])
            del llm, e
        except Exception as ex:
            entry = dict(error=short_error(ex))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        rec["configs"][name] = entry
    c = rec["configs"]
    tok = {k: v.get("tokens") for k, v in c.items()}
    if tok["w8a8 + int8 KV"] and tok["w8a8 + bf16 KV"]:
        rec["kv_ratio"] = tok["w8a8 + int8 KV"] / tok["w8a8 + bf16 KV"]
    if tok["w8a8 + int8 KV"] and tok["bf16 + bf16 KV"]:
        rec["system_ratio"] = tok["w8a8 + int8 KV"] / tok["bf16 + bf16 KV"]
    rec["ok"] = "kv_ratio" in rec
    if not rec["ok"]:
        rec["error"] = "; ".join(f"{k}: {v['error']}" for k, v in c.items() if "error" in v) or "incomplete"
    return rec
