"""What new prompts cost when they arrive: the step that takes them run eagerly, as graph replays of one prompt each,
and as the engine runs it (a prefill graph holds up to 8 prompts; ModelRunner._run_graph and _run_split_graphs),
in one process on one engine.

python scripts/gpu_arrivals.py MODEL   (llama-3.2-1b, llama-3-8b, ...: eightbit-int8 on dummy weights; one model a
process, as the engine takes most of the GPU's memory)

Two measurements per (prompts P, prompt length n), each mode alternating, medians of REPEATS:
- idle: P prompts added to an idle engine (max_tokens 1), the wall time until all have their first token;
- busy: 32 requests decoding; a window of four steps with P new prompts (max_tokens 1) added before it,
  minus a window of four decode steps: what the arrivals cost the running requests.
Prints a table; writes arrivals_<model>.json to $OUT or '.'.
"""

import json
import os
import statistics
import sys
import time

import torch

from eightbit import SamplingParams
from eightbit.engine import model_runner
from eightbit.engine.cuda_graphs import PrefillGraphs
from eightbit.eval.bench_engine import _sync, build_llm

CASES = [(1, 128), (2, 32), (2, 128), (2, 512), (4, 32), (4, 128), (4, 512), (4, 1024), (8, 32), (8, 128),
         (8, 512), (8, 1024), (16, 32), (16, 128)]
REPEATS = 5
BUSY = 32
MODES = ("eager", "one", "multi")
_pack = model_runner.pack_sequences


def _prompts(gen, count, n, vocab):
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for _ in range(count)]


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _steps(eng, n):
    for _ in range(n):
        eng.step()


def _drain(eng):
    while eng.has_unfinished_requests():
        eng.step()


class _Modes:
    """Switches what runs a step with prompts in it: "eager" (no graph; decode steps still replay theirs), "one"
    (a prefill replay takes one prompt, as before the prefill graphs took several) or "multi" (the engine's)."""

    def __init__(self, runner):
        self.runner, self.graphs = runner, runner.prefill_graphs

    def set(self, mode):
        g = self.graphs
        self.runner.prefill_graphs = None if mode == "eager" else g
        g.__dict__.pop("fits", None)
        model_runner.pack_sequences = _pack
        if mode == "one":
            g.fits = lambda n, context: len(context.seq_lens) == 1 and PrefillGraphs.fits(g, n, context)
            model_runner.pack_sequences = lambda cu, max_seqs, max_tokens: _pack(cu, 1, max_tokens)


def run(model, cases=CASES, repeats=REPEATS, busy=BUSY, **options):
    llm = build_llm("eightbit-int8", model, **{"max_num_seqs": 64, "max_model_len": 4096, **options})
    eng, gen, ids = llm.engine, torch.Generator().manual_seed(0), iter(range(10**9))
    modes, vocab, device = _Modes(eng.runner), eng.hf_config.vocab_size, eng.config.device
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    def add(prompts, params):
        for p in prompts:
            eng.add_request(f"r{next(ids)}", p, params, final_only=True)

    for mode in MODES:  # warm-up
        modes.set(mode)
        add(_prompts(gen, 2, 16, vocab), one)
        _drain(eng)
    rows = []
    for count, n in cases:
        idle = {mode: [] for mode in MODES}
        for _ in range(repeats):
            for mode in idle:
                modes.set(mode)
                prompts = _prompts(gen, count, n, vocab)
                idle[mode].append(_timed(lambda: (add(prompts, one), _drain(eng)), device))
        rows.append({"case": "idle", "prompts": count, "len": n, **{m: statistics.median(v) for m, v in idle.items()}})

    long = SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0.0)
    add(_prompts(gen, busy, 128, vocab), long)
    _steps(eng, 30)
    for count, n in cases:
        extra = {mode: [] for mode in MODES}
        for _ in range(repeats):
            for mode in extra:
                modes.set(mode)
                plain = _timed(lambda: _steps(eng, 4), device)
                prompts = _prompts(gen, count, n, vocab)
                extra[mode].append(_timed(lambda: (add(prompts, one), _steps(eng, 4)), device) - plain)
        rows.append({"case": f"busy {busy}", "prompts": count, "len": n,
                     **{m: statistics.median(v) for m, v in extra.items()}})
    modes.set("multi")
    for request_id in list(eng.requests):
        eng.abort(request_id)
    _drain(eng)
    return rows


def main():
    (model,) = sys.argv[1:]
    rows = run(model)
    with open(os.path.join(os.environ.get("OUT", "."), f"arrivals_{model}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{model} on {torch.cuda.get_device_name()}; ms: idle = until every prompt has its first token, busy = the "
          f"arrivals' extra time over four steps beside {BUSY} decoding requests")
    print("| case | prompts x tokens | eager ms | one ms | multi ms | eager / multi | one / multi |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        e, o, m = r["eager"], r["one"], r["multi"]
        print(f"| {r['case']} | {r['prompts']} x {r['len']} | {e:.2f} | {o:.2f} | {m:.2f} | {e / m:.2f} | {o / m:.2f} |")


if __name__ == "__main__":
    main()
