"""Is a decode step paced by the GPU or by the host? The engine's host work per decode step, measured.

With async scheduling the host prepares step t + 1 and post-processes step t while the GPU runs; a step whose
sampled tokens are already there when the host asks for them (a wait of ~0) was paced by the host, or both sides
took about as long; the GPU's own span tells which. Per batch size, over the decode steps of B requests added at
once (`bench_engine.run_requests`: random token prompts, greedy, every request reported at every step with its
whole output so far, the engine's default, or with `--final-only` only at its first token and its end, as the
server adds a request that is not streamed and about as `LLM.generate` does (its requests: at the end only)),
this prints the medians of:
- step: the wall time of `LLMEngine.step()`;
- wait: the host's time blocked on the step's tokens (`LLMEngine._tokens_to_host`);
- GPU (CUDA only): the GPU's span from the step's first input upload to its tokens' copy (CUDA events recorded as
  `ModelRunner._run_graph` starts and `LLMEngine._launch` returns): an upper bound on the step's GPU work, since
  it also holds any gap in which the GPU waited for the host's launches inside the step (the sampling kernels
  after the graph; before run 73 the logits' too), which a host that keeps up does not leave.

It also times a fixed pure-Python loop before and after the runs (`python_loop_us`): on the GPU machines (16-vCPU
microVMs) some processes ran the interpreter about half as fast as others, the same GPU work in each, and their
steps were paced by the host (engine.md, run 73); compare that number between processes before comparing steps.

`--stub-model` replaces the model by zero hidden states and fixed logits: what is left is the host work alone,
which is how to measure it on a machine without a GPU (engine.md, runs 62-66, has both kinds of numbers).

    python -m eightbit.eval.bench_host --model llama-3.2-1b --batch-sizes 8,64,256      # a GPU machine
    python -m eightbit.eval.bench_host --model llama-tiny --stub-model --batch-sizes 64,256 --device cpu
    python -m eightbit.eval.bench_host --model llama-3.2-1b --batch-sizes 256 --final-only  # generate's host work
"""

import argparse
import json
import statistics
import time

import torch

from eightbit.eval.bench_common import random_prompts
from eightbit.eval.bench_engine import build_llm, run_requests


def stub_model(engine, seed=0):
    """Replace the engine's forward by zeros and its logits by a fixed random [rows, vocab] table (row i for the
    step's i-th sampling row). Returns that table."""
    runner, hidden = engine.runner, engine.hf_config.hidden_size
    device, dtype = engine.config.device, engine.model.model.embed_tokens.weight.dtype
    fixed = torch.randn(engine.config.max_num_seqs, engine.hf_config.vocab_size,
                        generator=torch.Generator().manual_seed(seed)).to(device)
    runner._run_graph = lambda input_ids, positions, context: None
    runner._run_eager = lambda input_ids, positions, context: torch.zeros(len(input_ids), hidden, dtype=dtype,
                                                                          device=device)
    engine.model.compute_logits = lambda h: fixed[: len(h)]
    return fixed


