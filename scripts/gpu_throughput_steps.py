"""Where the offline-throughput run's time goes, step by step: the throughput benchmark's workload
(256 requests, input and output U[100, 1024], seed 0, one warm-up) on a dummy model, with the wall
time of every step grouped by kind (prefill / mixed vs decode-only) and by decode batch size.

python scripts/gpu_throughput_steps.py [system ...]   (default eightbit-int8 eightbit-bf16; model llama-3-8b)

A decode batch whose median step time is out of line with its neighbours points at a kernel
configuration that misbehaves at that size (CUDA graphs are captured in multiples of 16).
Writes steps_<system>.json (wall s, sequences, context tokens, decode-only) to $OUT or '.'.
"""

import json
import os
import sys

from eightbit.eval.bench_common import make_requests
from eightbit.eval.bench_engine import build_llm, engine_info, run_requests

BATCH_RANGES = [(200, 257), (150, 200), (100, 150), (50, 100), (10, 50), (0, 10)]


def run(system, model="llama-3-8b"):
    llm = build_llm(system, model)
    info = engine_info(llm)
    reqs = make_requests(256, (100, 1024), (100, 1024), info["vocab_size"], seed=0)
    warm = make_requests(32, (100, 1024), (1, 8), info["vocab_size"], seed=104729)
    run_requests(llm.engine, [r.prompt for r in warm], [r.output_len for r in warm])
    result = run_requests(llm.engine, [r.prompt for r in reqs], [r.output_len for r in reqs])
    steps = result["steps"]
    with open(os.path.join(os.environ.get("OUT", "."), f"steps_{system}.json"), "w") as f:
        json.dump(steps, f)
    decode = [s for s in steps if s[3]]
    other = [s for s in steps if not s[3]]
    print(f"{system}: {result['elapsed']:.2f} s, {len(steps)} steps; decode-only {len(decode)} steps "
          f"{sum(s[0] for s in decode):.2f} s; prefill / mixed {len(other)} steps {sum(s[0] for s in other):.2f} s")
    for lo, hi in BATCH_RANGES:
        sel = [s for s in decode if lo <= s[1] < hi]
        if sel:
            walls = sorted(s[0] for s in sel)
            print(f"  decode batch [{lo:3d}, {hi:3d}): {len(sel):4d} steps {sum(walls):6.2f} s, median "
                  f"{1000 * walls[len(walls) // 2]:6.2f} ms, mean context {sum(s[2] for s in sel) / sum(s[1] for s in sel):5.0f}")
    medians = {}
    for wall, n, _, is_decode in decode:
        medians.setdefault(n, []).append(wall)
    print("  median ms per decode batch size: " + " ".join(
        f"{n}:{1000 * sorted(w)[len(w) // 2]:.1f}" for n, w in sorted(medians.items())))


if __name__ == "__main__":
    for name in sys.argv[1:] or ["eightbit-int8", "eightbit-bf16"]:
        run(name)
