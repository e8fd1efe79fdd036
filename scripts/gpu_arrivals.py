"""What new prompts cost when they arrive: the step that takes them as graph replays (one per part,
ModelRunner._run_split_graphs) against the same step run eagerly, in one process on one engine.

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
from eightbit.eval.bench_engine import build_llm

CASES = [(1, 128), (2, 32), (2, 128), (2, 512), (4, 32), (4, 128), (4, 512), (4, 1024), (8, 32), (8, 128),
         (8, 512), (8, 1024)]
REPEATS = 5
BUSY = 32


def _prompts(gen, count, n, vocab):
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for _ in range(count)]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t0) * 1e3


def _steps(eng, n):
    for _ in range(n):
        eng.step()


def _drain(eng):
    while eng.has_unfinished_requests():
        eng.step()


class _Modes:
    """Switches the runner between splitting steps into graph replays and running them eagerly."""

    def __init__(self, runner):
        self.runner, self.split = runner, runner._run_split_graphs

    def set(self, mode):
        self.runner._run_split_graphs = self.split if mode == "split" else (lambda *args: None)


def run(model, cases=CASES, repeats=REPEATS, busy=BUSY, **options):
    llm = build_llm("eightbit-int8", model, **{"max_num_seqs": 64, "max_model_len": 4096, **options})
    eng, gen, ids = llm.engine, torch.Generator().manual_seed(0), iter(range(10**9))
    modes, vocab = _Modes(eng.runner), eng.hf_config.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    def add(prompts, params):
        for p in prompts:
            eng.add_request(f"r{next(ids)}", p, params, final_only=True)

    for mode in ("split", "eager"):  # warm-up
        modes.set(mode)
        add(_prompts(gen, 2, 16, vocab), one)
        _drain(eng)
    rows = []
    for count, n in cases:
        idle = {"split": [], "eager": []}
        for _ in range(repeats):
            for mode in idle:
                modes.set(mode)
                prompts = _prompts(gen, count, n, vocab)
                idle[mode].append(_timed(lambda: (add(prompts, one), _drain(eng))))
        rows.append({"case": "idle", "prompts": count, "len": n, **{m: statistics.median(v) for m, v in idle.items()}})

    long = SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0.0)
    add(_prompts(gen, busy, 128, vocab), long)
    _steps(eng, 30)
    for count, n in cases:
        extra = {"split": [], "eager": []}
        for _ in range(repeats):
            for mode in extra:
                modes.set(mode)
                plain = _timed(lambda: _steps(eng, 4))
                prompts = _prompts(gen, count, n, vocab)
                extra[mode].append(_timed(lambda: (add(prompts, one), _steps(eng, 4))) - plain)
        rows.append({"case": f"busy {busy}", "prompts": count, "len": n,
                     **{m: statistics.median(v) for m, v in extra.items()}})
    modes.set("split")
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
    print("| case | prompts x tokens | eager ms | split ms | eager / split |\n|---|---|---:|---:|---:|")
    for r in rows:
        ratio = r["eager"] / r["split"] if r["split"] > 0 else float("nan")
        print(f"| {r['case']} | {r['prompts']} x {r['len']} | {r['eager']:.2f} | {r['split']:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
