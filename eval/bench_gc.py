"""Do Python's garbage collections stall the engine's steps? Many requests through one engine, the collections and
the slowest step, with the start-up heap frozen out of later collections (as `eightbit serve` runs the engine,
`llm_engine.freeze_startup_heap`) and without (as `LLM` does in a user's program), each arm in a fresh process,
since a freeze holds for the rest of its process.

A full collection walks every object the collector tracks: after importing torch and transformers and loading a
model, some 400k, a quarter of a second. It comes when enough objects have outlived two younger collections
(requests that run for many steps do), so a server meets it every few thousand requests, and every running request
waits that long for its next token. Frozen objects are left out of every collection.

    python -m eightbit.eval.bench_gc                                   # the GPU if there is one, 1B shape
    python -m eightbit.eval.bench_gc --model llama-tiny --stub-model --device cpu   # host work alone, any machine
"""

import argparse
import gc
import json
import subprocess
import sys
import time

ARMS = ("frozen", "not frozen")


def run_arm(args) -> dict:
    """This process's arm: build the engine, push the requests through in rounds of --batch, record every
    collection's generation and duration, and each decode step's wall time."""
    from eightbit.eval.bench_common import random_prompts
    from eightbit.eval.bench_engine import run_requests
    from eightbit.eval.bench_host import build_host_llm

    llm = build_host_llm(args.model, args.device, args.batch, args.stub_model, freeze=args.arm != "not frozen")
    if args.arm == "not frozen":
        gc.collect()  # the collection before the freeze, not the freeze
    vocab = llm.engine.hf_config.vocab_size
    warm_up = min(args.batch, args.requests)  # the kernels' first compiles (the first arm's are on disk after)
    run_requests(llm.engine, random_prompts(warm_up, args.prompt_len, vocab, -1), [args.new_tokens] * warm_up)
    collections, started = [], []
    gc.callbacks.append(lambda phase, info: started.append(time.perf_counter()) if phase == "start" else
                        collections.append((info["generation"], time.perf_counter() - started.pop())))
    steps, t0 = [], time.perf_counter()
    for r in range(-(-args.requests // args.batch)):
        n = min(args.batch, args.requests - r * args.batch)
        run = run_requests(llm.engine, random_prompts(n, args.prompt_len, vocab, r), [args.new_tokens] * n)
        steps += [s[0] for s in run["steps"] if s[3]]  # decode steps: a prefill step is long anyway
    elapsed = time.perf_counter() - t0
    per_gen = {g: [t for gen, t in collections if gen == g] for g in (0, 1, 2)}
    return dict(arm=args.arm, requests=args.requests, seconds=elapsed, steps=len(steps),
                slowest_decode_step_ms=1e3 * max(steps), tracked_objects=len(gc.get_objects()),
                collections={f"gen{g}": dict(count=len(v), total_ms=1e3 * sum(v), longest_ms=1e3 * max(v, default=0.0))
                             for g, v in per_gen.items()})


def format_results(results) -> str:
    lines = [f"{'arm':>11} {'requests':>8} {'s':>6} {'decode steps':>12} {'slowest ms':>10} {'tracked':>8}  "
             "collections by generation: count, longest ms"]
    for r in results:
        gens = "  ".join(f"{g} {c['count']} x, {c['longest_ms']:.1f}" for g, c in r["collections"].items())
        lines.append(f"{r['arm']:>11} {r['requests']:>8} {r['seconds']:6.1f} {r['steps']:>12} "
                     f"{r['slowest_decode_step_ms']:10.1f} {r['tracked_objects']:>8}  {gens}")
    if len(results) == 2:
        frozen, other = results
        slowest = other["slowest_decode_step_ms"] / frozen["slowest_decode_step_ms"]
        full = [r["collections"]["gen2"]["longest_ms"] for r in (other, frozen)]
        longest = (f"longest full collection {full[0]:.1f} / {full[1]:.1f} ms" if full[0] else
                   "no full collection in the arm not frozen: more --requests")
        lines.append(f"not frozen / frozen: slowest decode step {slowest:.1f}x; {longest}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b", help="a dummy shape (eightbit.engine.dummy)")
    p.add_argument("--requests", type=int, default=5120)
    p.add_argument("--batch", type=int, default=256, help="requests added at once; the next round when all end")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--stub-model", action="store_true", help="zero hidden states and fixed logits: host work alone")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)  # a child process's arm
    args = p.parse_args(argv)
    if min(args.requests, args.batch, args.prompt_len) < 1 or args.new_tokens < 2:
        p.error("--requests, --batch and --prompt-len must be at least 1, --new-tokens at least 2 (a decode step)")
    if args.arm:
        print(json.dumps(run_arm(args)))
        return 0
    results = []
    for arm in ARMS:
        child = [sys.executable, "-m", "eightbit.eval.bench_gc", *(argv if argv is not None else sys.argv[1:])]
        done = subprocess.run(child + ["--arm", arm], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the {arm!r} arm failed:\n{done.stderr[-2000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(format_results(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