def build_host_llm(model, device=None, largest_batch=256, stub=False, system="eightbit-int8", freeze=True):
    """An LLM on dummy weights for the host-work benchmarks (this one and bench_gc): on `device` (default: cuda if
    available; the CPU in float32 with a 1 GB cache), room for `largest_batch` sequences, the model stubbed out
    (`stub_model`) if asked."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = dict(max_num_seqs=max(256, largest_batch))  # the engine's default, or room for the largest batch
    if device == "cpu":
        options.update(dtype="float32", kv_cache_memory_gb=1.0)
    llm = build_llm(system, model, device, freeze=freeze, **options)
    if stub:
        stub_model(llm.engine)
    return llm


class StepTimer:
    """Wraps the engine's step and its parts (on the instance) to record, per decode step (every request already
    has its first token), its wall time and wait and, on CUDA, the event pairs of the steps launched during it."""

    def __init__(self, engine):
        self.cuda = engine.on_cuda
        self.rows, self.spans = [], []  # decode steps: (wall seconds, wait seconds); (start, end) events
        self._waits, self._spans, self._start = [], [], None
        step, tokens_to_host, launch, run_graph = (engine.step, engine._tokens_to_host, engine._launch,
                                                   engine.runner._run_graph)

        def timed_step():
            decode = all(r.seqs[0].num_output_tokens > 0 for r in engine.requests.values())
            self._waits.clear()
            self._spans.clear()
            t = time.perf_counter()
            outputs = step()
            if decode:
                self.rows.append((time.perf_counter() - t, sum(self._waits)))
                self.spans += self._spans
            return outputs

        def timed_tokens_to_host(launched):
            t = time.perf_counter()
            tokens = tokens_to_host(launched)
            self._waits.append(time.perf_counter() - t)
            return tokens

        def timed_run_graph(*args):  # the step's inputs are built; its first upload comes next
            if self.cuda:
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            return run_graph(*args)

        def timed_launch(*args, **kwargs):
            launched = launch(*args, **kwargs)  # the tokens' copy to the host is queued by now
            if self.cuda and launched.tokens is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._spans.append((self._start, end))
            return launched

        engine.step, engine._tokens_to_host, engine._launch = timed_step, timed_tokens_to_host, timed_launch
        engine.runner._run_graph = timed_run_graph

    def gpu_us(self, spans):
        """The GPU spans of these (start, end) event pairs, microseconds; waits for them to finish."""
        torch.cuda.synchronize()
        return [1e3 * start.elapsed_time(end) for start, end in spans]


def decode_steps(engine, timer, batch, prompt_len, new_tokens, seed, final_only=False):
    """Run `batch` requests to the end (`bench_engine.run_requests`). Per decode step after the first two and before
    the last two (the pipeline's fill and drain): (step seconds, wait seconds); and the GPU spans (µs) of the steps
    launched during them (CUDA), read once the run is over so that no event makes the host wait mid-run."""
    timer.rows.clear()
    timer.spans.clear()
    run_requests(engine, random_prompts(batch, prompt_len, engine.hf_config.vocab_size, seed), [new_tokens] * batch,
                 final_only=final_only)
    rows, spans = list(timer.rows), timer.spans
    gpu = timer.gpu_us(spans[2:-2] or spans) if timer.cuda else []
    return rows[2:-2] or rows, gpu


def bench_host(llm, batch_sizes, prompt_len=512, new_tokens=64, seed=0, final_only=False):
    """Per batch size: dict(batch, steps, step_us, wait_us, gpu_us) (medians; gpu_us None off CUDA). final_only:
    the requests are reported only at their first token and their end (run_requests)."""
    engine = llm.engine
    timer = StepTimer(engine)
    results = []
    for b in batch_sizes:
        decode_steps(engine, timer, b, prompt_len, min(new_tokens, 4), seed + 1000 + b, final_only)  # warm-up
        rows, gpu = decode_steps(engine, timer, b, prompt_len, new_tokens, seed + b, final_only)
        results.append(dict(batch=b, steps=len(rows), step_us=1e6 * statistics.median(r[0] for r in rows),
                            wait_us=1e6 * statistics.median(r[1] for r in rows),
                            gpu_us=statistics.median(gpu) if gpu else None))
    return results


def python_loop_us(iterations=20_000, repeats=5) -> float:
    """The best of `repeats` timings of a fixed pure-Python loop, in µs: how fast this process's host runs the
    interpreter now."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(iterations):
            total += i * i
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def gpu_paced(r) -> bool:
    """Whether the GPU set the steps' pace: its span fills the step (within 7 %), or, where no span was measured,
    the host waited for the tokens (> 5 % of the step). With the host's work and the GPU's about equal, the wait is
    ~0 either way, so the span decides where there is one."""
    if r["gpu_us"] is not None:
        return r["gpu_us"] >= 0.93 * r["step_us"]
    return r["wait_us"] > 0.05 * r["step_us"]


def format_results(results, model, stub, final_only=False) -> str:
    reported = "reported at the first token and the end" if final_only else "reported every step"
    lines = [f"decode steps of {model}{' (model stubbed out: host work alone)' if stub else ''}, requests {reported}, "
             "medians, µs",
             f"{'batch':>6} {'steps':>6} {'step':>9} {'wait':>9} {'GPU':>9} {'µs / seq':>9}  paced by"]
    for r in results:
        gpu = "-" if r["gpu_us"] is None else f"{r['gpu_us']:9.0f}"
        paced = "-" if stub else "GPU" if gpu_paced(r) else "host"  # a stub has no GPU work
        lines.append(f"{r['batch']:>6} {r['steps']:>6} {r['step_us']:9.0f} {r['wait_us']:9.0f} {gpu:>9} "
                     f"{r['step_us'] / r['batch']:9.1f}  {paced}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.2-1b", help="a dummy shape (eightbit.engine.dummy)")
    p.add_argument("--system", default="eightbit-int8", choices=("eightbit-int8", "eightbit-bf16"))
    p.add_argument("--batch-sizes", default="8,64,256")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--stub-model", action="store_true", help="zero hidden states and fixed logits: host work alone")
    p.add_argument("--final-only", action="store_true",
                   help="report each request only at its first token and its end, as the server does a request "
                        "that is not streamed (LLM.generate: at the end only); default: at every step, its whole "
                        "output so far")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = build_host_llm(args.model, args.device, max(batch_sizes), args.stub_model, args.system)
    loop_before = python_loop_us()
    results = bench_host(llm, batch_sizes, args.prompt_len, args.new_tokens, final_only=args.final_only)
    loop_us = [loop_before, python_loop_us()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, system=args.system, stub=args.stub_model, final_only=args.final_only,
                           python_loop_us=loop_us, results=results), f, indent=1)
    print(format_results(results, args.model, args.stub_model, args.final_only))
    print(f"host: a reference Python loop took {loop_us[0]:.0f} µs before the runs and {loop_us[1]:.0f} µs after "
          "(compare it between processes: a slow host paces the steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
