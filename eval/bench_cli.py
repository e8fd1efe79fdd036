"""`eightbit bench`: throughput, latency and capacity of eightbit and its peers, one system per process.

    eightbit bench run --system eightbit-int8 --benches capacity,latency,throughput --out DIR
    eightbit bench throughput --system hf-bf16-compile --num-requests 64 --hf-batch-sizes 64,32 --out DIR
    eightbit bench summary --out DIR [--inputs other/results.jsonl ...] [--expect sys1,sys2]

(also `python -m eightbit.eval.bench_cli ...`). Every run appends its records to DIR/results.jsonl, then
rewrites DIR/<bench>.json and DIR/<bench>.png and prints that benchmark's table from all records so far;
`summary` prints every table and the issue-6 goals (PASS / FAIL / n/a) and writes DIR/summary.json.
`--time-cap` is a soft budget for the whole process: a benchmark still running at the cap stops, and
its record says so (partial); the next ones are recorded as skipped.
"""

import os
import sys
import time

ALL_BENCHES = ("capacity", "latency", "throughput")
DEFAULT_HF_BATCH_SIZES = "64,32"


def _int_list(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


def add_bench_parser(subparsers):
    from eightbit.eval.bench_engine import ENGINE_SYSTEMS
    from eightbit.eval.bench_peers import PEER_SYSTEMS

    p = subparsers.add_parser("bench", help="benchmark throughput / latency / capacity vs HF, bnb, torchao")
    p.add_argument("action", choices=("run", "throughput", "latency", "capacity", "summary"),
                   help="run = the --benches of one --system; summary = merge results and check the goals")
    p.add_argument("--system", choices=sorted(ENGINE_SYSTEMS) + sorted(PEER_SYSTEMS), default="eightbit-int8",
                   help="the engine or peer to run (default: eightbit-int8)")
    p.add_argument("--benches", default="latency,throughput", help="for `run`: comma list of " + ",".join(ALL_BENCHES))
    p.add_argument("--model", default="llama-3-8b", help="a dummy shape: llama-3-8b, llama-3.2-1b, llama-2-7b, llama-tiny")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="results dir (default: $OUT, else ./bench_out)")
    p.add_argument("--seed", type=int, default=0, help="seeds the request list, prompts and weights (default: 0)")
    p.add_argument("--time-cap", type=float, default=None, help="soft wall-clock budget of this process, seconds")
    p.add_argument("--throughput-cap", type=float, default=None,
                   help="soft budget of the throughput benchmark alone (so a slow peer leaves time for latency)")
    # throughput
    p.add_argument("--num-requests", type=int, default=256, help="requests in the list (eightbit runs all)")
    p.add_argument("--input-len", default="100:1024", help="uniform inclusive range LO:HI (or one number)")
    p.add_argument("--output-len", default="100:1024", help="tokens generated per request: LO:HI or one number")
    p.add_argument("--prefix", type=int, default=None,
                   help="eightbit: also run the first N requests (to compare with peers run on that prefix)")
    p.add_argument("--peer-requests", type=int, default=64,
                   help="peers: run only the first N requests of the list (a multiple of the batch sizes)")
    p.add_argument("--hf-batch-sizes", default=DEFAULT_HF_BATCH_SIZES, help="peers' static batch sizes to try")
    # latency
    p.add_argument("--batch-sizes", default="1,16,64", help="latency batch sizes")
    p.add_argument("--prompt-len", type=int, default=512, help="latency: prompt tokens per request (default: 512)")
    p.add_argument("--new-tokens", type=int, default=128, help="latency: tokens generated per request (default: 128)")
    p.add_argument("--copy-bytes", type=int, default=1 << 30, help="copy-bandwidth buffer size (>= 1 GiB on GPU)")
    p.add_argument("--no-warmup", action="store_true", help="time the first run too (compiles, graph captures)")
    # engine
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="eightbit: engine option (default: 0.9)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="eightbit: engine option (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="eightbit: engine option (default: 8192)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="eightbit: engine option (default: the model's context)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, help="fixed KV size (CPU tests)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before launching the next (the engine's async_scheduling=False)")
    p.add_argument("--prefix-caching", action="store_true", help="leave prefix caching on (off by default)")
    # summary
    p.add_argument("--inputs", nargs="*", default=[], help="summary: more results.jsonl files or dirs to merge")
    p.add_argument("--expect", default="", help="summary: systems that should have results (missing ones are flagged)")
    p.set_defaults(func=run_bench)
    return p


def engine_options(args) -> dict:
    opts = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                enable_prefix_caching=args.prefix_caching, async_scheduling=not args.no_async_scheduling,
                seed=args.seed)
    if args.max_model_len:
        opts["max_model_len"] = args.max_model_len
    if args.kv_cache_memory_gb:
        opts["kv_cache_memory_gb"] = args.kv_cache_memory_gb
    return opts


def run_bench(args) -> int:
    if args.action == "summary":
        return summary(args)
    benches = ALL_BENCHES if args.action == "run" and args.benches == "all" else (
        [b.strip() for b in args.benches.split(",") if b.strip()] if args.action == "run" else [args.action])
    for b in benches:
        if b not in ALL_BENCHES:
            raise ValueError(f"unknown benchmark {b!r}; known: {ALL_BENCHES}")
    if not benches:
        raise ValueError("--benches names no benchmark; known: " + ",".join(ALL_BENCHES))
    from eightbit.engine.dummy import check_model_shape

    check_model_shape(args.model)
    check_run_args(args)
    run_system(args, benches)
    render(args.out, benches)
    return 0


MIN_COPY_BYTES = 256 << 20  # the copy must stream from HBM: an H200's L2 holds 50 MB


def check_run_args(args) -> None:
    """Raise ValueError for the numbers a run would otherwise take up only after minutes of engine building (or run
    with: a batch size of 0 gave an `ok` record of 0 tok/s, --prefix -5 all but the last 5 requests)."""
    from eightbit.eval.bench_common import parse_range

    for name in ("batch_sizes", "hf_batch_sizes"):
        text = getattr(args, name)
        try:
            values = _int_list(text)
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be comma-separated integers >= 1, got {text!r}")
    for name in ("input_len", "output_len"):
        try:
            parse_range(getattr(args, name))
        except ValueError:
            raise ValueError(f"--{name.replace('_', '-')} must be LO:HI or N with 1 <= LO <= HI, "
                             f"got {getattr(args, name)!r}") from None
    for name in ("num_requests", "peer_requests", "prefix", "prompt_len", "new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and args.copy_bytes < MIN_COPY_BYTES:
        raise ValueError(f"--copy-bytes must be >= {MIN_COPY_BYTES} on a GPU (a smaller copy runs in its L2 and "
                         f"lowers every % of the roofline), got {args.copy_bytes}")


def _log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_system(args, benches):
    """Run `benches` for args.system in this process, appending each record as soon as it exists."""
    import torch

    from eightbit.eval.bench_common import append_records, environment, make_requests, measure_copy_bandwidth, short_error
    from eightbit.eval.bench_engine import ENGINE_SYSTEMS, Deadline
    from eightbit.engine.dummy import KNOWN_SHAPES

    deadline = Deadline(args.time_cap)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    base = dict(system=args.system, model=args.model, device=device, seed=args.seed, time=time.time(),
                input_len=args.input_len, output_len=args.output_len, env=environment(device))
    emit = lambda *records: append_records(args.out, records)  # noqa: E731
    is_engine = args.system in ENGINE_SYSTEMS

    copy_gbs = None
    if "latency" in benches:  # first: measured after capacity's three engines, it came out 3-15 % low
        try:
            _log("copy bandwidth")
            copy = measure_copy_bandwidth(device, args.copy_bytes)
            copy_gbs = copy["best_gbs"]
            emit(dict(base, bench="copy", ok=True, **copy))
            _log(f"copy bandwidth {copy_gbs:.0f} GB/s ({copy})")
        except Exception as e:
            emit(dict(base, bench="copy", ok=False, error=short_error(e)))

    if "capacity" in benches:
        from eightbit.eval.bench_engine import bench_capacity

        _log(f"capacity: {args.model}")
        opts = engine_options(args)
        opts.pop("enforce_eager")
        emit(bench_capacity(args.model, device, deadline, dict(base, system="eightbit"), **opts))
        benches = [b for b in benches if b != "capacity"]
    if not benches:
        return

    vocab = KNOWN_SHAPES[args.model]["vocab_size"] if args.model in KNOWN_SHAPES else 32000
    requests = make_requests(args.num_requests, args.input_len, args.output_len, vocab, args.seed)
    batch_sizes = _int_list(args.batch_sizes)
    warmup = not args.no_warmup

    _log(f"build {args.system} ({args.model}, {device})")
    try:
        if is_engine:
            from eightbit.eval.bench_engine import build_llm, engine_info

            system = build_llm(args.system, args.model, device, **engine_options(args))
            info = engine_info(system)
            _log(f"built: {info['capacity_tokens']} KV tokens, {info['kv_bytes_per_token']:.0f} B/token, "
                 f"{info['weights']['shared'] / 1e9:.2f} GB of weights per step")
        else:
            from eightbit.eval.bench_peers import HFSystem

            system = HFSystem(args.system, args.model, device, args.seed)
    except Exception as e:
        _log(f"build failed: {short_error(e, 400)}")
        for b in benches:
            emit(dict(base, bench=b, ok=False, error="build failed: " + short_error(e), batch=None,
                      num_requests=len(requests) if is_engine else min(args.peer_requests, len(requests))))
        return

    for bench in benches:
        if bench == "latency":
            for batch in batch_sizes:
                _log(f"latency batch {batch} ({deadline.left():.0f} s left)")
                if is_engine:
                    from eightbit.eval.bench_engine import bench_latency

                    recs = bench_latency(system, [batch], args.prompt_len, args.new_tokens, args.seed, deadline,
                                         copy_gbs, warmup, base)
                else:
                    recs = system.bench_latency([batch], args.prompt_len, args.new_tokens, args.seed, deadline,
                                                copy_gbs, warmup, base)
                emit(*recs)
                _log(_latency_line(recs[0]))
        elif bench == "throughput":
            bench_deadline = deadline
            if args.throughput_cap is not None and args.throughput_cap < deadline.left():
                bench_deadline = Deadline(args.throughput_cap)
            if is_engine:
                from eightbit.eval.bench_engine import bench_throughput

                runs = [requests]
                if args.prefix and args.prefix < len(requests):  # the short run first: it also warms up
                    runs.insert(0, requests[: args.prefix])
                for i, reqs in enumerate(runs):
                    _log(f"throughput: {len(reqs)} of {len(requests)} requests ({bench_deadline.left():.0f} s left)")
                    rec = bench_throughput(system, reqs, bench_deadline, warmup and i == 0, base, len(requests),
                                           args.seed)
                    emit(rec)
                    _log(_throughput_line(rec))
            else:
                prefix = requests[: min(args.peer_requests, len(requests))]
                odd = [b for b in _int_list(args.hf_batch_sizes) if len(prefix) % b]
                if odd:
                    _log(f"note: {len(prefix)} requests is not a multiple of batch {odd}: the last batch is smaller "
                         "(and a compiled peer recompiles for it)")
                _log(f"throughput: {len(prefix)} of {len(requests)} requests, batch sizes {args.hf_batch_sizes}")
                rec = system.bench_throughput(prefix, _int_list(args.hf_batch_sizes), bench_deadline, warmup, base,
                                              len(requests))
                emit(rec)
                _log(_throughput_line(rec))


def _latency_line(r):
    if not r.get("ok"):
        return f"  {r['system']} batch {r['batch']}: {r.get('error')}"
    from eightbit.eval.bench_common import fmt

    return (f"  {r['system']} batch {r['batch']}: TTFT {fmt(r['ttft_ms'])} ms, TPOT {fmt(r['tpot_ms'], 2)} ms, "
            f"{fmt(r['tok_s'])} tok/s, {fmt(r['achieved_gbs'])} GB/s = {fmt(r['roofline_pct'])}% of roofline")


def _throughput_line(r):
    if not r.get("ok"):
        return f"  {r['system']} {r.get('num_requests')} requests: {r.get('error')}"
    from eightbit.eval.bench_common import fmt

    return (f"  {r['system']} {r['num_requests']} requests: {fmt(r['output_tok_s'])} output tok/s in "
            f"{fmt(r['elapsed_s'])} s{' (partial)' if r.get('partial') else ''}")


# --- rendering ---------------------------------------------------------------------------


def _records(out_dir, extra=()):
    from eightbit.eval.bench_common import load_records

    return against_best_copy(load_records([out_dir, *extra]))


def against_best_copy(records):
    """The records with every latency roofline % taken against the best copy bandwidth measured on its card (GPU
    name and host) in any of the merged processes: each process measures its own, and one that measured low
    (the int8 process measured 3-15 % below the others in every run through the fortieth) inflated its %."""
    def card(r):
        env = r.get("env") or {}
        return env.get("gpu"), env.get("host")

    best = {}
    for r in records:
        if r.get("bench") == "copy" and r.get("ok") and r.get("best_gbs"):
            best[card(r)] = max(best.get(card(r), 0.0), r["best_gbs"])
    out = []
    for r in records:
        copy = best.get(card(r))
        if r.get("bench") == "latency" and copy and r.get("achieved_gbs") is not None:
            r = dict(r, copy_gbs_own=r.get("copy_gbs"), copy_gbs=copy, roofline_pct=100.0 * r["achieved_gbs"] / copy)
        out.append(r)
    return out


def throughput_rows(records):
    """Latest throughput record per (system, num_requests, batch size: a peer may run at several), with the int8
    speed-up at the same list."""
    from eightbit.eval.bench_common import latest

    recs = latest([r for r in records if r.get("bench") == "throughput"],
                  lambda r: (r["system"], r.get("num_requests"), r.get("batch_size")))
    int8 = {r["num_requests"]: r for r in recs if r["system"] == "eightbit-int8" and r.get("ok") and not r.get("partial")}
    full = max(int8) if int8 else None
    rows = []
    for r in sorted(recs, key=lambda r: (_system_order(r["system"]), -(r.get("num_requests") or 0))):
        ref = int8.get(r.get("num_requests"))
        ref_note = ""
        if ref is None and full is not None:
            ref, ref_note = int8[full], f" (vs int8 on {full} requests)"
        speedup = None
        if r.get("ok") and ref and r.get("output_tok_s"):
            speedup = ref["output_tok_s"] / r["output_tok_s"]
        note = r.get("error") or ""
        if r.get("note"):
            note = (note + "; " if note else "") + r["note"]
        if r.get("num_requests_total") and r.get("num_requests") and r["num_requests"] < r["num_requests_total"]:
            note = f"prefix {r['num_requests']}/{r['num_requests_total']}" + ("; " + note if note else "")
        rows.append(dict(system=r["system"], requests=r.get("num_requests"), batch=r.get("batch_size"),
                         output_tok_s=r.get("output_tok_s") if r.get("ok") else None, int8_speedup=speedup,
                         same_requests=not ref_note,
                         elapsed_s=r.get("elapsed_s"), note=(note + ref_note).strip("; "), ok=r.get("ok")))
    return rows


def latency_rows(records):
    from eightbit.eval.bench_common import latest

    recs = latest([r for r in records if r.get("bench") == "latency"],
                  lambda r: (r["system"], r.get("batch"), r.get("prompt_len"), r.get("new_tokens")))
    recs.sort(key=lambda r: (_system_order(r["system"]), r.get("batch") or 0))
    rows = []
    for r in recs:
        note = r.get("error") or r.get("note") or ""
        rows.append(dict(system=r["system"], batch=r.get("batch"), tokens=f"{r.get('prompt_len')}+{r.get('new_tokens')}",
                         ttft_ms=r.get("ttft_ms"), ttft_max_ms=r.get("ttft_ms_max"), tpot_ms=r.get("tpot_ms"),
                         tok_s=r.get("tok_s"), decode_tok_s=r.get("decode_tok_s"),
                         mb_per_token=r["bytes_per_token"] / 1e6 if r.get("bytes_per_token") else None,
                         achieved_gbs=r.get("achieved_gbs"), roofline_pct=r.get("roofline_pct"), note=note,
                         ok=r.get("ok")))
    return rows


def capacity_rows(records):
    from eightbit.eval.bench_common import latest

    recs = latest([r for r in records if r.get("bench") == "capacity"], lambda r: r.get("model"))
    rows = []
    for r in recs:
        configs = r.get("configs", {})
        ref = configs.get("w8a8 + bf16 KV", {}).get("tokens")
        for name, c in configs.items():
            rows.append(dict(model=r.get("model"), config=name, kv_bytes_per_token=c.get("kv_bytes_per_token"),
                             tokens=c.get("tokens"), vs_bf16_kv=c["tokens"] / ref if ref and c.get("tokens") else None,
                             note=c.get("error", "")))
    return rows


SYSTEM_ORDER = ("eightbit-int8", "eightbit-bf16", "hf-bf16-compile", "hf-bf16", "hf-bnb-int8", "hf-torchao-int8",
                "hf-torchao-int8-compile")


def _system_order(name):
    return SYSTEM_ORDER.index(name) if name in SYSTEM_ORDER else len(SYSTEM_ORDER)


def throughput_table(rows):
    from eightbit.eval.bench_common import format_table

    return format_table(
        ["system", "requests", "batch", "output tok/s", "int8 speed-up x", "elapsed s", "note"],
        [[r["system"], r["requests"], r["batch"], r["output_tok_s"], r["int8_speedup"], r["elapsed_s"], r["note"]]
         for r in rows],
        "Offline throughput (output tokens/s, real tokens only; speed-up = eightbit-int8 / this)")


def latency_table(rows):
    from eightbit.eval.bench_common import format_table

    return format_table(
        ["system", "batch", "prompt+new", "TTFT ms", "TTFT all ms", "TPOT ms", "tok/s", "decode tok/s", "MB/token",
         "GB/s", "% roofline", "note"],
        [[r["system"], r["batch"], r["tokens"], r["ttft_ms"], r.get("ttft_max_ms"), r["tpot_ms"], r["tok_s"],
          r["decode_tok_s"], r["mb_per_token"], r["achieved_gbs"], r["roofline_pct"], r["note"]] for r in rows],
        "Latency (TTFT = mean over the batch's requests; TTFT all = until every request has its first token, "
        "which is what an HF batch's one prefill gives, so compare peers in that column; tok/s = all generated "
        "tokens / wall time incl. prefill; GB/s and % of the copy bandwidth over the decode-only steps)")


def capacity_table(rows):
    from eightbit.eval.bench_common import format_table

    return format_table(["model", "config", "KV bytes/token", "tokens", "vs bf16 KV", "note"],
                        [[r["model"], r["config"], r["kv_bytes_per_token"], r["tokens"], r["vs_bf16_kv"], r["note"]]
                         for r in rows],
                        "KV-cache capacity at the same gpu_memory_utilization (tokens = num_blocks x block_size)")


def plot_throughput(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["output_tok_s"]]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    labels = [f"{r['system']} ({r['requests']} req{', b' + str(r['batch']) if r['batch'] else ''})" for r in rows]
    ax.barh(range(len(rows)), [r["output_tok_s"] for r in rows],
            color=["tab:green" if r["system"].startswith("eightbit-int8") else "tab:blue" for r in rows])
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        if r["int8_speedup"] and r["same_requests"]:  # against another request list it is another workload
            ax.text(r["output_tok_s"], i, f"  int8 {r['int8_speedup']:.2f}x", va="center", fontsize=8)
    ax.set_xlabel("output tokens/s (real tokens)")
    ax.set_title("Offline throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    systems = sorted({r["system"] for r in rows}, key=_system_order)
    for key, ax, label in (("ttft_ms", axes[0], "TTFT ms"), ("tpot_ms", axes[1], "TPOT ms"),
                           ("roofline_pct", axes[2], "% of copy-bandwidth roofline (decode)")):
        for s in systems:
            pts = [(r["batch"], r[key]) for r in rows if r["system"] == s and r[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_capacity(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["tokens"]]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar([f"{r['model']}\n{r['config']}" for r in rows], [r["tokens"] for r in rows])
    for i, r in enumerate(rows):
        if r["vs_bf16_kv"]:
            ax.text(i, r["tokens"], f"{r['vs_bf16_kv']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("KV tokens that fit")
    ax.set_title("KV-cache capacity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RENDER = {
    "throughput": (throughput_rows, throughput_table, plot_throughput),
    "latency": (latency_rows, latency_table, plot_latency),
    "capacity": (capacity_rows, capacity_table, plot_capacity),
}


def render(out_dir, benches, extra=(), quiet=False, records=None):
    """Print each benchmark's table and write <bench>.json and <bench>.png from all records so far (`records`: as
    `_records` reads them, when the caller has them already)."""
    from eightbit.eval.bench_common import write_json

    records = _records(out_dir, extra) if records is None else records
    tables = {}
    for bench in benches:
        rows_fn, table_fn, plot_fn = RENDER[bench]
        rows = rows_fn(records)
        raw = [r for r in records if r.get("bench") == bench]
        write_json(os.path.join(out_dir, f"{bench}.json"), dict(rows=rows, records=raw))
        try:
            plot_fn(rows, os.path.join(out_dir, f"{bench}.png"))
        except Exception as e:  # a plot must never cost the numbers
            print(f"plot {bench}: {type(e).__name__}: {e}", file=sys.stderr)
        tables[bench] = table_fn(rows)
        if not quiet:
            print("\n" + tables[bench], flush=True)
    return records, tables


# --- goals (issue 6) ---------------------------------------------------------------------

TIMING_TOLERANCE = 0.03  # "no worse" allows 3% of run-to-run noise


def check_goals(records) -> list[dict]:
    from eightbit.eval.bench_common import latest

    goals = []

    def goal(name, value, target, passed, detail=""):
        goals.append(dict(goal=name, value=value, target=target,
                          status="n/a" if passed is None else ("PASS" if passed else "FAIL"), detail=detail))

    lat = latest([r for r in records if r.get("bench") == "latency" and r.get("ok")],
                 lambda r: (r["system"], r.get("batch"), r.get("prompt_len"), r.get("new_tokens")))
    b1 = [r for r in lat if r["system"] == "eightbit-int8" and r["batch"] == 1 and r.get("roofline_pct")]
    goal("batch-1 decode W8A8+KV8, % of roofline", b1[-1]["roofline_pct"] if b1 else None, ">= 70",
         b1[-1]["roofline_pct"] >= 70 if b1 else None,
         f"{b1[-1]['achieved_gbs']:.0f} of {b1[-1]['copy_gbs']:.0f} GB/s" if b1 else "no batch-1 int8 result")

    thr = latest([r for r in records if r.get("bench") == "throughput" and r.get("ok") and not r.get("partial")],
                 lambda r: (r["system"], r.get("num_requests")))
    by = {(r["system"], r["num_requests"]): r for r in thr}
    int8_sizes = sorted((n for s, n in by if s == "eightbit-int8"), reverse=True)
    bf16_same = [n for n in int8_sizes if ("eightbit-bf16", n) in by]
    if bf16_same:
        n = bf16_same[0]
        ratio = by[("eightbit-int8", n)]["output_tok_s"] / by[("eightbit-bf16", n)]["output_tok_s"]
        goal("throughput W8A8+KV8 / eightbit bf16", ratio, ">= 1.5", ratio >= 1.5, f"{n} requests")
    else:
        goal("throughput W8A8+KV8 / eightbit bf16", None, ">= 1.5", None, "missing a complete run of both")
    # HF's best batch size: its fastest run on the largest request list that an int8 run has too (thr keeps only the
    # latest run per list, which a second call at another batch size replaced), complete runs before partial ones
    hf_runs = [r for r in records if r.get("bench") == "throughput" and r.get("ok") and r["system"] == "hf-bf16-compile"]
    if hf_runs:
        paired = [r for r in hf_runs if ("eightbit-int8", r["num_requests"]) in by] or hf_runs
        largest = max(r["num_requests"] for r in paired)
        same = [r for r in paired if r["num_requests"] == largest]
        h = max([r for r in same if not r.get("partial")] or same, key=lambda r: r["output_tok_s"])
        n = h["num_requests"]
        ref = by.get(("eightbit-int8", n))  # the same requests only: other lists are other workloads
        detail = f"HF at batch {h.get('batch_size')} on {n} requests"
        if ref is None:
            detail += " (no int8 run on the same requests: run int8 with --prefix " + str(n) + ")"
        if h.get("partial"):
            detail += ", HF partial (stopped at its cap)"
        ratio = ref["output_tok_s"] / h["output_tok_s"] if ref else None
        goal("throughput W8A8+KV8 / HF bf16 compiled (best batch)", ratio, ">= 3", ratio >= 3 if ratio else None,
             detail)
    else:
        goal("throughput W8A8+KV8 / HF bf16 compiled (best batch)", None, ">= 3", None, "no HF compiled result")

    cap = [r for r in records if r.get("bench") == "capacity" and r.get("kv_ratio")]
    goal("KV tokens, int8 KV / bf16 KV", cap[-1]["kv_ratio"] if cap else None, ">= 1.8",
         cap[-1]["kv_ratio"] >= 1.8 if cap else None,
         f"same W8A8 weights; whole bf16 system: {cap[-1].get('system_ratio', 0):.2f}x" if cap else "no capacity result")

    pairs = []
    for r in lat:
        if r["system"] != "eightbit-int8":
            continue
        other = [o for o in lat if o["system"] == "eightbit-bf16" and o["batch"] == r["batch"]
                 and o.get("prompt_len") == r.get("prompt_len") and o.get("new_tokens") == r.get("new_tokens")]
        if other and r.get("ttft_ms") and r.get("tpot_ms") and other[-1].get("ttft_ms") and other[-1].get("tpot_ms"):
            pairs.append((r["batch"], r["ttft_ms"] / other[-1]["ttft_ms"], r["tpot_ms"] / other[-1]["tpot_ms"]))
    if pairs:
        worst = max(max(t, p) for _, t, p in pairs)
        detail = ", ".join(f"b{b}: TTFT {t:.2f}x TPOT {p:.2f}x" for b, t, p in sorted(pairs))
        goal("TTFT and TPOT, W8A8+KV8 / eightbit bf16 (worst)", worst, f"<= 1 (+{TIMING_TOLERANCE:.0%} noise)",
             worst <= 1 + TIMING_TOLERANCE, detail)
    else:
        goal("TTFT and TPOT, W8A8+KV8 / eightbit bf16 (worst)", None, "<= 1", None, "missing latency pairs")
    return goals


def goals_table(goals):
    from eightbit.eval.bench_common import format_table

    return format_table(["goal", "value", "target", "status", "detail"],
                        [[g["goal"], g["value"], g["target"], g["status"], g["detail"]] for g in goals],
                        "Issue 6 goals")


def check_one_workload(records) -> None:
    """The tables and goals pair records by system and request count only: refuse to merge records of several
    models, or of several request lists (their lengths and seed; records before the fifty-second session have no
    lengths and count as any)."""
    runs = [r for r in records if r.get("bench") in ("latency", "throughput")]
    models = sorted({r.get("model") for r in runs if r.get("model")})
    lists = sorted({(r.get("input_len"), r.get("output_len"), r.get("seed")) for r in runs
                    if r.get("bench") == "throughput" and r.get("input_len") is not None}, key=str)
    if len(models) > 1 or len(lists) > 1:
        raise ValueError("the records merged hold several " + ("models " + ", ".join(models) if len(models) > 1 else
                         "request lists (input, output lengths, seed) " + ", ".join(map(str, lists)))
                         + ": summarize each in its own --out")


def summary(args) -> int:
    from eightbit.eval.bench_common import fmt, format_table, write_json

    os.makedirs(args.out, exist_ok=True)
    records = _records(args.out, args.inputs)  # rooflines against the best copy bandwidth (against_best_copy)
    check_one_workload(records)
    records, tables = render(args.out, ALL_BENCHES, quiet=True, records=records)
    expected = [s for s in args.expect.split(",") if s]
    present = {r.get("system") for r in records}
    missing = [s for s in expected if s not in present]
    copies = [r for r in records if r.get("bench") == "copy" and r.get("ok")]
    goals = check_goals(records)
    envs = [r["env"] for r in records if r.get("env")]
    write_json(os.path.join(args.out, "summary.json"),
               dict(goals=goals, missing=missing, env=envs[-1] if envs else None,
                    copy=[{k: c.get(k) for k in ("system", "copy_", "torch_elementwise", "triton", "best_gbs")}
                          for c in copies],
                    throughput=throughput_rows(records), latency=latency_rows(records),
                    capacity=capacity_rows(records)))
    print("\n==================== eightbit bench summary ====================")
    if envs:
        e = envs[-1]
        print(f"device: {e.get('gpu') or 'cpu'}; torch {e.get('torch')}, transformers {e.get('transformers')}, "
              f"triton {e.get('triton', '-')}")
    if copies:
        print("copy bandwidth (GB/s, read + written): " + ", ".join(
            f"{c['system']} {c['best_gbs']:.0f} (copy_ {fmt(c['copy_'])}, elementwise {fmt(c['torch_elementwise'])}, "
            f"triton {fmt(c['triton'])})" for c in copies))
    for bench in ALL_BENCHES:
        print("\n" + tables[bench])
    if missing:
        print("\n" + format_table(["system", "status"], [[s, "no result: crashed or killed at its time cap, see the log"]
                                                         for s in missing], "Missing systems"))
    print("\n" + goals_table(goals), flush=True)
    return 0


def main(argv=None) -> int:
    """`python -m eightbit.eval.bench_cli run ...` = `eightbit bench run ...`."""
    from eightbit.cli import main as eightbit_main

    return eightbit_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
